from __future__ import annotations

from enum import StrEnum


class RunStatus(StrEnum):
    """Where a run is. ``paused`` and ``warming_up`` (an agent run's SFT warm-up before its
    first GRPO step) are ours; the rest are the reference's TrainingStatus."""

    PENDING = "pending"
    GENERATING = "generating"
    WARMING_UP = "warming_up"
    COLLECTING = "collecting"
    SCORING = "scoring"
    TRAINING = "training"
    PAUSED = "paused"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in TERMINAL


TERMINAL: frozenset[RunStatus] = frozenset(
    {RunStatus.COMPLETED, RunStatus.FAILED, RunStatus.CANCELLED}
)
# Statuses in which a worker holds the run and does work.
WORKING: frozenset[RunStatus] = frozenset(
    {
        RunStatus.GENERATING,
        RunStatus.WARMING_UP,
        RunStatus.COLLECTING,
        RunStatus.SCORING,
        RunStatus.TRAINING,
    }
)
# Statuses a worker may pick up: waiting in the queue, or mid-pipeline after its worker died.
CLAIMABLE: frozenset[RunStatus] = WORKING | {RunStatus.PENDING}
