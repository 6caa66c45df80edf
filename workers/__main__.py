"""Worker processes' entry points, started by the ``trainyard`` CLI as their own programs
(``python -m workers …``), so the CLI — which lives in ``app/`` with the API — never imports
the workers' code.

    python -m workers worker --queues=gpu --pool=solo …   (Celery's worker arguments)
    python -m workers tiny-model PATH [SEED] [--tools]   (--tools: the agent variant)
"""

from __future__ import annotations

import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    command, *args = argv or ["--help"]
    if command == "worker":
        from workers.celery_app import get_celery

        get_celery().worker_main(["worker", *args])
    elif command == "tiny-model":
        from workers.ml.tiny_model import build_tiny_model

        tools = "--tools" in args
        args = [a for a in args if a != "--tools"]
        build_tiny_model(Path(args[0]), seed=int(args[1]) if len(args) > 1 else 0, tools=tools)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
