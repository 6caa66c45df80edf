"""A worker's claim on a run, which its writes are fenced on (app/runs/lifecycle/state.py):
a module of its own so that what the run's moves write besides the run (a gateway run's
episodes, app/gateway/service.py) can take fenced writes without importing the moves."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Fence:
    """A worker's claim on a run: its writes count only while it still holds the lease."""

    owner: str
    attempt: int
