"""``python -m workers.watched OWNER -- COMMAND``: what a Ray-placed vLLM server runs
under. Real processes: the command's exit status comes back; the owner's death kills the
command's whole session, a grandchild that ignores SIGTERM included; a SIGTERM is passed on."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

WATCHED = [sys.executable, "-m", "workers.watched"]
# A command that leaves a grandchild which ignores SIGTERM, and says its pid.
STUBBORN = (
    "import os, signal, subprocess, sys, time\n"
    "child = subprocess.Popen([sys.executable, '-c', "
    "'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)'])\n"
    "print(child.pid, flush=True)\n"
    "time.sleep(300)\n"
)


def _gone(pid: int, within: float = 20) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z":
            return True  # a zombie: dead, not yet reaped by its parent
        time.sleep(0.05)
    return False


def test_the_commands_exit_status_comes_back() -> None:
    done = subprocess.run([*WATCHED, str(os.getpid()), "--", "sh", "-c", "exit 7"], timeout=30)
    assert done.returncode == 7
    usage = subprocess.run([*WATCHED, str(os.getpid())], capture_output=True, timeout=30)
    assert usage.returncode == 2 and b"usage" in usage.stderr


def test_the_owners_death_kills_the_commands_whole_session() -> None:
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    watched = subprocess.Popen(
        [*WATCHED, str(owner.pid), "--", sys.executable, "-c", STUBBORN], stdout=subprocess.PIPE
    )
    assert watched.stdout is not None
    grandchild = int(watched.stdout.readline())
    owner.kill()
    owner.wait()
    assert watched.wait(timeout=20) == 128 + signal.SIGKILL
    assert _gone(grandchild)


def test_a_sigterm_reaches_the_command() -> None:
    watched = subprocess.Popen(
        [*WATCHED, str(os.getpid()), "--", sys.executable, "-c", "import time; time.sleep(300)"]
    )
    time.sleep(0.5)  # let the command start: a SIGTERM before it would find nothing to stop
    watched.terminate()
    assert watched.wait(timeout=20) == 128 + signal.SIGTERM
