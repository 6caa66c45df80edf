"""The handshake of an asynchronous run's trainer and the producer thread that generates
the steps ahead (``grpo.async_rollouts``, docs/async.md): single-turn rollouts
(workers/pipeline/ahead.py) and a gateway run's episodes (workers/gateway/rollouts.py)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Admission(Generic[T]):
    """The handshake of an asynchronous run's trainer and its producer thread, within the
    staleness ``bound``: the trainer says which adapter version it saved last and waits for
    a step's rollouts; the producer waits until a step is admitted (the trainer has saved
    the adapter of ``step - 1 - bound`` or later) and hands the step's rollouts over, or
    the failure that stopped it, which the trainer raises at its next step."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.changed = threading.Condition()  # guards what follows
        self.ready: dict[int, T] = {}
        self.saved = -1  # the newest adapter version the trainer saved
        self.failure: BaseException | None = None
        self.stopping = False

    def close(self) -> None:
        with self.changed:
            self.stopping = True
            self.changed.notify_all()

    # -- the trainer's side ------------------------------------------------------------------
    def take(self, step: int, check: Callable[[], None]) -> T:
        """The rollouts of ``step``, once the adapter of ``step - 1`` is saved (it admits the
        steps after); ``check`` is called while waiting (a cancel ends the wait)."""
        with self.changed:
            self.saved = step - 1
            self.changed.notify_all()
            while step not in self.ready and self.failure is None:
                self.changed.wait(0.25)
                check()
            if step not in self.ready:
                assert self.failure is not None
                raise self.failure
            return self.ready.pop(step)

    # -- the producer's side -----------------------------------------------------------------
    def admit(self, step: int) -> int | None:
        """Wait until ``step`` is admitted: the newest version saved then (None once closed)."""
        with self.changed:
            while not self.stopping and self.saved < max(step - 1 - self.bound, 0):
                self.changed.wait()
            return None if self.stopping else self.saved

    def put(self, step: int, rollouts: T) -> None:
        with self.changed:
            self.ready[step] = rollouts
            self.changed.notify_all()

    def fail(self, exc: BaseException) -> None:
        with self.changed:
            if not self.stopping:
                self.failure = exc
            self.changed.notify_all()
