"""A command that lives only as long as the process that started it.

``python -m workers.watched OWNER_PID -- COMMAND...`` runs COMMAND in a session of its
own and waits on two things at once (pidfds, no polling): COMMAND's end, whose exit status it
returns, and OWNER_PID's, on which it SIGKILLs COMMAND's whole session. A vLLM server that a
Ray actor starts (workers/pipeline/ray_servers.py) runs under it: when Ray kills the actor, as
it does when the worker that placed it dies or its node is lost, the server and every process
it spawned go too. A SIGTERM (the actor's stop) is passed on to the session, then SIGKILL
after :data:`GRACE_SECONDS`. It imports nothing of Trainyard's: it starts in milliseconds.
"""

from __future__ import annotations

import contextlib
import os
import select
import signal
import subprocess
import sys
import time

GRACE_SECONDS = 10.0


def kill_session(pid: int) -> None:
    """SIGKILL to the session ``pid`` leads: it and every process it started there."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m workers.watched OWNER_PID -- COMMAND...", file=sys.stderr)
        return 2
    try:
        owner = os.pidfd_open(int(argv[0]))
    except ProcessLookupError:
        return 137  # already gone: nothing to start for
    # A signal wakes the wait below through this pipe (the handlers themselves do nothing).
    wake, woken = os.pipe()
    os.set_blocking(woken, False)
    signal.set_wakeup_fd(woken)
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, frame: None)
    child = subprocess.Popen(argv[2:], start_new_session=True)
    ended = os.pidfd_open(child.pid)
    deadline: float | None = None  # set by a SIGTERM: the session's SIGKILL after the grace
    while True:
        timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
        ready, _, _ = select.select([owner, ended, wake], [], [], timeout)
        if ended in ready:
            break
        if owner in ready or (deadline is not None and not ready):
            kill_session(child.pid)  # the owner is gone, or the command outlived the grace
            break
        if wake in ready:
            os.read(wake, 512)
            if deadline is None:
                deadline = time.monotonic() + GRACE_SECONDS
                os.killpg(child.pid, signal.SIGTERM)
    code = child.wait()
    kill_session(child.pid)  # what the command left behind in its session
    return 128 - code if code < 0 else code  # killed by a signal: as a shell says it


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
