"""What every benchmark in bench/ shares; each benchmark file holds only its scenario.

- processes: a service in its own process group (``Server``), started, waited for (HTTP or a
  log line) and stopped with its whole group, also on an error, Ctrl-C or SIGTERM
  (``stop_on_exit``); a one-shot command run the same way (``run_to_end``);
- PostgreSQL (asyncpg) and Redis (redis-py), for the harness's own few queries;
- ``Trainyard``: an installation of our own for one benchmark (its database, its broker key
  prefix, its home, an API key), its API and worker processes, and the HTTP calls a harness
  makes on a run;
- the load generators: wrk, run as a child whose own CPU time is read back, and
  ``RawHTTP``, the lean HTTP client of bench/pollers.py;
- the options every such benchmark takes (``add_trainyard_args``, ``add_output_arg``);
- machine facts (CPU, RAM, kernel, git revision, versions, load) and waiting for the machine
  to go quiet;
- the writer of a generated section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import importlib.metadata
import json
import math
import os
import platform
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import tomllib
import urllib.parse
import uuid
from collections.abc import Iterator
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
        wait_for_log(self.worker, re.compile(r"\bready\.?\s*$", re.M), timeout)
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

    async def get(self, target: str) -> tuple[int, bytes]:
        try:
            async with asyncio.timeout(self.timeout):
                return await self._get(target)
        except (OSError, EOFError, TimeoutError, ValueError, asyncio.IncompleteReadError) as e:
            self.close()
            raise TransportError(type(e).__name__) from e

    async def _get(self, target: str) -> tuple[int, bytes]:
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(b"GET " + target.encode() + b" HTTP/1.1\r\n" + self.head)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length, chunked, close = 0, False, False
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"content-length":
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
        return status, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


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
