"""How the worker reads its ranks' outcome files (workers.pipeline.ranks.outcome): as a
one-process training would have ended, rank 0 deciding every clean end, a silent rank a
death (the attempt ends), otherwise the first error written the cause."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from app.runs.lifecycle.state import LeaseLost
from app.runs.lifecycle.status import RunStatus
from workers.context import AttemptEnded, HandOver, StopRequested
from workers.pipeline.ranks import RankDied, RankFailed, outcome

CTX: Any = SimpleNamespace(run_id=uuid.uuid4())


def _said(folder: Path, **by_rank: dict[str, Any]) -> Path:
    for rank, said in by_rank.items():
        (folder / f"outcome-{rank.removeprefix('r')}.json").write_text(json.dumps(said))
    return folder


def test_rank_zeros_completion_is_the_final_model(tmp_path: Path) -> None:
    done = {"outcome": "completed", "final": "/artifacts/run/final/m", "at": 1}
    assert outcome(_said(tmp_path, r0=done, r1=done), 2, "the launcher exited with 0", CTX) == Path(
        "/artifacts/run/final/m"
    )


@pytest.mark.parametrize(
    ("word", "raised"),
    [
        ("cancelled", StopRequested),
        ("paused", StopRequested),
        ("handover", HandOver),
        ("lost", LeaseLost),
    ],
)
def test_rank_zeros_stop_is_raised_as_in_one_process(
    tmp_path: Path, word: str, raised: type
) -> None:
    folder = _said(tmp_path, r0={"outcome": word, "at": 2}, r1={"outcome": "followed", "at": 1})
    with pytest.raises(raised) as caught:
        outcome(folder, 2, "the launcher exited with 0", CTX)
    if raised is StopRequested:
        assert caught.value.status == RunStatus(word)


def test_a_silent_rank_died_and_ends_the_attempt(tmp_path: Path) -> None:
    lost_peer = {"outcome": "error", "error": "RuntimeError: Connection closed by peer", "at": 5}
    with pytest.raises(RankDied, match=r"rank 1 of 2 died .* exited with 1") as caught:
        outcome(_said(tmp_path, r0=lost_peer), 2, "the launcher exited with 1", CTX)
    assert isinstance(caught.value, AttemptEnded)


def test_the_first_error_written_is_the_cause(tmp_path: Path) -> None:
    cause = {"outcome": "error", "error": "ValueError: bad reward", "traceback": "tb", "at": 1.0}
    after = {"outcome": "error", "error": "RuntimeError: Connection closed by peer", "at": 1.5}
    with pytest.raises(RankFailed, match=r"^rank 1 of 3: ValueError: bad reward"):
        outcome(
            _said(tmp_path, r0=after, r1=cause, r2={"outcome": "terminated", "at": 2}),
            3,
            "the launcher exited with 1",
            CTX,
        )


def test_ranks_all_terminated_died(tmp_path: Path) -> None:
    gone = {"outcome": "terminated", "at": 1}
    with pytest.raises(RankDied, match="terminated"):
        outcome(_said(tmp_path, r0=gone, r1=gone), 2, "the launcher exited with -15", CTX)


def test_an_attempt_ended_on_a_rank_ends_it_for_the_run(tmp_path: Path) -> None:
    gone = {"outcome": "attempt-ended", "error": "vLLM server x: refused", "due_now": False}
    after = {"outcome": "error", "error": "RuntimeError: Connection closed by peer", "at": 9}
    with pytest.raises(AttemptEnded, match="rank 1 of 2: vLLM server x") as caught:
        outcome(
            _said(tmp_path, r0=after, r1={**gone, "at": 3}), 2, "the launcher exited with 1", CTX
        )
    assert caught.value.due_now is False


def test_a_machine_gone_ends_the_attempt_whatever_the_ranks_said(tmp_path: Path) -> None:
    """A Ray node gone: its ranks stopped on their own ("lost": their actor was gone), rank 0
    with it. That is not a lost lease of the worker's: the attempt ends and the run resumes."""
    lost = {"outcome": "lost", "at": 1}
    gone = "Ray node b 10.0.0.2 (machine rank 1) is gone: ActorDiedError"
    with pytest.raises(RankDied, match=r"^Ray node b .* is gone: ActorDiedError \(exits\)$"):
        outcome(_said(tmp_path, r0=lost, r1=lost), 2, "exits", CTX, gone=gone)
    done = {"outcome": "completed", "final": "/artifacts/run/final/m", "at": 1}
    assert outcome(_said(tmp_path, r0=done), 2, "exits", CTX, gone=gone).name == "m"
