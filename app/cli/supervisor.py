"""The supervisor of ``trainyard up``: it starts the API and the worker as children, each in
a process group of its own, restarts one that dies after a backoff (and gives up on one
that keeps dying soon after it started), and stops them all, by pid, when ``up`` stops.

It keeps the embedded PostgreSQL and Redis that ``up`` started running too: they are
daemons, not children, so it watches their pids and starts a dead one again (the same data
folder, the same socket, so the API and the worker reconnect by themselves) on the same
backoff."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from app.cli.common import CliError

if TYPE_CHECKING:
    from app.core.embedded import EmbeddedService

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
class _Kept:
    """Something kept running, and its restarts."""

    name: str
    started_at: float = 0.0
    quick_exits: int = 0
    restart_at: float | None = None

    def died(self, now: float, what: str) -> float:
        """The delay before its next start; raises :class:`CliError` once the delays for
        one that keeps dying soon after it started are used up."""
        lived = now - self.started_at
        self.quick_exits = self.quick_exits + 1 if lived < STABLE_SECONDS else 1
        if self.quick_exits > len(RESTART_DELAYS):
            raise CliError(
                f"{what}, its {self.quick_exits}th exit within {STABLE_SECONDS:.0f} s of "
                "starting; stopping (its output is above)"
            )
        delay = RESTART_DELAYS[self.quick_exits - 1]
        self.restart_at = now + delay
        return delay


@dataclass(kw_only=True)
class _Child(_Kept):
    argv: list[str]
    env: dict[str, str]
    proc: subprocess.Popen[bytes] | None = None


@dataclass(kw_only=True)
class _Service(_Kept):
    """An embedded server ``up`` started (None while it is down), and how to start it again."""

    current: EmbeddedService | None
    start: Callable[[], EmbeddedService]


class Supervisor:
    """Keeps ``up``'s children running: one that dies is restarted after a backoff, and
    said so, while the others stay up; :meth:`stop` stops them all, by pid.

    Each child runs in a process group of its own, so that a restart or a stop reaches what
    the child forked too (uvicorn's worker processes), and a Ctrl-C in the terminal reaches
    only ``up``, which then stops the children in order.
    """

    def __init__(
        self, say: Callable[[str], None], on_change: Callable[[], None] = lambda: None
    ) -> None:
        self.say = say
        self.on_change = on_change
        self.children: list[_Child] = []
        self.services: list[_Service] = []
        self._hook = _die_with_parent()

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        child = _Child(name, argv=argv, env=env)
        self.children.append(child)
        self._spawn(child)
        self.say(f"{name} started (pid {self._pid(child)})")

    def keep(
        self, name: str, service: EmbeddedService, start: Callable[[], EmbeddedService]
    ) -> None:
        """Keep ``service`` (already running) running: ``start`` starts it again."""
        self.services.append(
            _Service(name, started_at=time.monotonic(), current=service, start=start)
        )

    def running_services(self) -> list[EmbeddedService]:
        return [s.current for s in self.services if s.current is not None]

    def pids(self) -> dict[str, int]:
        return {c.name: c.proc.pid for c in self.children if c.proc is not None}

    def check(self) -> None:
        """Reap children and services that died and restart those whose backoff is over;
        raises :class:`CliError` for one that keeps dying."""
        now = time.monotonic()
        for service in self.services:
            self._check_service(service, now)
        for child in self.children:
            code = child.proc.poll() if child.proc is not None else None
            if child.proc is not None and code is not None:
                pid = child.proc.pid
                self._signal_group(pid, signal.SIGKILL)  # what it forked dies with it
                child.proc = None
                how = f"{child.name} (pid {pid}) {_how_it_ended(code)}"
                delay = child.died(now, f"the {how}")
                self.say(f"{how}; restarting in {delay:g} s")
            if child.proc is None and child.restart_at is not None and now >= child.restart_at:
                self._spawn(child)
                self.say(f"{child.name} restarted (pid {self._pid(child)})")
                self.on_change()

    def _check_service(self, service: _Service, now: float) -> None:
        current = service.current
        if current is not None and not current.running():
            service.current = None
            how = f"{service.name} (pid {current.pid}) is gone"
            self.say(f"{how}; restarting in {service.died(now, how):g} s")
        if service.current is None and service.restart_at is not None and now >= service.restart_at:
            service.started_at = now
            service.restart_at = None
            try:
                service.current = service.start()
            except Exception as exc:  # a failed start counts as a quick exit
                first = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                how = f"{service.name} did not start ({first})"
                self.say(f"{how}; retrying in {service.died(time.monotonic(), how):g} s")
                return
            self.say(f"{service.name} restarted (pid {service.current.pid})")
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
            env=child.env,
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
