"""The supervisor of ``trainyard up``: it starts the API and the worker as children, each in
a process group of its own, restarts one that dies after a backoff (and gives up on one
that keeps dying soon after it started), and stops them all, by pid, when ``up`` stops."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.cli.common import CliError

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
