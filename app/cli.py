"""``trainyard``: run the services, manage keys, and talk to the API.

Service commands (up, api, worker, db) run locally. The others find the running
installation: the URLs and key in the state file ``trainyard up`` writes (``<home>/up.json``,
and ``~/.trainyard/up.json`` when ``TRAINYARD_HOME`` is unset), unless ``--api-url`` /
``TRAINYARD_API_URL``, ``--api-key`` / ``TRAINYARD_API_KEY`` or ``TRAINYARD_DATABASE_URL``
say otherwise. Every error is one line on stderr and a non-zero exit status.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console
from typer.core import TyperGroup

from app.auth.roles import Role  # an enum alone: `keys create --role` lists its values

if TYPE_CHECKING:  # the CLI starts without httpx until a command talks to the API
    import httpx

T = TypeVar("T")
DEFAULT_API_URL = "http://127.0.0.1:8000"
UP_PROJECT = "default"  # the project of the key `trainyard up` makes


class CliError(Exception):
    """An error the user can act on: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class _OneLineErrors(TyperGroup):
    """Turns every error of every subcommand into one line and an exit status; a
    traceback only with ``TRAINYARD_DEBUG=1``."""

    def invoke(self, ctx: Any) -> Any:  # typer's vendored click.Context
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except CliError as exc:
            _fail(str(exc), exc.code)
        except Exception as exc:
            from app.core.services import NoInstallation

            if isinstance(exc, NoInstallation):
                _fail(str(exc), 1)
            # Usage errors (typer's vendored click.ClickException) print themselves.
            if hasattr(exc, "exit_code") and hasattr(exc, "show"):
                raise
            if os.environ.get("TRAINYARD_DEBUG"):
                raise
            _fail(f"{type(exc).__name__}: {exc} (TRAINYARD_DEBUG=1 shows the traceback)", 1)


def _fail(message: str, code: int) -> NoReturn:
    # print, not rich: rich wraps at 80 columns without a terminal, and reads [..] as markup.
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


app = typer.Typer(
    cls=_OneLineErrors,
    no_args_is_help=True,
    help=__doc__,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",  # paragraphs rewrapped, `code` shown as code
)
db_app = typer.Typer(no_args_is_help=True, help="Database schema.")
keys_app = typer.Typer(no_args_is_help=True, help="API keys (straight from the database).")
runs_app = typer.Typer(no_args_is_help=True, help="Training runs (over HTTP).")
data_app = typer.Typer(
    no_args_is_help=True, help="Trajectories as training data (straight from the database)."
)
app.add_typer(db_app, name="db")
app.add_typer(keys_app, name="keys")
app.add_typer(runs_app, name="runs")
trajectories_app = typer.Typer(
    no_args_is_help=True, help="A run's trajectories and the project's training data (over HTTP)."
)
app.add_typer(data_app, name="data")
app.add_typer(trajectories_app, name="trajectories")

err = Console(stderr=True, soft_wrap=True)

Json = Annotated[bool, typer.Option("--json", help="Print the data as JSON on stdout.")]


def main() -> None:
    app()


def _print_json(data: Any) -> None:
    print(json.dumps(data, indent=2), flush=True)


def _settings() -> Any:
    from app.core.settings import get_settings

    return get_settings()


# -- services ------------------------------------------------------------------------------


def _upgrade(url: str, revision: str = "head") -> None:
    from alembic import command
    from alembic.config import Config

    root = Path(__file__).resolve().parent.parent
    cfg = Config(str(root / "alembic.ini"))
    cfg.set_main_option("script_location", str(root / "migrations"))
    cfg.attributes["url"] = url
    cfg.attributes["skip_logging"] = True
    command.upgrade(cfg, revision)


@db_app.command("upgrade")
def db_upgrade(revision: str = "head") -> None:
    """Apply migrations up to REVISION (default: the latest) to TRAINYARD_DATABASE_URL, or
    to the running `trainyard up`'s database (which `up` itself migrates when it starts)."""
    from app.core.services import client_database_url

    url = client_database_url(_settings())
    _on_database(url, lambda: _upgrade(url, revision))
    err.print(f"database at {revision}")


@app.command()
def api(
    host: str = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8000,
    workers: Annotated[int, typer.Option(min=1)] = 1,
    log_level: str = "warning",
) -> None:
    """Serve the REST API with uvicorn (uvloop + httptools). Logs go to stderr as JSON lines,
    or plain text on a terminal (`TRAINYARD_LOG_FORMAT`), with one access line per request."""
    import uvicorn

    from app.core.logs import logging_config
    from app.core.services import database_url, redis_url

    # Resolve embedded services once here, so uvicorn's worker processes share them.
    settings = _settings()
    os.environ["TRAINYARD_DATABASE_URL"] = database_url(settings)
    os.environ["TRAINYARD_REDIS_URL"] = redis_url(settings)
    if workers > 1 and settings.metrics_enabled:
        # One /metrics for all the processes: each writes its samples under one folder
        # (emptied now: files of processes gone would count again).
        from app.observability.prometheus import MULTIPROC_ENV, prepare_multiprocess_dir

        folder = os.environ.get(MULTIPROC_ENV) or settings.home / "prometheus" / f"api-{port}"
        os.environ[MULTIPROC_ENV] = str(prepare_multiprocess_dir(folder))
    uvicorn.run(
        "app.asgi:app",
        host=host,
        port=port,
        workers=workers,
        loop="uvloop",
        http="httptools",
        log_level=log_level,
        log_config=logging_config(log_level),  # applied in each of uvicorn's processes
        access_log=False,  # ours (trainyard.access) has the route, request id and project
        timeout_graceful_shutdown=10,
    )


@app.command()
def worker(
    queues: str = typer.Option("control,gpu", help="Comma-separated queues to consume."),
    pool: str = typer.Option("solo", help="solo or threads: GPU work must not fork after CUDA."),
    concurrency: Annotated[int, typer.Option(min=1)] = 1,
    loglevel: str = "INFO",
) -> None:
    """Run a Celery worker."""
    from app.core.services import database_url, redis_url

    settings = _settings()
    os.environ["TRAINYARD_DATABASE_URL"] = database_url(settings)
    os.environ["TRAINYARD_REDIS_URL"] = redis_url(settings)
    # Progress bars of model downloads and shard writes only clutter a worker's log.
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # The worker is its own program: this process becomes it (same pid, same signals).
    os.execv(
        sys.executable,
        [
            sys.executable,
            "-m",
            "workers",
            "worker",
            f"--queues={queues}",
            f"--pool={pool}",
            f"--concurrency={concurrency}",
            f"--loglevel={loglevel}",
            "--without-gossip",
            "--without-mingle",
            f"--hostname=trainyard-{os.getpid()}@%h",
        ],
    )


# -- trainyard up: a supervisor ----------------------------------------------------------------

# Seconds before each restart of a child that keeps dying soon after it started; once they
# are used up the child is given up on (a port in use, a broken install: restarting cannot
# help) and `up` stops.
RESTART_DELAYS = (1.0, 2.0, 4.0, 8.0, 16.0)
# A child that ran this long before it died starts its backoff afresh.
STABLE_SECONDS = 30.0
STOP_SECONDS = 15.0


def _how_it_ended(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec hook that has the kernel SIGTERM the child when ``up`` dies, even by
    SIGKILL, so a killed ``up`` leaves no orphaned API or worker behind (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    parent = os.getpid()

    def hook() -> None:
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:  # `up` died before the hook ran
            os._exit(1)

    return hook


@dataclass
class _Child:
    name: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    quick_exits: int = 0
    restart_at: float | None = None


class Supervisor:
    """Keeps ``up``'s children running: one that dies is restarted after a backoff, and
    said so, while the others stay up; :meth:`stop` stops them all, by pid.

    Each child runs in a process group of its own, so that a restart or a stop reaches what
    the child forked too (uvicorn's worker processes), and a Ctrl-C in the terminal reaches
    only ``up``, which then stops the children in order.
    """

    def __init__(
        self,
        env: dict[str, str],
        say: Callable[[str], None],
        on_change: Callable[[], None] = lambda: None,
    ) -> None:
        self.env = env
        self.say = say
        self.on_change = on_change
        self.children: list[_Child] = []
        self._hook = _die_with_parent()

    def start(self, name: str, argv: list[str]) -> None:
        child = _Child(name, argv)
        self.children.append(child)
        self._spawn(child)
        self.say(f"{name} started (pid {self._pid(child)})")

    def pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.children if c.proc is not None}

    def check(self) -> None:
        """Reap children that died and restart those whose backoff is over; raises
        :class:`CliError` for a child that keeps dying."""
        now = time.monotonic()
        for child in self.children:
            code = child.proc.poll() if child.proc is not None else None
            if child.proc is not None and code is not None:
                pid = child.proc.pid
                self._signal_group(pid, signal.SIGKILL)  # what it forked dies with it
                child.proc = None
                lived = now - child.started_at
                child.quick_exits = child.quick_exits + 1 if lived < STABLE_SECONDS else 1
                if child.quick_exits > len(RESTART_DELAYS):
                    raise CliError(
                        f"the {child.name} (pid {pid}) {_how_it_ended(code)}, its "
                        f"{child.quick_exits}th exit within {STABLE_SECONDS:.0f} s of starting; "
                        "stopping (its output is above)"
                    )
                delay = RESTART_DELAYS[child.quick_exits - 1]
                self.say(
                    f"{child.name} (pid {pid}) {_how_it_ended(code)}; restarting in {delay:g} s"
                )
                child.restart_at = now + delay
            if child.proc is None and child.restart_at is not None and now >= child.restart_at:
                self._spawn(child)
                self.say(f"{child.name} restarted (pid {self._pid(child)})")
                self.on_change()

    def stop(self) -> None:
        """SIGTERM every child's group (the last started first), then SIGKILL what is left
        after :data:`STOP_SECONDS`."""
        running = [c.proc for c in reversed(self.children) if c.proc is not None]
        for proc in running:
            if proc.poll() is None:
                self._signal_group(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_SECONDS
        for proc in running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, deadline - time.monotonic()))
            self._signal_group(proc.pid, signal.SIGKILL)
            proc.wait()
        for child in self.children:
            child.proc = None
            child.restart_at = None

    def _spawn(self, child: _Child) -> None:
        child.proc = subprocess.Popen(
            child.argv,
            env=self.env,
            stdin=subprocess.DEVNULL,
            process_group=0,
            preexec_fn=self._hook,  # `up` has no threads when it forks
        )
        child.started_at = time.monotonic()
        child.restart_at = None

    @staticmethod
    def _pid(child: _Child) -> int:
        assert child.proc is not None
        return child.proc.pid

    @staticmethod
    def _signal_group(pgid: int, sig: signal.Signals) -> None:
        # The group's id is the child's pid, which is not reused while the group has members.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def _client_host(host: str) -> str:
    """Where a client on this machine reaches an API listening on ``host``."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _check_port(host: str, port: int) -> None:
    """Fail at once on a port in use, rather than after the API's restarts run out."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise CliError(
                f"cannot serve on {host}:{port} ({exc.strerror}): stop what uses it, or pass --port"
            ) from exc


def _wait_for_api(supervisor: Supervisor, url: str, timeout: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        supervisor.check()
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise CliError(f"the API did not answer {url}/healthz within {timeout:.0f} s")
        time.sleep(0.2)


def _key_works(url: str, key: str) -> bool:
    import httpx

    try:
        answer = httpx.get(f"{url}/runs", params={"limit": 1}, headers=_auth(key), timeout=10)
    except httpx.HTTPError:
        return False
    return answer.status_code == 200


@app.command()
def up(
    host: str = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    api_workers: Annotated[int, typer.Option(min=1)] = 1,
) -> None:
    """Start what is needed (embedded PostgreSQL/Redis when no URL is set), migrate, then
    serve the API and one worker in the foreground, restarting either if it dies.

    Leaves the API's URL and an API key (project 'default') in `<home>/up.json`, where the
    other commands find them. Ctrl-C or SIGTERM stops everything it started."""
    import psutil

    from app.core.services import (
        Installation,
        read_state,
        state_files,
        write_state,
    )

    settings = _settings()
    home = settings.home.expanduser().resolve()
    paths = state_files(settings)
    previous = read_state(paths[0])
    if previous is not None and previous.running():
        raise CliError(
            f"trainyard up is already running for {home} (pid {previous.pid}, API at "
            f"{previous.api_url}); stop it first, or set TRAINYARD_HOME to another folder"
        )
    _check_port(host, port)
    started: list[Any] = []
    supervisor: Supervisor | None = None
    state: Installation | None = None

    def say(message: str) -> None:
        err.print(f"[dim]up:[/] {message}", highlight=False)

    def save() -> None:
        if state is not None:
            for path in paths:
                write_state(path, state)

    def on_change() -> None:
        nonlocal state
        if state is not None and supervisor is not None:
            state = replace(state, children=supervisor.pids())
            save()

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt  # SIGTERM (and a closed terminal) stop the way Ctrl-C does

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)
    try:
        if settings.database_url:
            db_url = settings.database_url
        else:
            from app.core.embedded import start_postgres

            pg = start_postgres(home)
            started.append(pg)
            db_url = pg.url
            say(f"embedded PostgreSQL ({'started' if pg.started else 'reused'}) in {home}")
        if settings.redis_url:
            broker = settings.redis_url
        else:
            from app.core.embedded import start_redis

            rd = start_redis(home)
            started.append(rd)
            broker = rd.url
            say(f"embedded Redis ({'started' if rd.started else 'reused'}) in {home}")
        # One person's machine: the runs are its user's own, so they may name any code.
        policy = settings.code_policy or "open"
        say(
            f"code policy {policy}"
            + (
                ": runs may name any import path, command, URL or model folder "
                "(TRAINYARD_CODE_POLICY=catalog allows only the catalog's; docs/security.md)"
                if policy == "open"
                else f" (catalog: {settings.catalog or 'none, built-ins only'})"
            )
        )
        env = {
            **os.environ,
            "TRAINYARD_DATABASE_URL": db_url,
            "TRAINYARD_REDIS_URL": broker,
            "TRAINYARD_HOME": str(home),
            "TRAINYARD_CODE_POLICY": policy,
        }
        _upgrade(db_url)
        supervisor = Supervisor(env, say, on_change)
        exe = [sys.executable, "-m", "app.cli"]
        api_argv = ["api", "--host", host, "--port", str(port), "--workers", str(api_workers)]
        supervisor.start("api", [*exe, *api_argv])
        supervisor.start("worker", [*exe, "worker"])
        url = f"http://{_client_host(host)}:{port}"
        _wait_for_api(supervisor, url)

        if previous is not None and previous.api_key and _key_works(url, previous.api_key):
            key_id, key = previous.api_key_id, previous.api_key
        else:
            # Its user's own key: every route, webhooks included.
            made_id, key = _create_key(db_url, UP_PROJECT, "trainyard up", Role.admin)
            key_id = made_id
        me = psutil.Process()
        state = Installation(
            home=str(home),
            api_url=url,
            database_url=db_url,
            broker_url=broker,
            pid=me.pid,
            process_started=me.create_time(),
            api_key=key,
            api_key_id=key_id,
            children=supervisor.pids(),
        )
        save()
        err.print(f"[bold green]Trainyard is up[/] on {url}  (Ctrl-C stops it)", highlight=False)
        err.print(
            f"API key (project {UP_PROJECT!r}): {key}\n"
            f"[dim]saved in {' and '.join(map(str, paths))}: `trainyard runs …` in another "
            "terminal uses it; `trainyard keys create --project NAME` makes more",
            highlight=False,
        )
        while True:
            supervisor.check()
            time.sleep(0.2)
    except KeyboardInterrupt:
        say("stopping…")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            if supervisor is not None:
                supervisor.stop()
            if state is not None:
                stopped = state.stopped()
                for path in paths:
                    current = read_state(path)
                    if current is None or current.pid == state.pid:  # not another up's
                        write_state(path, stopped)
            # Reused ones too: with no other `up` for this home (checked above), a server
            # already running there was left by an `up` that crashed.
            for service in started:
                service.stop()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


@app.command()
def status(
    as_json: Json = False,
    key: Annotated[bool, typer.Option("--key", help="Print only its API key.")] = False,
) -> None:
    """Say whether a `trainyard up` is running, and where its parts are."""
    from app.core.services import find_installation, no_installation

    settings = _settings()
    found = find_installation(settings)
    if found is None:
        raise no_installation(settings)
    if key:
        if not found.api_key:
            raise CliError("the running `trainyard up` has no key yet")
        print(found.api_key, flush=True)
        return
    if as_json:
        _print_json(asdict(found))
        return
    children = ", ".join(f"{name} pid {pid}" for name, pid in found.children.items())
    print(f"up:       pid {found.pid} ({children})")
    print(f"api:      {found.api_url}")
    print(f"home:     {found.home}")
    print(f"database: {_safe_url(found.database_url)}")
    print(f"broker:   {found.broker_url}")
    print(f"key:      {found.api_key or '(none)'}")


@app.command()
def demo(
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    preset: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="The run body. Default: `configs/runs/letters.yaml` "
            "(`configs/runs/agent-calculator.yaml` with --agent).",
        ),
    ] = None,
    agent: Annotated[
        bool,
        typer.Option(
            "--agent",
            help="An agent run: the tiny model's tool variant, an SFT warm-up, then GRPO in "
            "the calculator environment, one episode shown every few steps.",
        ),
    ] = False,
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides.")] = None,
) -> None:
    """Everything end to end: services, API, worker, the tiny model, a real training run
    created over HTTP and followed to the end."""
    from app.demo import run_demo

    raise typer.Exit(run_demo(port, preset, overrides or [], agent=agent))


@app.command("tiny-model")
def tiny_model(
    path: Annotated[
        Path | None,
        typer.Argument(
            help="Folder to write to. Default: `<home>/models/tiny-llama` "
            "(`tiny-llama-tools` with --tools)."
        ),
    ] = None,
    seed: int = 0,
    tools: Annotated[
        bool,
        typer.Option(
            "--tools",
            help="The agent variant: a chat template with a tool-call format TRL parses "
            "(Qwen2.5's), for runs with an environment.",
        ),
    ] = False,
) -> None:
    """Build the tiny Llama and tokenizer used by the demo and the tests (no hub access);
    prints the folder's absolute path, which a run's model_name can take as it is."""
    if path is None:
        from app.core.services import find_installation

        settings = _settings()
        found = find_installation(settings)
        home = Path(found.home) if found else settings.home.expanduser().resolve()
        path = home / "models" / ("tiny-llama-tools" if tools else "tiny-llama")
    path = path.expanduser().resolve()
    # Built by the workers' code, in a process of its own (it imports torch).
    subprocess.run(
        [sys.executable, "-m", "workers", "tiny-model", str(path), str(seed)]
        + (["--tools"] if tools else []),
        check=True,
    )
    err.print(f"tiny model written to {path}", highlight=False)
    print(path, flush=True)


# -- keys and data, straight from the database ------------------------------------------------


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    try:
        return make_url(url).render_as_string(hide_password=True)
    except Exception:
        return "<the configured database URL>"


def _on_database(url: str, work: Callable[[], T]) -> T:
    """Run ``work`` and say in one line what to do when the database is not usable."""
    import asyncpg
    import sqlalchemy.exc

    try:
        return work()
    except (OSError, asyncpg.PostgresError, sqlalchemy.exc.DBAPIError) as exc:
        orig = getattr(exc, "orig", None)
        causes = (exc, orig, getattr(orig, "__cause__", None))
        if any(getattr(c, "sqlstate", None) == "42P01" for c in causes):  # undefined_table
            raise CliError(
                f"the database {_safe_url(url)} has no Trainyard tables: run `trainyard db "
                "upgrade` with TRAINYARD_DATABASE_URL set to it"
            ) from exc
        reason = " ".join(str(orig or exc).split())
        raise CliError(f"cannot use the database {_safe_url(url)}: {reason}") from exc


def _create_key(db_url: str, project: str, name: str | None, role: Role) -> tuple[str, str]:
    from app.auth.service import create_key, get_or_create_project
    from app.core.db import make_engine, make_sessionmaker, session_scope

    async def _create() -> tuple[str, str]:
        engine = make_engine(db_url, pool_size=1)
        try:
            async with session_scope(make_sessionmaker(engine)) as session:
                proj = await get_or_create_project(session, project)
                key, plain = await create_key(session, proj, name=name, role=role)
                return str(key.id), plain
        finally:
            await engine.dispose()

    return _on_database(db_url, lambda: asyncio.run(_create()))


@keys_app.command("create")
def keys_create(
    project: Annotated[str, typer.Option(help="Project name; created if it does not exist.")],
    name: Annotated[str | None, typer.Option(help="A label for the key.")] = None,
    role: Annotated[
        Role,
        typer.Option(
            help="What the key may do in its project: viewer (read only), member (also "
            "create and control runs, upload datasets) or admin (also webhooks).",
        ),
    ] = Role.member,
    as_json: Json = False,
) -> None:
    """Create an API key. The key is printed alone on the last line of stdout, once."""
    from app.core.services import client_database_url

    key_id, plain = _create_key(client_database_url(_settings()), project, name, role)
    if as_json:
        _print_json(
            {"id": key_id, "project": project, "name": name, "role": role.value, "key": plain}
        )
        return
    err.print(f"{role.value} key {key_id} for project {project!r} (shown once; store it now):")
    print(plain, flush=True)


@keys_app.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke a key by id; API processes stop accepting it within seconds."""
    import uuid

    from app.auth.service import revoke_key
    from app.core.db import make_engine, make_sessionmaker, session_scope
    from app.core.services import client_database_url

    try:
        parsed = uuid.UUID(key_id)
    except ValueError:
        raise CliError(f"{key_id!r} is not a key id (a UUID, as `keys create` prints)") from None
    db_url = client_database_url(_settings())

    async def _revoke() -> bool:
        engine = make_engine(db_url, pool_size=1)
        try:
            async with session_scope(make_sessionmaker(engine)) as session:
                return await revoke_key(session, parsed)
        finally:
            await engine.dispose()

    if not _on_database(db_url, lambda: asyncio.run(_revoke())):
        raise CliError(f"no active key {key_id}")
    err.print("revoked")


@keys_app.command("list")
def keys_list(
    project: Annotated[str | None, typer.Option(help="Only this project's keys.")] = None,
    as_json: Json = False,
) -> None:
    """List API keys, newest first: id, project, name, role, the key's first characters, when
    it was made, last used and revoked. Never a key itself (only its hash is stored)."""
    from app.auth.service import list_keys
    from app.core.db import make_engine, make_sessionmaker, session_scope
    from app.core.services import client_database_url

    db_url = client_database_url(_settings())

    async def _list() -> list[dict[str, Any]]:
        engine = make_engine(db_url, pool_size=1)
        try:
            async with session_scope(make_sessionmaker(engine)) as session:
                rows = await list_keys(session, project=project)
        finally:
            await engine.dispose()

        def when(value: Any) -> str | None:
            return value.isoformat() if value is not None else None

        return [
            {
                "id": str(key.id),
                "project": name,
                "name": key.name,
                "role": str(key.role),
                "prefix": key.prefix,
                "created_at": when(key.created_at),
                "last_used_at": when(key.last_used_at),
                "revoked_at": when(key.revoked_at),
            }
            for key, name in rows
        ]

    keys = _on_database(db_url, lambda: asyncio.run(_list()))
    if as_json:
        _print_json(keys)
        return
    headers = ["id", "project", "name", "role", "prefix", "created", "last used", "revoked"]
    fields = [
        "id",
        "project",
        "name",
        "role",
        "prefix",
        "created_at",
        "last_used_at",
        "revoked_at",
    ]
    print(_table(headers, [[str(k[f] or "-") for f in fields] for k in keys]), flush=True)


# -- runs over HTTP --------------------------------------------------------------------------

ApiUrl = Annotated[
    str | None,
    typer.Option(
        envvar="TRAINYARD_API_URL",
        help=f"API base URL. Default: the running `trainyard up`'s, else {DEFAULT_API_URL}.",
    ),
]
ApiKey = Annotated[
    str | None,
    typer.Option(
        envvar="TRAINYARD_API_KEY",
        help="API key. Default: the key the running `trainyard up` made.",
    ),
]


def _auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# What to do about an error status, beyond what the problem says.
_HINTS = {
    401: "check --api-key / TRAINYARD_API_KEY (`trainyard keys create --project NAME` makes a key)",
}


def problem_line(response: httpx.Response) -> str:
    """One line for an error answer: status, title, detail and each field's error."""
    try:
        body = response.json()
    except ValueError:
        body = None
    fields: list[str] = []
    if isinstance(body, dict):
        title = str(body.get("title") or response.reason_phrase)
        detail = body.get("detail")
        for error in body.get("errors") or []:
            if isinstance(error, dict):
                one = f"{error.get('field')}: {error.get('message')}"
                fields.append(one)
                if detail in (one, error.get("message")):
                    detail = None  # said once, with its field
    else:
        title, detail = response.reason_phrase, response.text.strip()[:300] or None
    said = [f"{response.status_code} {title}"]
    if detail and detail != title:
        said.append(str(detail).rstrip("."))
    said.extend(fields)
    line = ": ".join(said[:2]) + "".join(f"; {f}" for f in said[2:])
    if response.status_code == 429 and response.headers.get("Retry-After"):
        line += f"; retry after {response.headers['Retry-After']} s"
    if hint := _HINTS.get(response.status_code):
        line += f"; {hint}"
    return " ".join(line.split())


class Api:
    """The API a ``runs`` command talks to, found as the module docstring says."""

    def __init__(self, api_url: str | None, api_key: str | None) -> None:
        from app.core.services import find_installation

        found = find_installation(_settings()) if not (api_url and api_key) else None
        self.url = (api_url or (found.api_url if found else DEFAULT_API_URL)).rstrip("/")
        key = api_key
        # The up's key goes only to the up's API, never to a URL someone else typed.
        if not key and found is not None and found.api_url.rstrip("/") == self.url:
            key = found.api_key
        if not key:
            raise CliError(
                "no API key: pass --api-key or set TRAINYARD_API_KEY (`trainyard keys create "
                "--project NAME` makes one; a running `trainyard up` provides its own)"
            )
        self.key = key

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """The JSON answer; a :class:`CliError` for an error answer or no answer."""
        import httpx

        try:
            with httpx.Client(base_url=self.url, headers=_auth(self.key), timeout=30) as c:
                response = c.request(method, path, **kwargs)
        except httpx.ConnectError as exc:
            raise CliError(
                f"cannot reach the API at {self.url} ({exc}): is `trainyard up` running? "
                "(or pass --api-url / set TRAINYARD_API_URL)"
            ) from exc
        except httpx.TimeoutException as exc:
            raise CliError(f"the API at {self.url} did not answer within 30 s") from exc
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise CliError(f"talking to the API at {self.url} failed: {exc}") from exc
        if response.status_code >= 400:
            raise CliError(problem_line(response))
        return response.json()


def _looks_like_path(value: str) -> bool:
    """A hub model id is ``name`` or ``org/name``; anything else with a slash, or starting
    with a dot or a tilde, can only be a folder."""
    return value.startswith((".", "~", "/")) or value.count("/") > 1 or value.endswith("/")


# The fields of a run body that name a model the worker loads: a folder or a hub id.
MODEL_FIELDS = ("model_name", "teacher.student_model")


def local_model_path(value: str, bases: Sequence[Path], where: str, field: str) -> str:
    """A model ``field`` made absolute against the first of ``bases`` holding it, since the
    worker reads it from another working directory; a hub id is left as it is."""
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    for base in bases:
        if (base / path).is_dir():
            return str((base / path).resolve())
    if _looks_like_path(value):
        tried = " or ".join(str(b) for b in dict.fromkeys(bases))
        raise CliError(
            f"{field} {value!r} ({where}) is not a folder in {tried}: give an absolute path "
            "(`trainyard tiny-model` builds the tiny model and prints its path)"
        )
    return value


def absolute_model_paths(body: dict[str, Any], preset: Path, overrides: list[str]) -> None:
    """Each of :data:`MODEL_FIELDS` the body names, relative, made absolute: a preset's
    against the preset's folder then the current one, an override's against the current
    folder (where it was typed)."""
    cwd = Path.cwd()
    overridden = {item.partition("=")[0].strip() for item in overrides}
    for field in MODEL_FIELDS:
        *parents, name = field.split(".")
        node: Any = body
        for part in parents:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict) or not isinstance(node.get(name), str):
            continue
        if field in overridden:
            bases, where = [cwd], "from the override"
        else:
            bases, where = [preset.resolve().parent, cwd], f"from {preset}"
        node[name] = local_model_path(node[name], bases, where, field)


@runs_app.command("create")
def runs_create(
    preset: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="YAML/JSON run.")],
    overrides: Annotated[
        list[str] | None, typer.Argument(help="Dotted overrides: a.b=value.")
    ] = None,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
    idempotency_key: Annotated[str | None, typer.Option()] = None,
    as_json: Json = False,
) -> None:
    """Create a run from a preset file (plus overrides); prints the run's id (the run with
    --json). A relative model_name or teacher.student_model is a folder next to the preset or
    in the current folder (an override's: in the current folder), sent as an absolute path."""
    import yaml

    from app.core.config_files import apply_overrides, load_preset

    overrides = overrides or []
    try:
        loaded = load_preset(preset)
    except (OSError, ValueError, yaml.YAMLError) as exc:
        raise CliError(f"{preset}: {exc}", code=2) from exc
    try:
        body = apply_overrides(loaded, overrides)
    except ValueError as exc:
        raise CliError(str(exc), code=2) from exc
    absolute_model_paths(body, preset, overrides)
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    run = Api(api_url, api_key).call("POST", "/runs", json=body, headers=headers)
    if as_json:
        _print_json(run)
        return
    err.print(f"run {run['id']} created ({run['status']}): `trainyard runs get {run['id']}`")
    print(run["id"], flush=True)


def _table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain columns, nothing cut: ids must stay whole to be pasted."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = [headers, *rows]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


@runs_app.command("list")
def runs_list(
    status: Annotated[list[str] | None, typer.Option(help="Repeatable.")] = None,
    limit: Annotated[int, typer.Option(min=1)] = 20,
    after: Annotated[str | None, typer.Option(help="The next_cursor of a previous page.")] = None,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """List runs, newest first (the whole page with --json)."""
    params: dict[str, Any] = {"limit": limit}
    if status:
        params["status"] = status
    if after:
        params["after"] = after
    page = Api(api_url, api_key).call("GET", "/runs", params=params)
    if as_json:
        _print_json(page)
        return
    rows = [
        [r["id"], r["status"], str(r["step"]), r["model_name"], r["created_at"]]
        for r in page["data"]
    ]
    print(_table(["id", "status", "step", "model", "created"], rows), flush=True)
    if page.get("has_more"):
        err.print(f"[dim]more: --after {page['next_cursor']}", highlight=False)


@runs_app.command("get")
def runs_get(
    run_id: str, api_url: ApiUrl = None, api_key: ApiKey = None, as_json: Json = False
) -> None:
    """Print one run (all of it with --json)."""
    run = Api(api_url, api_key).call("GET", f"/runs/{run_id}")
    if as_json:
        _print_json(run)
        return
    for name, value in run.items():
        if value is not None and not isinstance(value, dict | list):
            print(f"{name}: {value}")
    if run.get("metrics"):
        print("metrics: " + json.dumps(run["metrics"]))
    err.print("[dim](--json prints the whole run)")


def _action(
    action: str, run_id: str, api_url: str | None, api_key: str | None, as_json: bool
) -> None:
    run = Api(api_url, api_key).call("POST", f"/runs/{run_id}/{action}")
    if as_json:
        _print_json(run)
        return
    # A live run's worker applies cancel and pause at its next heartbeat.
    flag = {"cancel": "cancel_requested", "pause": "pause_requested"}.get(action)
    requested = flag is not None and run.get(flag) and run["status"] not in ("cancelled", "paused")
    err.print(f"run {run['id']}: {run['status']}" + (f" ({action} requested)" if requested else ""))


@runs_app.command("cancel")
def runs_cancel(
    run_id: str, api_url: ApiUrl = None, api_key: ApiKey = None, as_json: Json = False
) -> None:
    """Cancel a run."""
    _action("cancel", run_id, api_url, api_key, as_json)


@runs_app.command("pause")
def runs_pause(
    run_id: str, api_url: ApiUrl = None, api_key: ApiKey = None, as_json: Json = False
) -> None:
    """Pause a run at its next safe point."""
    _action("pause", run_id, api_url, api_key, as_json)


@runs_app.command("resume")
def runs_resume(
    run_id: str, api_url: ApiUrl = None, api_key: ApiKey = None, as_json: Json = False
) -> None:
    """Put a paused run back in the queue."""
    _action("resume", run_id, api_url, api_key, as_json)


@contextlib.contextmanager
def _problems(api: Api) -> Iterator[None]:
    """An error answer or a lost API, met mid-way through a command that holds a client of
    its own (a stream), said in one line as :meth:`Api.call` says it."""
    import httpx

    try:
        yield
    except httpx.HTTPStatusError as exc:
        raise CliError(problem_line(exc.response)) from exc
    except httpx.TransportError as exc:
        raise CliError(f"talking to the API at {api.url} failed: {exc}") from exc


def _client(api: Api) -> httpx.Client:
    import httpx

    return httpx.Client(base_url=api.url, headers=_auth(api.key), timeout=30)


@runs_app.command("follow")
def runs_follow(
    run_id: str,
    events: Annotated[int, typer.Option(min=0, help="How many of the last events to show.")] = 5,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print each event as one JSON line (NDJSON).")
    ] = False,
) -> None:
    """Follow a run live until it ends: its status, a step bar with the ETA, the reward and
    its curve, and the last events. Resumes by itself after a dropped stream; a finished
    run is shown at once.

    Exit status: 0 completed, 1 failed (the error printed), 2 cancelled, 3 paused
    (`trainyard runs resume` continues it)."""
    from app.follow import EXIT_CODES, follow, until_settled

    api = Api(api_url, api_key)
    run = api.call("GET", f"/runs/{run_id}")
    try:
        with _problems(api), _client(api) as client:
            if as_json:
                for event in until_settled(client, str(run["id"]), stop_on_pause=True):
                    if event.type != "keep-alive":
                        print(json.dumps(event.data), flush=True)
                final = api.call("GET", f"/runs/{run['id']}")
            else:
                final = follow(
                    client, run, console=Console(soft_wrap=True), events=events, stop_on_pause=True
                )
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    status = final["status"]
    if status == "failed":
        raise CliError(f"run {final['id']} failed: {final.get('error') or '(no error recorded)'}")
    if not as_json:
        said = f"run {final['id']} {status} at step {final['step']}"
        if status == "paused":
            said += f": `trainyard runs resume {final['id']}` continues it"
        print(said, flush=True)
    raise typer.Exit(EXIT_CODES.get(status, 1))


@runs_app.command("events")
def runs_events(
    run_id: str,
    limit: Annotated[int, typer.Option(min=1)] = 50,
    after: Annotated[str | None, typer.Option(help="The next_cursor of a previous page.")] = None,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """A page of the run's events, oldest first (the whole page with --json)."""
    from app.follow import event_line

    params: dict[str, Any] = {"limit": limit}
    if after:
        params["after"] = after
    page = Api(api_url, api_key).call("GET", f"/runs/{run_id}/events", params=params)
    if as_json:
        _print_json(page)
        return
    for event in page["data"]:
        print(f"{event['id']:>6}  {event_line(event)}")
    sys.stdout.flush()
    if page.get("has_more"):
        err.print(f"[dim]more: --after {page['next_cursor']}", highlight=False)


# Fields of a run that are its result or bookkeeping, not how it was asked for.
_NOT_CONFIG = frozenset(
    {
        "id",
        "project_id",
        "status",
        "metrics",
        "error",
        "step",
        "epoch",
        "attempt",
        "failures",
        "cancel_requested",
        "pause_requested",
        "version",
        "created_at",
        "updated_at",
        "started_at",
        "completed_at",
    }
)


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """A run's settings as dotted names (``grpo.beta``), so two runs compare field by
    field; lists stay whole."""
    if isinstance(value, dict) and value:
        flat: dict[str, Any] = {}
        for key, inner in value.items():
            flat.update(_flatten(inner, f"{prefix}{key}."))
        return flat
    return {prefix.rstrip("."): value}


def _shown(value: Any, limit: int = 40) -> str:
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


@runs_app.command("compare")
def runs_compare(
    run_ids: Annotated[list[str], typer.Argument(help="2 to 5 run ids.")],
    all_fields: Annotated[
        bool, typer.Option("--all", help="Every field, not only those that differ.")
    ] = False,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """Runs side by side: their settings (fields that differ marked `*`; only those unless
    --all), then status, steps and reward (first step, last step, best)."""
    if not 2 <= len(run_ids) <= 5:
        raise CliError(f"compare takes 2 to 5 runs, not {len(run_ids)}", code=2)
    api = Api(api_url, api_key)
    runs = [api.call("GET", f"/runs/{run_id}") for run_id in run_ids]
    flat = [_flatten({k: v for k, v in r.items() if k not in _NOT_CONFIG}) for r in runs]
    names = sorted(set().union(*flat))
    fields = {name: [f.get(name) for f in flat] for name in names}
    differs = [name for name, values in fields.items() if any(v != values[0] for v in values)]
    rewards = []
    for run in runs:
        series = api.call("GET", f"/runs/{run['id']}/metrics", params={"name": "reward_mean"})
        points = [p["value"] for p in series["series"][0]["points"]] if series["series"] else []
        rewards.append(
            {
                "first": points[0] if points else None,
                "last": points[-1] if points else None,
                "best": max(points) if points else None,
                "steps": len(points),
            }
        )
    if as_json:
        _print_json(
            {
                "runs": [
                    {"id": r["id"], "status": r["status"], "step": r["step"], "reward": w}
                    for r, w in zip(runs, rewards, strict=True)
                ],
                "fields": fields,
                "differs": differs,
            }
        )
        return
    shown = names if all_fields else differs
    headers = ["", "field", *(r["id"] for r in runs)]
    rows = [["*" if n in differs else "", n, *(_shown(v) for v in fields[n])] for n in shown]

    def reward(key: str) -> list[str]:
        return [f"{w[key]:.3f}" if w[key] is not None else "-" for w in rewards]

    rows += [
        ["", "status", *(r["status"] for r in runs)],
        ["", "step", *(str(r["step"]) for r in runs)],
        ["", "reward first", *reward("first")],
        ["", "reward last", *reward("last")],
        ["", "reward best", *reward("best")],
    ]
    print(_table(headers, rows), flush=True)
    if not differs:
        err.print("[dim]the runs' settings are the same", highlight=False)


# -- trajectories over HTTP ------------------------------------------------------------------


def _tool_calls(trajectory: dict[str, Any]) -> int:
    """The episode's tool calls: what the workers count in ``metadata.tool_calls``, else the
    calls its messages hold (an imported row may have no metadata)."""
    counted = (trajectory.get("metadata") or {}).get("tool_calls")
    if isinstance(counted, int):
        return counted
    messages = trajectory.get("messages") or []
    return sum(len(m.get("tool_calls") or []) for m in messages if isinstance(m, dict))


def _answer(trajectory: dict[str, Any]) -> str:
    messages = trajectory.get("messages") or []
    last = next((m for m in reversed(messages) if m.get("role") == "assistant"), None)
    return _shown(str((last or {}).get("content") or ""), 50)


@trajectories_app.command("list")
def trajectories_list(
    run_id: str,
    step: Annotated[int | None, typer.Option(min=0)] = None,
    min_reward: Annotated[float | None, typer.Option(help="Inclusive.")] = None,
    max_reward: Annotated[float | None, typer.Option(help="Inclusive.")] = None,
    min_tool_calls: Annotated[
        int | None, typer.Option(min=0, help="Agent episodes with at least this many tool calls.")
    ] = None,
    limit: Annotated[int, typer.Option(min=1)] = 20,
    after: Annotated[str | None, typer.Option(help="The next_cursor of a previous page.")] = None,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
    as_json: Json = False,
) -> None:
    """A run's trajectories by step, group and rollout (the whole page with --json)."""
    params = {
        "step": step,
        "min_reward": min_reward,
        "max_reward": max_reward,
        "min_tool_calls": min_tool_calls,
        "limit": limit,
        "after": after,
    }
    page = Api(api_url, api_key).call(
        "GET",
        f"/runs/{run_id}/trajectories",
        params={k: v for k, v in params.items() if v is not None},
    )
    if as_json:
        _print_json(page)
        return
    rows = [
        [
            t["id"],
            str(t["step"]),
            str(t["group_index"]),
            str(t["rollout_index"]),
            f"{t['reward']:.3f}" if t["reward"] is not None else "-",
            str(_tool_calls(t)),
            _answer(t),
        ]
        for t in page["data"]
    ]
    headers = ["id", "step", "group", "rollout", "reward", "tools", "answer"]
    print(_table(headers, rows), flush=True)
    if page.get("has_more"):
        err.print(f"[dim]more: --after {page['next_cursor']}", highlight=False)


def message_lines(message: dict[str, Any]) -> list[str]:
    """One message for reading: its role, its content, each tool call with its arguments,
    and a tool result's error, duration and truncation."""
    role = str(message.get("role") or "?")
    head = f"[{role}]"
    if message.get("name"):
        head += f" {message['name']}"
    if message.get("tool_call_id"):
        head += f" (answers {message['tool_call_id']})"
    notes = []
    if message.get("error"):
        notes.append(f"error: {' '.join(str(message['error']).split())}")
    if message.get("duration_ms") is not None:
        notes.append(f"{message['duration_ms']} ms")
    if message.get("truncated"):
        notes.append("truncated")
    if notes:
        head += "  " + ", ".join(notes)
    lines = [head]
    content = message.get("content")
    if content:
        text = content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)
        lines += [f"  {line}" for line in text.splitlines()]
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        said = f"  → call {function.get('name')}({arguments})"
        lines.append(said + (f"  id {call['id']}" if call.get("id") else ""))
    return lines


@trajectories_app.command("show")
def trajectories_show(
    trajectory_id: str, api_url: ApiUrl = None, api_key: ApiKey = None, as_json: Json = False
) -> None:
    """One trajectory: where it came from, its reward (and breakdown), then its messages,
    tool calls and tool results included."""
    t = Api(api_url, api_key).call("GET", f"/trajectories/{trajectory_id}")
    if as_json:
        _print_json(t)
        return
    reward = f"{t['reward']:.3f}" if t["reward"] is not None else "-"
    print(f"trajectory {t['id']}")
    print(f"run {t['run_id']}  step {t['step']}  group {t['group_index']}  ", end="")
    print(f"rollout {t['rollout_index']}  reward {reward}")
    if t.get("reward_breakdown"):
        print("reward breakdown: " + json.dumps(t["reward_breakdown"], ensure_ascii=False))
    if t.get("metadata"):
        print("metadata: " + json.dumps(t["metadata"], ensure_ascii=False))
    for message in t.get("messages") or []:
        print()
        print("\n".join(message_lines(message)))
    sys.stdout.flush()


@trajectories_app.command("export")
def trajectories_export(
    output: Annotated[Path, typer.Argument(help="JSONL file to write ('-' for stdout).")],
    run_id: Annotated[list[str] | None, typer.Option(help="Repeatable.")] = None,
    learning_key: Annotated[list[str] | None, typer.Option(help="Repeatable.")] = None,
    status: Annotated[list[str] | None, typer.Option(help="The run's status; repeatable.")] = None,
    step: Annotated[list[int] | None, typer.Option(help="Repeatable.")] = None,
    min_reward: Annotated[float | None, typer.Option(help="Inclusive.")] = None,
    max_reward: Annotated[float | None, typer.Option(help="Inclusive.")] = None,
    min_tool_calls: Annotated[
        int | None, typer.Option(min=0, help="Agent episodes with at least this many tool calls.")
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="ISO date, or date and time (no zone: UTC).")
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="ISO date, or date and time (no zone: UTC); inclusive.")
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1)] = None,
    messages: Annotated[bool, typer.Option(help="Include the messages.")] = True,
    api_url: ApiUrl = None,
    api_key: ApiKey = None,
) -> None:
    """Export the key's project's trajectories matching the filters as JSON Lines, through
    the API (`GET /trajectories/export`), written as it streams."""
    params = {
        "run_id": run_id,
        "learning_key": learning_key,
        "status": status,
        "step": step,
        "min_reward": min_reward,
        "max_reward": max_reward,
        "min_tool_calls": min_tool_calls,
        "start_date": since,
        "end_date": until,
        "limit": limit,
        "include_messages": "true" if messages else "false",
    }
    api = Api(api_url, api_key)
    written = 0
    with _problems(api), _client(api) as client:
        query = {k: v for k, v in params.items() if v is not None}
        with client.stream("GET", "/trajectories/export", params=query, timeout=None) as answer:
            if answer.status_code >= 400:
                answer.read()
                raise CliError(problem_line(answer))
            to_stdout = str(output) == "-"
            sink = contextlib.nullcontext(sys.stdout) if to_stdout else output.open("w")
            with sink as out:
                for line in answer.iter_lines():
                    if line:
                        out.write(line + "\n")
                        written += 1
                out.flush()
    err.print(f"{written} trajectories exported")


# -- training data from the database ---------------------------------------------------------


@data_app.command("export")
def data_export(
    output: Annotated[Path, typer.Argument(help="JSONL file to write ('-' for stdout).")],
    project: Annotated[list[str] | None, typer.Option(help="Project name or id.")] = None,
    run_id: Annotated[list[str] | None, typer.Option()] = None,
    learning_key: Annotated[list[str] | None, typer.Option()] = None,
    status: Annotated[list[str] | None, typer.Option(help="The run's status.")] = None,
    min_reward: float | None = None,
    max_reward: float | None = None,
    min_tool_calls: Annotated[
        int | None, typer.Option(min=0, help="Agent episodes with at least this many tool calls.")
    ] = None,
    since: Annotated[
        str | None, typer.Option(help="ISO date, or date and time (no zone: UTC).")
    ] = None,
    until: Annotated[
        str | None, typer.Option(help="ISO date, or date and time (no zone: UTC); inclusive.")
    ] = None,
    limit: Annotated[int | None, typer.Option(min=1)] = None,
    messages: Annotated[bool, typer.Option(help="Include the messages.")] = True,
) -> None:
    """Export trajectories matching the filters as JSON Lines."""
    from app.core.services import client_database_url
    from app.core.time import parse_day_or_instant
    from app.training_data import TrainingDataError, export_jsonl

    def when(option: str, value: str | None) -> Any:
        if value is None:
            return None
        try:
            return parse_day_or_instant(value)
        except ValueError as exc:
            raise CliError(f"--{option} {value!r}: {exc}", code=2) from exc

    start, end = when("since", since), when("until", until)
    db_url = client_database_url(_settings())

    def _export() -> int:
        return export_jsonl(
            db_url,
            sys.stdout if str(output) == "-" else output,
            projects=project,
            run_ids=run_id,
            learning_key=learning_key,
            statuses=status,
            min_reward=min_reward,
            max_reward=max_reward,
            min_tool_calls=min_tool_calls,
            start_date=start,
            end_date=end,
            limit=limit,
            include_messages=messages,
        )

    try:
        written = _on_database(db_url, _export)
    except TrainingDataError as exc:
        raise CliError(str(exc), code=2) from exc
    err.print(f"{written} trajectories exported")


@data_app.command("import")
def data_import(
    source: Annotated[Path, typer.Argument(exists=True, dir_okay=False, help="JSONL file.")],
    project: Annotated[str, typer.Option(help="Project name or id to import into.")],
    learning_key: Annotated[str | None, typer.Option(help="Key for every imported run.")] = None,
    as_json: Json = False,
) -> None:
    """Import a trajectory JSONL file into a project, all or nothing."""
    from app.core.services import client_database_url
    from app.training_data import TrainingDataError, import_jsonl

    db_url = client_database_url(_settings())

    def _import() -> Any:
        return import_jsonl(db_url, source, project=project, learning_key=learning_key)

    try:
        result = _on_database(db_url, _import)
    except TrainingDataError as exc:
        raise CliError(str(exc), code=2) from exc
    if as_json:
        _print_json(
            {
                "project_id": str(result.project_id),
                "trajectories": result.trajectories,
                "run_ids": {k: str(v) for k, v in result.run_ids.items()},
            }
        )
        return
    err.print(f"{result.trajectories} trajectories imported into {len(result.run_ids)} run(s)")


if __name__ == "__main__":
    main()
