"""Worker processes' entry points, started by the ``trainyard`` CLI as their own programs
(``python -m workers …``), so the CLI — which lives in ``app/`` with the API — never imports
the workers' code.

    python -m workers worker --queues=gpu --pool=solo …   (Celery's worker arguments)
    python -m workers tiny-model PATH [SEED] [--tools] [--width W] [--layers L]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    command, *args = argv or ["--help"]
    if command == "worker":
        from workers.celery_app import get_celery

        get_celery().worker_main(["worker", *args])
    elif command == "tiny-model":
        from workers.ml.tiny_model import build_tiny_model

        p = argparse.ArgumentParser(prog="python -m workers tiny-model")
        p.add_argument("path", type=Path)
        p.add_argument("seed", type=int, nargs="?", default=0)
        p.add_argument("--tools", action="store_true", help="the agent variant")
        p.add_argument("--width", type=int, default=64)
        p.add_argument("--layers", type=int, default=2)
        a = p.parse_args(args)
        build_tiny_model(a.path, seed=a.seed, tools=a.tools, width=a.width, layers=a.layers)
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
