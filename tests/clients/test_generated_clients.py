"""Clients generated from /openapi.json, as a new user makes them, drive a whole run.

The generators are the real ones at pinned versions (tests/clients/setup.sh installs them:
openapi-python-client in .venv-clients, openapi-typescript + openapi-fetch + TypeScript with
npm from tests/clients/ts/), run with their default options on the document a live API
serves. Each client then drives a run on the tiny model, against that API (uvicorn) and a
real worker: create (and replay it with its Idempotency-Key), poll until it completes, list
its trajectories, read its metrics, its event stream and its export, and cancel a second
run. The TypeScript one is compiled with ``tsc --strict`` first, and its source asserts
types the document must give (tests/clients/ts/drive.ts). docs/clients.md shows the same
commands.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from app.events.schemas import RUN_EVENT_TYPES
from tests.support import ROOT

pytestmark = pytest.mark.clients

HERE = Path(__file__).parent
TS = HERE / "ts"
VENV = ROOT / ".venv-clients"
# What openapi-python-client may still warn about: it reads no application/x-ndjson, so the
# export's answer (and the dataset upload's JSONL body, next to its multipart one) is raw.
NDJSON_ONLY = {"GET /trajectories/export", "POST /datasets"}


def _run(args: list[str], *, cwd: Path, env: dict[str, str] | None = None, timeout: float = 300):
    done = subprocess.run(
        args,
        cwd=cwd,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"{args}:\n{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    return done


def _check_the_run(seen: dict[str, Any]) -> None:
    """What both drivers print, checked alike."""
    assert seen["created"]["status"] == "pending"
    assert re.fullmatch(r'"[0-9a-f]{32}-\d+"', seen["created"]["etag"])
    assert seen["replayed"] == "true" and seen["replayed_id"] == seen["created"]["id"]
    assert seen["finished"] == {"status": "completed", "step": 2, "error": None}
    # 2 steps of 2 groups of 4 rollouts, each a system/user/assistant conversation.
    assert seen["trajectories"] == 16
    assert {"user", "assistant"} <= set(seen["roles"])
    assert all(isinstance(r, int | float) for r in seen["rewards"])
    assert seen["metrics"]  # the trainer's series (loss, reward …)
    # The stream's events, a real run's: each of a type the document names, then `end`.
    assert seen["streamed"][-1] == "end" and "step" in seen["streamed"]
    assert set(seen["streamed"][:-1]) <= set(RUN_EVENT_TYPES), seen["streamed"]
    assert seen["exported"] == 16 and seen["exported_run"] == seen["created"]["id"]
    # A queued run is cancelled at once; a claimed one when its worker sees the request.
    assert seen["cancel_answer"] in (["cancelled", False], ["pending", True], ["collecting", True])
    assert seen["cancelled"] == "cancelled"


def _generated_python(document: Path, out: Path) -> tuple[Path, str]:
    """openapi-python-client's package for ``document`` (under ``out``), and its output."""
    package = out / "trainyard_client"
    env = {"PATH": f"{VENV / 'bin'}{os.pathsep}{os.environ['PATH']}"}  # its ruff hooks
    done = _run(
        [
            *(str(VENV / "bin" / "openapi-python-client"), "generate"),
            *("--path", str(document), "--meta", "none", "--output-path", str(package)),
        ],
        cwd=out,
        env=env,
    )
    return package, done.stdout + done.stderr


def test_a_python_client_generated_by_openapi_python_client_drives_a_run(
    service: tuple[str, str, Path],
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    base, key, document = service
    package, said = _generated_python(document, tmp_path)
    # Every operation and model is generated; only the NDJSON bodies are read raw.
    assert "Unable to" not in said and "removal of" not in said, said
    warned = set(re.findall(r"WARNING parsing (\w+ \S+) within", said))
    assert warned <= NDJSON_ONLY, said
    assert (package / "api" / "runs" / "create_run.py").exists()
    done = _run(
        [str(VENV / "bin" / "python"), str(HERE / "python_drive.py"), base, key, str(tiny_model)],
        cwd=tmp_path,
        env={"PYTHONPATH": str(tmp_path)},
        timeout=900,
    )
    seen = json.loads(done.stdout.splitlines()[-1])
    _check_the_run(seen)
    assert seen["typed"] == {"grpo": True, "reward": True, "beta": 0}


def test_a_typescript_client_compiled_with_tsc_strict_drives_a_run(
    service: tuple[str, str, Path],
    tiny_model: Path,
    tmp_path: Path,
) -> None:
    base, key, document = service
    project = tmp_path / "ts"
    project.mkdir()
    for name in ("drive.ts", "tsconfig.json", "package.json"):
        shutil.copy(TS / name, project / name)
    (project / "node_modules").symlink_to(TS / "node_modules")
    generate = TS / "generator" / "node_modules" / ".bin" / "openapi-typescript"
    _run([str(generate), str(document), "-o", str(project / "trainyard.d.ts")], cwd=project)
    tsc = str(project / "node_modules" / ".bin" / "tsc")
    # The types the document gives must hold drive.ts's assertions: with the document's old
    # gaps (request defaults required, `unknown` settings, strings for enums …) it fails here.
    _run([tsc, "-p", "tsconfig.json", "--strict", "--noEmit"], cwd=project)
    _run([tsc, "-p", "tsconfig.json"], cwd=project)
    done = _run(
        ["node", str(project / "dist" / "drive.js"), base, key, str(tiny_model)],
        cwd=project,
        timeout=900,
    )
    seen = json.loads(done.stdout.splitlines()[-1])
    _check_the_run(seen)
    assert seen["settings"] == {"beta": 0, "rewardType": "function"}
