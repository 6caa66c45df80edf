"""The warm-up resumes only from a checkpoint that was written to the end."""

from __future__ import annotations

import json
from pathlib import Path

from workers.pipeline.sft import last_complete_checkpoint


def _checkpoint(staging: Path, step: int, state: str | None) -> Path:
    path = staging / f"checkpoint-{step}"
    path.mkdir(parents=True)
    (path / "model.safetensors").write_bytes(b"weights")
    if state is not None:
        (path / "trainer_state.json").write_text(state)
    return path


def test_half_written_checkpoints_are_removed_and_the_last_whole_one_taken(
    tmp_path: Path,
) -> None:
    whole = _checkpoint(tmp_path, 3, json.dumps({"global_step": 3}))
    older = _checkpoint(tmp_path, 2, json.dumps({"global_step": 2}))
    no_state = _checkpoint(tmp_path, 6, None)  # killed before the trainer state
    cut = _checkpoint(tmp_path, 9, '{"global_st')  # killed while writing it
    (tmp_path / "checkpoint-final").mkdir()  # not the trainer's: left alone
    assert last_complete_checkpoint(tmp_path) == str(whole)
    assert not no_state.exists() and not cut.exists()
    assert older.exists() and (tmp_path / "checkpoint-final").exists()


def test_no_checkpoint_means_a_fresh_warm_up(tmp_path: Path) -> None:
    assert last_complete_checkpoint(tmp_path) is None
    _checkpoint(tmp_path, 1, None)
    assert last_complete_checkpoint(tmp_path) is None
    assert list(tmp_path.iterdir()) == []
