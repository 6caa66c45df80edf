"""A Trainyard installation of a benchmark's own: its database, broker prefix, home and API
key, its API and worker processes, the HTTP calls a harness makes on a run, the run bodies
of the project's presets, and the options all of that takes."""

from __future__ import annotations

import argparse
import math
import os
import re
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from app.core.config_files import apply_overrides, load_preset
from app.runs.lifecycle.status import TERMINAL
from kit import REPO, BenchError, log
from kit.processes import Server, free_port, run_checked, start_server, wait_for_log, wait_ready
from kit.stores import (
    PG_ADMIN_URL,
    clear_redis_prefix,
    drop_database,
    migrate,
    pg_url_for,
    recreate_database,
)

LETTERS = REPO / "configs" / "runs" / "letters.yaml"
AGENT_CALCULATOR = REPO / "configs" / "runs" / "agent-calculator.yaml"


def require_cli(path: Path) -> None:
    """``--trainyard-bin`` is there (it migrates, makes keys and models, runs the services)."""
    if not path.exists():
        raise BenchError(f"{path} not found: install the project first")


class Trainyard:
    """A Trainyard installation of a benchmark's own: a fresh database ``db_name`` beside
    ``--pg-url``, Redis keys under ``--broker-prefix``, ``home`` as TRAINYARD_HOME, an API
    key; its API and worker processes (``--trainyard-bin``); the HTTP calls a harness makes
    on a run. ``args`` holds the options of :func:`add_trainyard_args`; ``env`` adds or
    overrides settings."""

    def __init__(
        self,
        args: argparse.Namespace,
        *,
        name: str,
        db_name: str,
        servers: list[Server],
        home: Path | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.name = name
        self.cli = [str(args.trainyard_bin)]
        self.pg_url = args.pg_url
        self.db_name = db_name
        self.db_url = pg_url_for(args.pg_url, db_name)
        self.redis_url = args.redis_url
        self.broker_prefix = args.broker_prefix
        self.servers = servers
        self.env = dict(os.environ)
        self.env.update(
            TRAINYARD_DATABASE_URL=pg_url_for(args.pg_url, db_name, "postgresql+asyncpg"),
            TRAINYARD_REDIS_URL=args.redis_url,
            TRAINYARD_BROKER_PREFIX=args.broker_prefix,
            HF_HUB_OFFLINE="1",
            # The runs a benchmark makes name local model folders and import paths, which
            # only the open code policy lets through (the default, catalog, answers 422).
            TRAINYARD_CODE_POLICY="open",
        )
        self.home = home
        if home is not None:
            self.env.update(
                TRAINYARD_HOME=str(home), TRAINYARD_ARTIFACTS_DIR=str(home / "artifacts")
            )
        self.env.update(env or {})
        self.key = ""
        self.api: Server | None = None
        self.worker: Server | None = None

    def prepare(self, project: str = "bench") -> None:
        """A fresh, migrated database, no keys left under the broker prefix, an API key."""
        require_cli(Path(self.cli[0]))
        recreate_database(self.pg_url, self.db_name)
        self.clear_broker()
        migrate(self.env["TRAINYARD_DATABASE_URL"], self.cli, env=self.env)
        out = run_checked(
            [*self.cli, "keys", "create", "--project", project],
            env=self.env,
            what="creating an API key",
        )
        lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
        if not lines:
            raise BenchError("`trainyard keys create` printed nothing; expected the key last")
        self.key = lines[-1]

    def start(
        self, *, project: str = "bench", api_workers: int | None = None, timeout: float = 120.0
    ) -> None:
        """:meth:`prepare`, then the API and one worker, each waited for."""
        self.prepare(project)
        self.start_api(workers=api_workers, timeout=timeout)
        self.start_worker(timeout=timeout)

    def clear_broker(self) -> None:
        clear_redis_prefix(self.redis_url, self.broker_prefix)

    def start_api(self, *, workers: int | None = None, timeout: float = 120.0) -> Server:
        port = free_port()
        cmd = [*self.cli, "api", "--host", "127.0.0.1", "--port", str(port)]
        if workers is not None:
            cmd += ["--workers", str(workers)]
        self.api = start_server(
            f"{self.name}-api", cmd, env=self.env, base_url=f"http://127.0.0.1:{port}"
        )
        self.servers.append(self.api)
        wait_ready(self.api, "/healthz", timeout=timeout)
        return self.api

    def start_worker(self, *, timeout: float = 120.0) -> Server:
        """One ``worker --pool solo`` (both queues), as the GPU pool runs; waits for "ready"."""
        self.worker = start_server(
            f"{self.name}-worker", [*self.cli, "worker", "--pool", "solo"], env=self.env
        )
        self.servers.append(self.worker)
        # Celery's "… ready." line, as plain text or as the message of a JSON log line.
        wait_for_log(self.worker, re.compile(r"\bready\.?(?:\"\})?\s*$", re.M), timeout)
        return self.worker

    @property
    def base_url(self) -> str:
        assert self.api is not None, "start_api() first"
        return self.api.base_url

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.key}"}

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.base_url, headers=self.headers, timeout=30.0)

    def create_run(self, body: dict[str, Any]) -> dict[str, Any]:
        """POST /runs (202 expected); the run as answered."""
        with self.client() as client:
            r = client.post("/runs", json=body, headers={"Idempotency-Key": uuid.uuid4().hex})
        if r.status_code != 202:
            raise BenchError(f"POST /runs answered {r.status_code}: {r.text[:1000]}")
        return dict(r.json())

    def metrics(self, run_id: str, *names: str) -> dict[str, list[tuple[int, float]]]:
        """The run's metric series by name (GET /runs/{id}/metrics): [(step, value), …]."""
        with self.client() as client:
            r = client.get(f"/runs/{run_id}/metrics", params=[("name", n) for n in names])
            r.raise_for_status()
        return {
            s["name"]: [(int(p["step"]), float(p["value"])) for p in s["points"]]
            for s in r.json()["series"]
        }

    def cancel(self, run_id: str) -> None:
        with self.client() as client:
            r = client.post(f"/runs/{run_id}/cancel")
        if r.status_code not in (200, 202, 409):
            log(f"WARNING: cancel answered {r.status_code}: {r.text[:300]}")

    def wait_for_run(
        self,
        run_id: str,
        *,
        every: float,
        timeout: float | None = None,
        each: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """GET /runs/{id} every ``every`` s (``each`` gets every answer) until the run ended
        (``app.runs.lifecycle.status.TERMINAL``); the run as it ended. BenchError if it did
        not complete, if the worker died or after ``timeout`` s."""
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.client() as client:
            while True:
                r = client.get(f"/runs/{run_id}")
                r.raise_for_status()
                run: dict[str, Any] = r.json()
                if each is not None:
                    each(run)
                if run["status"] in TERMINAL:
                    break
                if self.worker is not None:
                    self.worker.check_alive()
                if deadline is not None and time.monotonic() > deadline:
                    raise BenchError(
                        f"run {run_id} still {run['status']} after {timeout:.0f} s"
                        + (
                            f"; last lines of {self.worker.log_path}:\n{self.worker.tail()}"
                            if self.worker
                            else ""
                        )
                    )
                time.sleep(every)
        if run["status"] != "completed":
            raise BenchError(
                f"run {run_id} ended {run['status']}: {run.get('error')}"
                + (f"; worker log: {self.worker.log_path}" if self.worker else "")
            )
        return run

    def remove(self) -> None:
        """Drop the database and delete the keys under the broker prefix."""
        drop_database(self.pg_url, self.db_name)
        self.clear_broker()


def model_for(args: argparse.Namespace, home: Path, *, tools: bool = False) -> Path:
    """``--model`` (:func:`add_model_arg`, where a benchmark has it), or the tiny model
    (``trainyard tiny-model``; ``--tools``: the agent variant) built under ``home``; an
    absolute path."""
    if getattr(args, "model", None) is not None:
        return Path(args.model).resolve()
    require_cli(args.trainyard_bin)
    model = home / "models" / ("tiny-llama-tools" if tools else "tiny-llama")
    size = ["--width", str(args.width), "--layers", str(args.layers)] if "width" in args else []
    run_checked(
        [str(args.trainyard_bin), "tiny-model", str(model), *(["--tools"] if tools else []), *size],
        what="building the tiny model",
    )
    return model.resolve()


def preset_run(
    preset: Path,
    model: Path,
    *,
    steps: int,
    save_steps: int,
    name: str,
    overrides: tuple[str, ...] = (),
) -> dict[str, Any]:
    """The body of a run of a project preset (``configs/runs/*.yaml``, read and overridden
    as ``trainyard runs create`` does) on ``model`` for ``steps`` GRPO steps, enough epochs
    for them, checkpoints every ``save_steps`` (above ``steps``: none) and no evaluation;
    ``overrides``: more ``a.b=value`` paths (``sft.epochs=1``)."""
    body = load_preset(preset)
    per_epoch = math.ceil(len(body["inputs"]) / body["grpo"]["groups_per_step"])
    epochs = min(10_000, max(int(body.get("num_epochs", 1)), math.ceil(steps / per_epoch)))
    return apply_overrides(
        body,
        [
            f"model_name={model}",
            f"max_steps={steps}",
            f"num_epochs={epochs}",
            f"trained_model_name={name}-{uuid.uuid4().hex[:8]}",
            f"grpo.save_steps={save_steps}",
            f"grpo.eval_steps={save_steps}",  # no evaluation runs: no validation inputs
            "grpo.validation_fraction=0.0",
            *overrides,
        ],
    )


# ------------------------------------------------------------------------------ options


def add_trainyard_bin_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trainyard-bin",
        type=Path,
        default=REPO / ".venv" / "bin" / "trainyard",
        help="the trainyard CLI: migrates, creates a key, starts the API and the worker",
    )


def add_trainyard_args(
    p: argparse.ArgumentParser,
    *,
    databases: str,
    redis_db: int,
    broker_prefix: str,
    settle_timeout: float,
    start_timeout: float,
) -> None:
    """The options of a benchmark that starts Trainyard on its own database and prefix."""
    p.add_argument(
        "--pg-url",
        default=PG_ADMIN_URL,
        help=f"admin connection; {databases} dropped and created",
    )
    p.add_argument(
        "--redis-url", default=f"redis://127.0.0.1:6379/{redis_db}", help="the Celery broker"
    )
    p.add_argument(
        "--broker-prefix",
        default=broker_prefix,
        help="TRAINYARD_BROKER_PREFIX; only keys under it are deleted, before and after",
    )
    add_trainyard_bin_arg(p)
    p.add_argument(
        "--settle-timeout",
        type=float,
        default=settle_timeout,
        help="longest wait for the machine to go idle before each measurement",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=start_timeout,
        help="longest wait for a server to answer after starting it",
    )


def add_model_arg(p: argparse.ArgumentParser) -> None:
    """``--model``, or the size of the tiny model :func:`model_for` builds (``--width``,
    ``--layers``)."""
    p.add_argument("--model", type=Path, help="tiny model folder (default: built in a temp home)")
    p.add_argument(
        "--width", type=int, default=64, help="the tiny model's hidden size, when it is built"
    )
    p.add_argument("--layers", type=int, default=2, help="its decoder layers")
