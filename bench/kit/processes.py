"""Processes: a service in its own process group, waited for and stopped with its whole
group however the benchmark ends; one-shot commands; the CPU and memory of a process tree;
py-spy."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

from kit import OUT, REPO, BenchError, log


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


def tree(pid: int, recursive: bool = True) -> list[psutil.Process]:
    """A process and its descendants (none if it is gone)."""
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        return [root, *(root.children(recursive=True) if recursive else [])]
    return []


def rss_bytes(*pids: int) -> int:
    """Resident bytes of these processes and their descendants (a Celery worker may fork,
    uvicorn runs its workers as children)."""
    total = 0
    for pid in pids:
        for proc in tree(pid):
            with contextlib.suppress(psutil.Error):
                total += proc.memory_info().rss
    return total


PYSPY_RATE = 100  # samples per second


def pyspy() -> str:
    """The py-spy profiler, from the project's venv or PATH."""
    found = shutil.which("py-spy", path=str(REPO / ".venv" / "bin")) or shutil.which("py-spy")
    if not found:
        raise BenchError("--profile needs py-spy (.venv/bin/pip install py-spy)")
    return found
