"""What every benchmark in bench/ shares; each benchmark file holds only its scenario.

- processes: a service in its own process group (``Server``), started, waited for (HTTP or a
  log line) and stopped with its whole group, also on an error, Ctrl-C or SIGTERM
  (``stop_on_exit``); a one-shot command run the same way (``run_to_end``);
- PostgreSQL (asyncpg) and Redis (redis-py), for the harness's own few queries;
- ``Trainyard``: an installation of our own for one benchmark (its database, its broker key
  prefix, its home, an API key), its API and worker processes, and the HTTP calls a harness
  makes on a run;
- the load generators: wrk, run as a child whose own CPU time is read back, ``RawHTTP``,
  the lean HTTP client of bench/pollers.py, and ``ClientFleet``, load client processes;
- a run under load (bench/pollers.py, bench/watchers.py): ``RunUnderLoad``, pinning
  (``Roles``, ``Pinner``), CPU per role (``snapshot``, ``cpu_usage``), the phases
  (``Phase``, ``idle_phase``, ``watch``), the step times per phase (``assign_steps``,
  ``compare_steps``), other load (``wait_for_other_load``), their options;
- the options every such benchmark takes (``add_trainyard_args``, ``add_output_arg``);
- machine facts (CPU, RAM, kernel, git revision, versions, load) and waiting for the machine
  to go quiet;
- the writer of a generated section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import datetime as dt
import importlib.metadata
import itertools
import json
import math
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import platform
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import tomllib
import urllib.parse
import uuid
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import psutil
import redis
import yaml

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
OUT = BENCH / "out"
WRK_SCRIPTS = BENCH / "wrk"
BENCHMARKS_MD = REPO / "docs" / "benchmarks.md"
PG_ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
TERMINAL = frozenset({"completed", "failed", "cancelled"})
LETTERS = REPO / "configs" / "runs" / "letters.yaml"
AGENT_CALCULATOR = REPO / "configs" / "runs" / "agent-calculator.yaml"


class BenchError(Exception):
    """A problem the user can fix; printed without a traceback."""


def log(msg: str) -> None:
    """Progress on stderr: stdout is left to a benchmark's results (tables, JSON)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- processes


@dataclasses.dataclass
class Server:
    """A process started in its own session, so that its whole group can be stopped."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    base_url: str
    known: dict[int, psutil.Process] = dataclasses.field(default_factory=dict)

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session=True makes it the group leader

    def remember_children(self) -> None:
        """Note descendants, in case one of them leaves our process group."""
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.known.setdefault(child.pid, child)

    def cpu_seconds(self) -> float:
        return cpu_seconds(self.proc.pid)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def check_alive(self) -> None:
        if self.proc.poll() is not None:
            raise BenchError(
                f"{self.name} exited with {self.proc.returncode}; last lines of"
                f" {self.log_path}:\n{self.tail()}"
            )

    def stop(self, grace: float = 10.0) -> None:
        self.remember_children()
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self._group_alive():
            time.sleep(0.2)
        if self._group_alive():
            log(f"{self.name}: still running after {grace:.0f} s, sending SIGKILL")
            self._signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        # Anything that escaped the group (a double fork into a new session). psutil
        # refuses to signal a pid that has since been reused by an unrelated process.
        for child in self.known.values():
            with contextlib.suppress(psutil.Error):
                if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                    child.kill()

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def _group_alive(self) -> bool:
        self.proc.poll()  # reap the leader so it does not linger as a zombie
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        # Only zombies left (reparented children waiting to be reaped) count as gone.
        for p in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error, ProcessLookupError):  # gone meanwhile
                if os.getpgid(p.pid) == self.pgid and p.status() != psutil.STATUS_ZOMBIE:
                    return True
        return False


def start_server(
    name: str, cmd: list[str], *, env: dict[str, str], cwd: Path = REPO, base_url: str = ""
) -> Server:
    """Start ``cmd`` in a new session, its output in ``bench/out/<name>-server.log``."""
    OUT.mkdir(parents=True, exist_ok=True)
    log_path = OUT / f"{name}-server.log"
    log(f"starting {name}: {shlex.join(cmd)}  (log: {log_path.relative_to(REPO)})")
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            cmd,
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    return Server(name, proc, log_path, base_url)


def wait_ready(server: Server, path: str, timeout: float = 120.0) -> None:
    """Wait until the server answers HTTP on ``path`` (any status below 500)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=server.base_url, timeout=2.0) as client:
        while time.monotonic() < deadline:
            server.check_alive()
            with contextlib.suppress(httpx.HTTPError):
                if client.get(path).status_code < 500:
                    server.remember_children()
                    return
            time.sleep(0.5)
    raise BenchError(
        f"{server.name} did not answer on {server.base_url}{path} within {timeout:.0f} s;"
        f" last lines of {server.log_path}:\n{server.tail()}"
    )


def wait_for_log(server: Server, pattern: re.Pattern[str], timeout: float) -> None:
    """Wait until the server's log matches ``pattern`` (a Celery worker's "ready")."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        server.check_alive()
        with contextlib.suppress(OSError):
            if pattern.search(server.log_path.read_text(errors="replace")):
                server.remember_children()
                return
        time.sleep(0.5)
    raise BenchError(
        f"{server.name} not ready within {timeout:.0f} s; last lines of {server.log_path}:\n"
        f"{server.tail()}"
    )


def run_to_end(
    name: str, cmd: list[str], *, env: dict[str, str], servers: list[Server], timeout: float
) -> Server:
    """Run a one-shot command as a ``Server`` (stopped with its group if we are interrupted)
    and wait for it to exit; the caller reads its log and return code."""
    proc = start_server(name, cmd, env=env)
    servers.append(proc)
    try:
        deadline = time.monotonic() + timeout
        while proc.proc.poll() is None:
            if time.monotonic() > deadline:
                raise BenchError(f"{name} still running after {timeout:.0f} s")
            time.sleep(0.2)
    finally:
        proc.stop()
        servers.remove(proc)
    return proc


def run_checked(cmd: list[str], *, env: dict[str, str] | None = None, what: str) -> str:
    """Run a short command to completion; its stdout, or a BenchError with its output."""
    log(f"{what}: {shlex.join(cmd)}")
    res = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if res.returncode != 0:
        raise BenchError(
            f"{what} failed (exit {res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}"
        )
    return res.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def stop_on_exit(servers: list[Server]) -> Iterator[None]:
    """Stop every started server however we leave: error, Ctrl-C, SIGTERM or SIGHUP."""

    def raise_interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        # A second Ctrl-C must not leave servers behind: ignore signals while stopping.
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        for server in reversed(servers):
            log(f"stopping {server.name} (process group {server.pgid})")
            try:
                server.stop()
            except Exception as e:  # keep stopping the others
                log(f"WARNING: could not stop {server.name}: {e}")
        servers.clear()
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s, handler in old.items():
            signal.signal(s, handler)


def cpu_seconds(*pids: int) -> float:
    """CPU seconds (user + system) of these processes and their descendants, reaped ones
    included: children that exited and were waited for show up in their parent's children_*
    times, which matters for PostgreSQL, where a client that reconnects a lot runs many
    short-lived backends."""
    total = 0.0
    seen: set[int] = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            root = psutil.Process(pid)
            for p in [root, *root.children(recursive=True)]:
                if p.pid in seen:
                    continue
                seen.add(p.pid)
                with contextlib.suppress(psutil.Error):
                    t = p.cpu_times()
                    total += t.user + t.system + t.children_user + t.children_system
    return total


def listening_pid(port: int) -> int | None:
    """The process listening on a local TCP port (PostgreSQL's postmaster), if visible."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return None  # needs root on some systems; the column then reads n/a
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    return None


# ------------------------------------------------------------------------------ machine


def machine_description() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gib = psutil.virtual_memory().total / 2**30
    return (
        f"{os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), {model},"
        f" {mem_gib:.1f} GiB RAM, {platform.system()} {platform.release()}"
    )


def trainyard_version() -> str:
    """pyproject's version and the git revision, marked when the tree has changes."""
    version = "unknown"
    with contextlib.suppress(OSError, KeyError, tomllib.TOMLDecodeError):
        version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    git = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    if git.returncode == 0:
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True
        ).stdout.strip()
        version += f" (git {git.stdout.strip()}{', uncommitted changes' if dirty else ''})"
    return version


def package_versions(*names: str) -> dict[str, str]:
    """Installed versions of these distributions in this interpreter (missing ones left out)."""
    out = {}
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def torch_thread_env(threads: int) -> dict[str, str]:
    """torch's intra-op threads for a child process (0: torch's default, one per core)."""
    if not threads:
        return {}
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def loadavg() -> tuple[float, float, float]:
    one, five, fifteen = os.getloadavg()
    return (round(one, 2), round(five, 2), round(fifteen, 2))


def machine_busy(before: Any, after: Any) -> float:
    """% of the machine's CPU time that was busy between two ``psutil.cpu_times()``."""
    total = sum(getattr(after, k) - getattr(before, k) for k in before._fields)
    idle = (after.idle - before.idle) + (getattr(after, "iowait", 0) - getattr(before, "iowait", 0))
    return 100.0 * (1 - idle / total) if total > 0 else float("nan")


def wait_for_quiet(max_wait: float, threshold: float = 30.0) -> float:
    """Wait until the machine's CPU is below ``threshold`` % for two seconds in a row.

    Servers keep busy for a while after they answer (MLflow starts job consumers that
    import for several seconds), and anything else running here skews the numbers.
    Returns the last reading; warns, naming the busiest processes, after ``max_wait`` s.
    """
    deadline = time.monotonic() + max_wait
    calm = 0
    reading = psutil.cpu_percent(interval=1.0)
    while time.monotonic() < deadline:
        calm = calm + 1 if reading < threshold else 0
        if calm >= 2:
            return reading
        reading = psutil.cpu_percent(interval=1.0)
    procs = list(psutil.process_iter(["pid", "name"]))
    for proc in procs:  # the first cpu_percent() of a process only starts its clock
        with contextlib.suppress(psutil.Error):
            proc.cpu_percent()
    time.sleep(1.0)
    usage = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            usage.append((proc.cpu_percent(), proc))
    busiest = [proc for _, proc in sorted(usage, key=lambda u: u[0], reverse=True)[:4]]
    names = ", ".join(f"{p.info['name']}({p.info['pid']})" for p in busiest)
    log(
        f"WARNING: machine still {reading:.0f}% busy after {max_wait:.0f} s (top: {names});"
        " measuring anyway, numbers will be low"
    )
    return reading


# --------------------------------------------------------------------- postgres and redis


def pg_url_for(admin_url: str, dbname: str, scheme: str = "postgresql") -> str:
    """``admin_url`` pointed at another database, with another scheme (driver)."""
    u = urllib.parse.urlsplit(admin_url)
    return urllib.parse.urlunsplit((scheme, u.netloc, "/" + dbname, "", ""))


_RETURNS_ROWS = re.compile(r"\s*(SELECT|SHOW|WITH|EXPLAIN|VALUES|TABLE)\b", re.I)


def pg_query(url: str, sql: str) -> list[str | None]:
    """Run one statement on a connection of its own; the first column of each row as text.

    Statements that return no rows go through the simple-query protocol, outside any
    transaction block (DROP DATABASE and VACUUM need that)."""
    dsn = re.sub(r"^postgres(?:ql)?\+\w+://", "postgresql://", url)

    async def go() -> list[str | None]:
        try:
            conn = await asyncpg.connect(dsn, timeout=30)
        except (OSError, asyncpg.PostgresError, TimeoutError) as e:
            u = urllib.parse.urlsplit(dsn)
            raise BenchError(f"cannot connect to PostgreSQL at {u.hostname}:{u.port}: {e}") from e
        try:
            if not _RETURNS_ROWS.match(sql):
                await conn.execute(sql)
                return []
            rows = await conn.fetch(sql)
        except asyncpg.PostgresError as e:
            raise BenchError(f"PostgreSQL: {e} (while running: {sql})") from e
        finally:
            await conn.close()
        return [None if r[0] is None else str(r[0]) for r in rows if len(r)]

    return asyncio.run(go())


def pg_json(url: str, sql: str) -> Any:
    """The decoded JSON of a statement that returns one JSON text value (None: no row)."""
    rows = pg_query(url, sql)
    return json.loads(rows[0]) if rows and rows[0] is not None else None


def recreate_database(admin_url: str, dbname: str) -> None:
    log(f"recreating PostgreSQL database {dbname}")
    drop_database(admin_url, dbname)
    pg_query(admin_url, f'CREATE DATABASE "{dbname}"')


def drop_database(admin_url: str, dbname: str) -> None:
    pg_query(admin_url, f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')


def migrate(db_url: str, cli: list[str], *, env: dict[str, str] | None = None) -> None:
    """``trainyard db upgrade`` on ``db_url`` (the migrations, as an operator runs them)."""
    env = {**(env or os.environ), "TRAINYARD_DATABASE_URL": db_url}
    name = urllib.parse.urlsplit(db_url).path.lstrip("/")
    run_checked([*cli, "db", "upgrade"], env=env, what=f"migrating {name}")


def redis_ping(url: str) -> None:
    try:
        with redis.Redis.from_url(url, socket_timeout=10) as r:
            r.ping()
    except redis.RedisError as e:
        raise BenchError(f"cannot use Redis at {url}: {e}") from e


def clear_redis_prefix(url: str, prefix: str) -> int:
    """Delete the keys under ``prefix`` (never the whole db: others share it); how many."""
    if not prefix:
        raise BenchError("the broker prefix must not be empty (the Redis db is shared)")
    pattern = re.sub(r"([\\*?\[\]])", r"\\\1", prefix) + "*"
    try:
        with redis.Redis.from_url(url, socket_timeout=10) as r:
            keys = list(r.scan_iter(match=pattern, count=1000))
            return int(r.delete(*keys)) if keys else 0
    except redis.RedisError as e:
        raise BenchError(f"cannot use Redis at {url}: {e}") from e


# ----------------------------------------------------------------------------- trainyard


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
        )
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


def model_for(args: argparse.Namespace, home: Path, *, tools: bool = False) -> Path:
    """``--model``, or the tiny model (``trainyard tiny-model``; ``--tools``: the agent
    variant) built under ``home``; an absolute path."""
    if args.model is not None:
        return Path(args.model).resolve()
    model = home / "models" / ("tiny-llama-tools" if tools else "tiny-llama")
    run_checked(
        [str(args.trainyard_bin), "tiny-model", str(model), *(["--tools"] if tools else [])],
        what="building the tiny model",
    )
    return model.resolve()


def letters_run(model: Path, *, steps: int, save_steps: int, name: str) -> dict[str, Any]:
    """The body of a run of configs/runs/letters.yaml on ``model`` for ``steps`` GRPO steps,
    checkpoints every ``save_steps`` (above ``steps``: none), no evaluation."""
    body: dict[str, Any] = yaml.safe_load(LETTERS.read_text())
    per_epoch = math.ceil(len(body["inputs"]) / body["grpo"]["groups_per_step"])
    body.update(
        model_name=str(model),
        max_steps=steps,
        num_epochs=min(10_000, max(int(body.get("num_epochs", 1)), math.ceil(steps / per_epoch))),
        trained_model_name=f"{name}-{uuid.uuid4().hex[:8]}",
    )
    body["grpo"] = {
        **body["grpo"],
        "save_steps": save_steps,
        "eval_steps": save_steps,  # no evaluation runs: there are no validation inputs
        "validation_fraction": 0.0,
    }
    return body


def agent_run(
    model: Path, *, steps: int, save_steps: int, name: str, sft_epochs: int | None = None
) -> dict[str, Any]:
    """The body of a run of configs/runs/agent-calculator.yaml (SFT warm-up, then GRPO with
    the calculator's tools) on ``model`` (``trainyard tiny-model --tools``) for ``steps``
    GRPO steps, checkpoints every ``save_steps``, no evaluation; ``sft_epochs`` replaces the
    warm-up's epochs."""
    body: dict[str, Any] = yaml.safe_load(AGENT_CALCULATOR.read_text())
    per_epoch = math.ceil(len(body["inputs"]) / body["grpo"]["groups_per_step"])
    body.update(
        model_name=str(model),
        max_steps=steps,
        num_epochs=min(10_000, max(int(body.get("num_epochs", 1)), math.ceil(steps / per_epoch))),
        trained_model_name=f"{name}-{uuid.uuid4().hex[:8]}",
    )
    body["grpo"] = {
        **body["grpo"],
        "save_steps": save_steps,
        "eval_steps": save_steps,
        "validation_fraction": 0.0,
    }
    if sft_epochs is not None:
        body["sft"] = {**body["sft"], "epochs": sft_epochs}
    return body


# ------------------------------------------------------------------------ load generators


class TransportError(Exception):
    """A request that got no HTTP answer (refused, reset, closed early, timed out)."""


class RawHTTP:
    """One keep-alive HTTP/1.1 connection, one GET at a time: the load generator of
    bench/pollers.py. It earns its place: 200 pollers on a 2-core machine cost the client
    0.23 ms of CPU per request this way and 5.0 ms through one shared ``httpx.AsyncClient``
    (a 10 s side-by-side run, `--client raw` vs `--client httpx`), and the client's cores
    are the API's. Enough HTTP for our API: Content-Length or chunked bodies, and
    ``Connection: close``."""

    def __init__(self, base_url: str, key: str, timeout: float) -> None:
        u = urllib.parse.urlsplit(base_url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.head = f"Host: {u.netloc}\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
        self.timeout = timeout
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, target: str, extra: bytes = b"") -> tuple[int, bytes]:
        """GET ``target``; ``extra``: more header lines, each ending in CRLF."""
        status, _, body = await self.request(target, extra)
        return status, body

    async def request(self, target: str, extra: bytes = b"") -> tuple[int, bytes, bytes]:
        """GET ``target``: status, the value of the response's ``ETag`` (b"" if none), body."""
        try:
            async with asyncio.timeout(self.timeout):
                return await self._get(target, extra)
        except (OSError, EOFError, TimeoutError, ValueError, asyncio.IncompleteReadError) as e:
            self.close()
            raise TransportError(type(e).__name__) from e

    async def _get(self, target: str, extra: bytes) -> tuple[int, bytes, bytes]:
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(b"GET " + target.encode() + b" HTTP/1.1\r\n" + extra + self.head)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length, chunked, close, etag = 0, False, False, b""
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"etag":
                etag = value.strip()
            elif name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                close = b"close" in value.lower()
        if chunked:
            parts = []
            while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
                parts.append(await self.reader.readexactly(size + 2))
            await self.reader.readuntil(b"\r\n")
            body = b"".join(p[:-2] for p in parts)
        else:
            body = await self.reader.readexactly(length) if length else b""
        if close:
            self.close()
        return status, etag, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def client_process(
    main: Callable[[Any, mpc.Connection], Coroutine[Any, Any, Any]], cfg: Any, conn: mpc.Connection
) -> None:
    """Entry point of a load client process (:class:`ClientFleet`): runs ``main(cfg, conn)``
    on uvloop and sends back what it returns (a dataclass as a plain dict: its class lives
    in ``__mp_main__`` here) or the error, as a string. ``main`` sends "ready", receives the
    start time (``time.time()`` epoch) and loads the API until its window ends."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop comes with the API's dependencies
        factory = None
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            result: Any = runner.run(main(cfg, conn))
            if dataclasses.is_dataclass(result) and not isinstance(result, type):
                result = dataclasses.asdict(result)
            conn.send(result)
    except BaseException as e:  # the parent reports it
        with contextlib.suppress(OSError):
            conn.send(f"{type(e).__name__}: {e}")
    finally:
        conn.close()


class ClientFleet:
    """Load client processes, one per config, each running ``main`` (:func:`client_process`):
    started, released at one start time, collected and, if need be, killed. Spawned, not
    forked: the harness has threads (the pinner)."""

    what = "client process"

    def __init__(
        self, main: Callable[[Any, mpc.Connection], Coroutine[Any, Any, Any]], configs: list[Any]
    ) -> None:
        self.procs: list[Any] = []
        self.conns: list[mpc.Connection] = []
        ctx = mp.get_context("spawn")
        for cfg in configs:
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=client_process, args=(main, cfg, child), daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def _recv(self, conn: mpc.Connection, deadline: float, what: str) -> Any:
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise BenchError(f"a {self.what} did not {what} in time")
        try:
            msg = conn.recv()
        except EOFError as e:
            raise BenchError(f"a {self.what} exited before it could {what}") from e
        if isinstance(msg, str) and msg != "ready":
            raise BenchError(f"a {self.what} failed: {msg}")
        return msg

    def start(self, ready_timeout: float, lead: float) -> float:
        """Wait until every process is ready; they start ``lead`` s from now (returned)."""
        deadline = time.monotonic() + ready_timeout
        for conn in self.conns:
            self._recv(conn, deadline, "start")
        start_at = time.time() + lead
        for conn in self.conns:
            conn.send(start_at)
        return start_at

    def send(self, message: Any) -> None:
        """A message to every process (one its ``main`` waits for: "stop")."""
        for conn in self.conns:
            conn.send(message)

    def collect(self, timeout: float) -> list[Any]:
        """What each process's ``main`` returned, in order."""
        deadline = time.monotonic() + timeout
        results = [self._recv(conn, deadline, "report") for conn in self.conns]
        for proc in self.procs:
            proc.join(timeout=10)
        return results

    def kill(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(Exception):
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()


@dataclasses.dataclass
class WrkRun:
    """What one wrk run reported, from the ``WRK_JSON`` line of bench/wrk/common.lua when
    there is one, else from wrk's own text."""

    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int  # non-2xx answers, socket errors and time-outs
    statuses: dict[str, int]
    cpu_seconds: float  # wrk's own user + system time
    wall_seconds: float


def parse_wrk_text(text: str) -> dict[str, Any]:
    """What wrk's own --latency report says (a fallback and a cross-check for WRK_JSON)."""
    units = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}
    out: dict[str, Any] = {}
    if m := re.search(r"^Requests/sec:\s+([\d.]+)", text, re.M):
        out["rps"] = float(m.group(1))
    if m := re.search(r"^\s+(\d+) requests in", text, re.M):
        out["requests"] = int(m.group(1))
    for pct, value, unit in re.findall(r"^\s+(50|75|90|99)%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.M):
        out[f"p{pct}_ms"] = float(value) * units[unit]
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    out["non2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    out["socket_errors"] = sum(int(x) for x in m.groups()) if m else 0
    return out


def run_wrk(
    *,
    label: str,
    url: str,
    script: str,
    script_args: list[str],
    threads: int,
    connections: int,
    duration: float,
    timeout: float,
    secret: str | None = None,
) -> WrkRun:
    """``wrk --latency -s bench/wrk/<script> url -- script_args``; raw output in
    ``bench/out/<label>.wrk.txt`` (``secret`` shown as ``<key>`` in the logged command)."""
    cmd = [
        "wrk",
        f"-t{threads}",
        f"-c{connections}",
        f"-d{duration:g}s",
        f"--timeout={timeout:g}s",
        "--latency",
        "-s",
        str(WRK_SCRIPTS / script),
        url,
        "--",
        *script_args,
    ]
    shown = shlex.join(cmd)
    if secret:
        shown = shown.replace(secret, "<key>")
    out_path = OUT / f"{label}.wrk.txt"
    log(f"wrk {label} ({duration:g} s): {shown}")
    t0 = time.monotonic()
    with open(out_path, "w+") as f:
        f.write(f"$ {shown}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            # wait4 gives this child's own rusage, not mixed with any other child's.
            _, status, rusage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - t0
        f.seek(0)
        text = f.read()
    if proc.returncode != 0:
        raise BenchError(f"wrk exited with {proc.returncode}; output ({out_path}):\n{text[-3000:]}")
    cpu = rusage.ru_utime + rusage.ru_stime
    stats = parse_wrk_text(text)
    m = re.search(r"^WRK_JSON (\{.*\})\s*$", text, re.M)
    if not m:  # the Lua done() did not run; wrk's text still has the essentials
        log(f"WARNING: no WRK_JSON line in {out_path}; using wrk's text report")
        return WrkRun(
            rps=stats.get("rps", 0.0),
            p50_ms=stats.get("p50_ms", float("nan")),
            p99_ms=stats.get("p99_ms", float("nan")),
            requests=stats.get("requests", 0),
            errors=stats["non2xx"] + stats["socket_errors"],
            statuses={},
            cpu_seconds=cpu,
            wall_seconds=wall,
        )
    data = json.loads(m.group(1))
    statuses = {str(k): int(v) for k, v in data["statuses"].items()}
    e = data["errors"]
    requests = int(data["requests"])
    return WrkRun(
        rps=stats.get("rps") or requests / (data["duration_us"] / 1e6),
        p50_ms=data["latency_us"]["p50"] / 1e3,
        p99_ms=data["latency_us"]["p99"] / 1e3,
        requests=requests,
        errors=sum(n for code, n in statuses.items() if not 200 <= int(code) < 300)
        + e["connect"]
        + e["read"]
        + e["write"]
        + e["timeout"],
        statuses=statuses,
        cpu_seconds=cpu,
        wall_seconds=wall,
    )


def wrk_version() -> str:
    res = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    m = re.search(r"wrk (\S+)", res.stdout + res.stderr)
    return m.group(1) if m else "unknown"


# --------------------------------------------------- a run under load: pinning, CPU, phases
#
# What bench/pollers.py and bench/watchers.py share: a long run trains while the API is
# loaded; phases without, with and without the load again; the worker and its PostgreSQL
# backends pinned to one CPU, the rest to the others; CPU per role; each step assigned to
# the phase it ran in.

STEP_METRIC = "step_seconds"  # workers/pipeline/training.py: on_step_begin → the step's log
# Other load that would pollute the numbers on a small machine: other benchmarks, test runs,
# load generators. Waited for before each configuration, watched during it.
OTHER_LOAD = re.compile(r"bench/\w+\.py|\bpytest\b|(?:^|/)wrk\b")


BACKEND = re.compile(r"^postgres: .*? (\S+) (?:\d[\d.]*|\[[0-9a-f:]+\]|[0-9a-f:]+)\((\d+)\)")


def tree(pid: int, recursive: bool = True) -> list[psutil.Process]:
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        return [root, *(root.children(recursive=True) if recursive else [])]
    return []


class BackendScanner:
    """PostgreSQL backends connected to one database over TCP: pid -> the client's port,
    from the process title (``postgres: 15/main: USER DB HOST(PORT) STATE``). A backend's
    database and client never change, so each process is read once; titles that may still
    change (a just-forked backend, PostgreSQL's own processes) are read again every time."""

    def __init__(self, db_name: str) -> None:
        self.db_name = db_name
        self.known: dict[int, int | None] = {}

    def scan(self) -> dict[int, int]:
        pids = set(psutil.pids())
        self.known = {pid: v for pid, v in self.known.items() if pid in pids}
        for pid in pids - self.known.keys():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            m = BACKEND.match(title)
            if m:
                self.known[pid] = int(m.group(2)) if m.group(1) == self.db_name else None
            elif "postgres" not in title:
                self.known[pid] = None
        return {pid: port for pid, port in self.known.items() if port is not None}


def client_ports(pids: Iterable[int], pg_port: int) -> set[int]:
    """Local ports of these processes' TCP connections to PostgreSQL."""
    ports: set[int] = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(pid).net_connections(kind="tcp"):
                if c.raddr and c.raddr.port == pg_port and c.laddr:
                    ports.add(c.laddr.port)
    return ports


class Roles:
    """The processes this script started, by role, and the database backends serving them."""

    def __init__(self, db_name: str, pg_port: int) -> None:
        self.db_name = db_name
        self.pg_port = pg_port
        self.roots: dict[str, list[int]] = {"worker": [], "api": [], "clients": []}
        self.lock = threading.Lock()
        self.scanner = BackendScanner(db_name)
        self.scan_lock = threading.Lock()

    def pids(self, role: str) -> list[int]:
        with self.lock:
            roots = list(self.roots[role])
        return [p.pid for r in roots for p in tree(r)]

    def backends(self) -> dict[int, str]:
        """Backends of the bench database -> ``worker`` or ``api`` (anything not the
        worker's: the API's pools and this script's own short queries)."""
        worker_ports = client_ports(self.pids("worker"), self.pg_port)
        with self.scan_lock:
            found = self.scanner.scan()
        return {pid: "worker" if port in worker_ports else "api" for pid, port in found.items()}


class Pinner(threading.Thread):
    """Every ``every`` s, puts each thread of our processes on its CPUs: the worker and its
    backends on ``worker_cpus``, the API, its backends, the load's clients and this script on
    ``api_cpus``. ``unpin()`` gives them all CPUs back. PostgreSQL's shared processes
    (postmaster, WAL writer, checkpointer, autovacuum), Redis and other people's processes
    are left alone."""

    def __init__(
        self, roles: Roles, worker_cpus: set[int], api_cpus: set[int], every: float = 0.5
    ) -> None:
        super().__init__(name="pinner", daemon=True)
        self.roles = roles
        self.all_cpus = set(os.sched_getaffinity(0))
        self.worker_cpus = worker_cpus
        self.api_cpus = api_cpus
        self.every = every
        self.active = False
        self.stopping = threading.Event()

    @staticmethod
    def _set(pid: int, cpus: set[int]) -> None:
        with contextlib.suppress(OSError):
            for name in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    if os.sched_getaffinity(int(name)) != cpus:
                        os.sched_setaffinity(int(name), cpus)

    def apply(self) -> None:
        worker = self.worker_cpus if self.active else self.all_cpus
        api = self.api_cpus if self.active else self.all_cpus
        for pid in self.roles.pids("worker"):
            self._set(pid, worker)
        for pid in [*self.roles.pids("api"), *self.roles.pids("clients"), os.getpid()]:
            self._set(pid, api)
        for pid, role in self.roles.backends().items():
            self._set(pid, worker if role == "worker" else api)

    def pin(self) -> None:
        self.active = True
        self.apply()

    def unpin(self) -> None:
        self.active = False
        self.apply()

    def run(self) -> None:
        while not self.stopping.wait(self.every):
            with contextlib.suppress(Exception):  # a process that just exited, etc.
                self.apply()

    def stop(self) -> None:
        self.stopping.set()
        if self.is_alive():
            self.join(timeout=5)
        with contextlib.suppress(Exception):
            self.unpin()


@dataclasses.dataclass
class CpuSnapshot:
    t: float
    machine: Any
    per_cpu: list[Any]
    procs: dict[str, float]
    backends: dict[int, tuple[str, float]]


def snapshot(roles: Roles) -> CpuSnapshot:
    backends: dict[int, tuple[str, float]] = {}
    for pid, role in roles.backends().items():
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            backends[pid] = (role, t.user + t.system)
    me = psutil.Process().cpu_times()
    return CpuSnapshot(
        t=time.monotonic(),
        machine=psutil.cpu_times(),
        per_cpu=psutil.cpu_times(percpu=True),
        procs={
            "worker": cpu_seconds(*roles.roots["worker"]),
            "api": cpu_seconds(*roles.roots["api"]),
            "harness": me.user + me.system,
        },
        backends=backends,
    )


def busy_seconds(before: Any, after: Any) -> tuple[float, float]:
    """(busy, total) CPU seconds between two psutil.cpu_times() readings."""
    total = sum(getattr(after, k) - getattr(before, k) for k in before._fields)
    idle = (after.idle - before.idle) + (getattr(after, "iowait", 0) - getattr(before, "iowait", 0))
    return total - idle, total


def cpu_usage(a: CpuSnapshot, b: CpuSnapshot, clients_cpu: float = 0.0) -> dict[str, float]:
    """% of one core per consumer between two snapshots, plus each CPU's busy %;
    ``clients_cpu``: the load's client processes' own CPU seconds, which they measure."""
    wall = max(b.t - a.t, 1e-9)
    out = {k: 100 * (b.procs[k] - a.procs[k]) / wall for k in b.procs}
    for role in ("worker", "api"):
        used = sum(
            cpu - (a.backends[pid][1] if pid in a.backends else 0.0)
            for pid, (r, cpu) in b.backends.items()
            if r == role
        )
        out[f"pg_{role}"] = 100 * used / wall
    out["clients"] = 100 * clients_cpu / wall
    busy, total = busy_seconds(a.machine, b.machine)
    ours = sum(out.values()) / 100 * wall
    out["other"] = max(0.0, 100 * (busy - ours) / wall)
    for i, (x, y) in enumerate(zip(a.per_cpu, b.per_cpu, strict=False)):
        cb, ct = busy_seconds(x, y)
        out[f"cpu{i}_busy"] = 100 * cb / ct if ct > 0 else float("nan")
    out["machine_busy"] = 100 * busy / total if total > 0 else float("nan")
    return out


PG_REFUSED: collections.Counter[str] = collections.Counter()  # harness connections refused


def bench_query(url: str, sql: str, tries: int = 20) -> list[str | None]:
    """pg_query on the bench database, retried while PostgreSQL refuses new connections
    (``too many clients``: the API's pools may hold them all; that is counted and reported)."""
    for attempt in range(tries):
        try:
            return pg_query(url, sql)
        except BenchError as e:
            if "too many clients" not in str(e) or attempt == tries - 1:
                raise
            PG_REFUSED["too many clients"] += 1
            time.sleep(0.5)
    raise AssertionError("unreachable")


class RunUnderLoad(Trainyard):
    """A fresh bench database, the API, one worker, an API key, and what the phases of a
    benchmark that loads the API while a run trains ask of them. ``args`` has the options of
    :func:`add_run_under_load_args`."""

    def __init__(
        self,
        args: argparse.Namespace,
        servers: list[Server],
        home: Path,
        *,
        name: str,
        db_name: str,
    ) -> None:
        super().__init__(
            args,
            name=name,
            db_name=db_name,
            servers=servers,
            home=home,
            env={
                # Measure the API under load, not its limits: one key makes every request.
                "TRAINYARD_RATE_LIMIT_PER_SECOND": "0",
                "TRAINYARD_MAX_ACTIVE_RUNS_PER_PROJECT": "0",
                **torch_thread_env(args.torch_threads),
                **dict(item.partition("=")[::2] for item in args.api_env),
            },
        )
        self.args = args

    def run_state(self, run_id: str) -> tuple[str, int, str | None]:
        row = bench_query(
            self.db_url,
            "SELECT json_build_object('status', status, 'step', step, 'error', error)::text"
            f" FROM runs WHERE id = '{run_id}'",
        )
        if not row or row[0] is None:
            raise BenchError(f"run {run_id} not found in {self.db_name}")
        state = json.loads(row[0])
        return str(state["status"]), int(state["step"] or 0), state.get("error")

    def check(self, run_id: str) -> int:
        """The run's step; raises if the worker died or the run ended."""
        assert self.worker is not None
        self.worker.check_alive()
        status, step, error = self.run_state(run_id)
        if status in TERMINAL:
            raise BenchError(
                f"run {run_id} ended {status} at step {step} during the measurement"
                f" ({error or 'raise --max-steps'}); worker log: {self.worker.log_path}"
            )
        return step

    def wait_for_step(self, run_id: str, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.check(run_id) < step:
            if time.monotonic() > deadline:
                raise BenchError(
                    f"run {run_id} did not reach step {step} within {timeout:.0f} s; worker"
                    f" log {self.worker.log_path if self.worker else '?'}"
                )
            time.sleep(0.5)

    def cancel_and_wait(self, run_id: str, timeout: float = 60.0) -> str:
        """Cancel the run; its status once it ended (or after ``timeout`` s)."""
        self.cancel(run_id)
        deadline = time.monotonic() + timeout
        status = self.run_state(run_id)[0]
        while status not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.5)
            status = self.run_state(run_id)[0]
        return status

    def step_seconds(self, run_id: str) -> dict[int, float]:
        """The run's own per-step time (GET /runs/{id}/metrics, the worker's clock)."""
        return dict(self.metrics(run_id, STEP_METRIC).get(STEP_METRIC, []))

    def step_events(self, run_id: str) -> dict[int, float]:
        """When each step's `step` event was written (epoch s, the database clock)."""
        row = bench_query(
            self.db_url,
            "SELECT coalesce(json_object_agg((data->>'step'), extract(epoch FROM created_at)),"
            f" '{{}}')::text FROM run_events WHERE run_id = '{run_id}' AND type = 'step'",
        )
        raw = json.loads(row[0] or "{}") if row else {}
        return {int(k): float(v) for k, v in raw.items()}


@dataclasses.dataclass
class Phase:
    config: str  # "pinned" / "unpinned"
    name: str  # "before" / the loaded phase ("with pollers", …) / "after"
    start: float  # epoch s
    end: float
    cpu: dict[str, float]
    loadavg: tuple[float, float, float]
    clients: list[Any] = dataclasses.field(default_factory=list)  # what the load's clients saw
    steps: dict[str, float] = dataclasses.field(default_factory=dict)
    db: dict[str, float] = dataclasses.field(default_factory=dict)
    overlap: set[str] = dataclasses.field(default_factory=set)  # other load seen meanwhile


def idle_phase(
    config: str, name: str, seconds: float, services: RunUnderLoad, roles: Roles, run_id: str
) -> Phase:
    """``seconds`` of training without the load: CPU per role, other load seen."""
    log(f"{config}: {name}, {seconds:g} s without the load")
    a = snapshot(roles)
    start = time.time()
    seen = watch(start + seconds, services, run_id)
    b = snapshot(roles)
    return Phase(
        config,
        name,
        start,
        time.time(),
        cpu_usage(a, b),
        loadavg(),
        overlap=seen,
    )


def watch(until: float, services: RunUnderLoad, run_id: str) -> set[str]:
    """Sleep until ``until`` (epoch s), checking the run and noting other load every 2 s."""
    seen: set[str] = set()
    while (now := time.time()) < until:
        time.sleep(min(2.0, until - now))
        services.check(run_id)
        seen |= other_load()
    return seen


def assign_steps(phases: list[Phase], seconds: dict[int, float], ends: dict[int, float]) -> None:
    """Each step whose whole span (its `step` event minus its step_seconds → the event)
    falls inside a phase belongs to it; steps across a boundary belong to none."""
    for ph in phases:
        inside = sorted(
            s for s, t in ends.items() if s in seconds and t - seconds[s] >= ph.start and t < ph.end
        )
        values = [seconds[s] for s in inside]
        gaps = [ends[b] - ends[a] for a, b in itertools.pairwise(inside) if b == a + 1]
        ph.steps = {
            "count": len(values),
            "first": inside[0] if inside else 0,
            "last": inside[-1] if inside else 0,
            "median": statistics.median(values) if values else float("nan"),
            "mean": statistics.fmean(values) if values else float("nan"),
            "p90": quantile(values, 0.90),
            "interval_median": statistics.median(gaps) if gaps else float("nan"),
            "steps_per_s": len(values) / max(ph.end - ph.start, 1e-9),
        }


def quantile(values: list[float], q: float) -> float:
    """The q-quantile by the nearest-rank method (what a latency SLO means by p99)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def comparison(phases: list[Phase]) -> dict[str, float]:
    """The median step of the loaded phase against the mean of the outer two (before and
    after); ``drift``: after against before, the noise."""
    by = {p.name: p for p in phases}
    during = next(p for p in phases if p.name not in ("before", "after"))
    return compare_steps(by["before"], during, by["after"])


def compare_steps(before_phase: Phase, during_phase: Phase, after_phase: Phase) -> dict[str, float]:
    """``during``'s median step against the mean of the medians of the phases around it."""
    before, during, after = (p.steps["median"] for p in (before_phase, during_phase, after_phase))
    base = statistics.fmean([before, after])
    return {
        "baseline_median_s": base,
        "with_median_s": during,
        "slowdown": during / base - 1 if base else float("nan"),
        "drift": after / before - 1 if before else float("nan"),
    }


def fmt_pct(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.0f}%"


def verdict(ok: bool) -> str:
    return "pass" if ok else "**fail**"


def render_steps(phases: list[Phase]) -> str:
    rows = [
        "| phase | window | steps | median step | p90 step | median step-to-step | steps/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        s = p.steps
        rows.append(
            f"| {p.name} | {p.end - p.start:.0f} s | {s['count']:.0f} ({s['first']:.0f}–"
            f"{s['last']:.0f}) | {fmt_ms(s['median'] * 1e3)} | {fmt_ms(s['p90'] * 1e3)} |"
            f" {fmt_ms(s['interval_median'] * 1e3)} | {s['steps_per_s']:.2f} |"
        )
    return "\n".join(rows)


def render_cpu(phases: list[Phase], n_cpus: int, clients: str) -> str:
    """CPU per role and per CPU, a row per phase; ``clients`` names the load's clients."""
    cols = [
        ("worker", "worker"),
        ("pg_worker", "its PG backends"),
        ("api", "API"),
        ("pg_api", "API's PG backends"),
        ("clients", clients),
        ("harness", "harness"),
        ("other", "everything else"),
    ]
    head = " | ".join(c for _, c in cols)
    cpu_cols = " | ".join(f"CPU {i} busy" for i in range(n_cpus))
    rows = [
        f"| phase | {head} | {cpu_cols} | loadavg 1 min |",
        "|---|" + "---:|" * (len(cols) + n_cpus + 1),
    ]
    for p in phases:
        vals = " | ".join(fmt_pct(p.cpu.get(k, float("nan"))) for k, _ in cols)
        busy = " | ".join(fmt_pct(p.cpu.get(f"cpu{i}_busy", float("nan"))) for i in range(n_cpus))
        rows.append(f"| {p.name} | {vals} | {busy} | {p.loadavg[0]:.2f} |")
    return "\n".join(rows)


def other_load() -> set[str]:
    """What else runs here that loads the machine: other benchmarks (another run of this one
    too, but not this process or a wrapper of it), pytest, wrk."""
    me = f"bench/{Path(sys.argv[0]).name}"
    found = set()
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        if p.info["pid"] == os.getpid() or p.info.get("name") == "timeout":
            continue
        for m in OTHER_LOAD.finditer(" ".join(p.info.get("cmdline") or [])):
            if m.group(0) != me:
                found.add(m.group(0).lstrip("/"))
    return found


def wait_for_other_load(max_wait: float, what: str) -> None:
    """Wait (polling every 10 s) until no other benchmark, test run or wrk is running."""
    busy = other_load()
    if not busy:
        return
    log(f"{what}: waiting up to {max_wait:.0f} s for {', '.join(sorted(busy))} to finish")
    deadline = time.monotonic() + max_wait
    while busy and time.monotonic() < deadline:
        time.sleep(10.0)
        busy = other_load()
    if busy:
        log(f"WARNING: still running: {', '.join(sorted(busy))}; measuring anyway")


# ------------------------------------------------------------------------------ options


def add_output_arg(p: argparse.ArgumentParser, section: str) -> None:
    p.add_argument(
        "--output",
        type=Path,
        default=BENCHMARKS_MD,
        help=f"markdown file whose {section} section is replaced (trial runs: another file)",
    )


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


def add_run_under_load_args(p: argparse.ArgumentParser, *, load: str, baseline: float) -> None:
    """The options of a benchmark that loads the API while a run trains (``load`` names
    the load in the help: "pollers", "watchers"); :func:`resolve_pin` after parsing."""
    p.add_argument(
        "--baseline",
        type=float,
        default=baseline,
        help=f"seconds without {load} before and after the phase with them",
    )
    p.add_argument(
        "--warmup", type=float, default=20.0, help="seconds of training before the first phase"
    )
    p.add_argument(
        "--api-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the API and worker (e.g. TRAINYARD_DB_POOL_SIZE=20)",
    )
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the worker on the first CPU, the rest on the others (default: on with ≤ 4 CPUs)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS for the worker (0: torch's default, one per core)",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=30_000,
        help="the run's max_steps; it is cancelled once measured",
    )
    p.add_argument("--model", type=Path, help="tiny model folder (default: built in a temp home)")
    p.add_argument(
        "--wait-others",
        type=float,
        default=900.0,
        help="before each configuration, wait up to this long for other benchmarks, pytest"
        " and wrk to finish",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="measure a configuration again (fresh run) when other load showed up during it",
    )
    p.add_argument(
        "--vacuum-analyze",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="VACUUM (ANALYZE) the bench database after each warm-up, as autovacuum would"
        " have (the planner otherwise plans for the empty tables of a fresh database)",
    )
    p.add_argument("--keep", action="store_true", help="keep the database and the temp home")


def resolve_pin(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--pin``'s default: on with 2 to 4 CPUs (where the worker would share the API's)."""
    n_cpus = len(os.sched_getaffinity(0))
    if args.pin is None:
        args.pin = 2 <= n_cpus <= 4
    if args.pin and n_cpus < 2:
        p.error("--pin needs at least 2 CPUs")


def pin_cpus(args: argparse.Namespace) -> tuple[set[int], set[int]] | None:
    """With ``--pin``: (the worker's CPU, everyone else's CPUs)."""
    all_cpus = sorted(os.sched_getaffinity(0))
    return ({all_cpus[0]}, set(all_cpus[1:])) if args.pin else None


# --------------------------------------------------------------------------------- report


def write_section(path: Path, section: str, start_mark: str, end_mark: str) -> None:
    """Replace the text between the two markers in ``path`` (or append the section)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start, end = text.find(start_mark), text.find(end_mark)
    if start != -1 and end != -1 and end > start:
        after = text[end + len(end_mark) :].lstrip("\n")
        text = text[:start] + section + ("\n" + after if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def fmt_ms(ms: float, digits: int = 1) -> str:
    """Milliseconds for a table: ``digits`` decimals below 100 ms, seconds from 10 s."""
    if math.isnan(ms):
        return "n/a"
    if ms >= 10_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.{digits}f} ms"


def command_line(script: str, secret: str | None = None) -> str:
    """How this benchmark was invoked, for the report (``secret`` shown as ``<key>``)."""
    command = shlex.join([".venv/bin/python", f"bench/{script}", *sys.argv[1:]])
    return command.replace(secret, "<key>") if secret else command


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
