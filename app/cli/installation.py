"""The state file ``trainyard up`` leaves for the other commands: the installation.

``up`` writes where its parts are (the API's URL, the database and broker URLs, its key,
its own and its children's pids) to ``<home>/up.json``; when ``TRAINYARD_HOME`` is not set
(home is the current folder's ``.trainyard``) it writes the same file to
``~/.trainyard/up.json`` too, so that a command run from any other folder finds the ``up``
last started without exports, unless that file names another ``up`` still running
(:func:`held_by_another`): that one keeps it. Client commands (``keys``, ``runs``, ``data``, and
:func:`app.core.services.client_database_url`) read it with :func:`find_installation`, and
say there is none with :func:`no_installation`.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import psutil

from app.core.settings import Settings

STATE_FILE = "up.json"


class NoInstallation(RuntimeError):
    """No URL is configured and no ``trainyard up`` is running where the state files are."""


#: How far a process's start time, as psutil reads it, may move while it runs.
STARTED_SLACK_SECONDS = 1.0


@dataclass(frozen=True)
class Installation:
    """What a ``trainyard up`` wrote for the other commands: where its parts are.

    ``pid`` with ``process_started`` (the process's start time) identifies the ``up``
    process, so a recycled pid is never taken for it; ``pid`` is None once it has stopped.
    The key is kept after a stop, so the next ``up`` in the same home hands out the same one.
    """

    home: str
    api_url: str
    database_url: str
    broker_url: str
    pid: int | None
    process_started: float | None
    api_key: str | None = None
    api_key_id: str | None = None
    children: dict[str, int] = field(default_factory=dict)

    def running(self) -> bool:
        if self.pid is None or self.process_started is None:
            return False
        try:
            proc = psutil.Process(self.pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                return False
            # psutil derives a start time from the boot time, which moves when the clock
            # is stepped (NTP, a laptop waking): a second's slack still tells a recycled
            # pid, whose process started after this one ended.
            return abs(proc.create_time() - self.process_started) < STARTED_SLACK_SECONDS
        except psutil.Error:
            return False

    def stopped(self) -> Installation:
        return replace(self, pid=None, process_started=None, children={})


def user_home() -> Path:
    """The per-user folder every command looks in when ``TRAINYARD_HOME`` is not set."""
    return Path.home() / ".trainyard"


def home_is_explicit(settings: Settings) -> bool:
    return "home" in settings.model_fields_set


def state_files(settings: Settings) -> list[Path]:
    """Where ``up`` writes its state, and where the other commands look, in that order."""
    paths = [settings.home.expanduser().resolve() / STATE_FILE]
    if not home_is_explicit(settings):
        paths.append(user_home().resolve() / STATE_FILE)
    return list(dict.fromkeys(paths))


def read_state(path: Path) -> Installation | None:
    try:
        data = json.loads(path.read_text())
        return Installation(**data)
    except (OSError, ValueError, TypeError):
        return None  # absent, half written by a crash, or from another version


def write_state(path: Path, installation: Installation) -> None:
    """Write atomically (readers never see half a file), readable by its owner only: it
    holds an API key and the database URL."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".up-", suffix=".json", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(asdict(installation), fh, indent=2)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def held_by_another(path: Path, pid: int) -> Installation | None:
    """The running ``up``, other than process ``pid``, that the state file at ``path``
    names: while it runs the file is its own, and no other ``up`` writes it."""
    found = read_state(path)
    if found is not None and found.pid != pid and found.running():
        return found
    return None


def find_installation(settings: Settings) -> Installation | None:
    """The running ``up`` named by the first state file that names a live one."""
    for path in state_files(settings):
        found = read_state(path)
        if found is not None and found.running():
            return found
    return None


def no_installation(settings: Settings, also: str = "") -> NoInstallation:
    where = " or ".join(str(p) for p in state_files(settings))
    return NoInstallation(
        f"no running Trainyard: no state of a running `trainyard up` in {where}{also}; "
        "start one with `trainyard up` (or set TRAINYARD_HOME to the folder of the one running)"
    )
