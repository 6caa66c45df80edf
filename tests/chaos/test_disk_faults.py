"""The artifacts disk fills up while a checkpoint is written (a 1.2 MB tmpfs: the tiny model's
weights fit, its optimizer state does not): no half checkpoint is recorded, the run fails
saying the disk is full, and what it committed before is intact."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from tests.support.runs import events, trajectory_keys, wait_for
from tests.support.workers import letter_rows, letters_run

pytestmark = pytest.mark.chaos


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A filesystem of its own, 1.2 MB (tmpfs; mounting needs root)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root")
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1200k", "tmpfs", str(mount)],
        capture_output=True,
        text=True,
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {made.stderr.strip()}")
    try:
        yield mount
    finally:
        with contextlib.suppress(subprocess.CalledProcessError):
            subprocess.run(["umount", "-l", str(mount)], check=True, capture_output=True)


async def test_a_full_disk_during_a_checkpoint_records_no_checkpoint(
    client: Any,
    tenant: Any,
    sessionmaker: Any,
    start_worker: Any,
    worker_home: dict[str, str],
    tiny_model: Path,
    small_disk: Path,
) -> None:
    from app.checkpoints.models import Checkpoint

    start_worker(
        **worker_home,
        TRAINYARD_ARTIFACTS_DIR=str(small_disk),
        # The first import of torch can hold the GIL for seconds on a busy machine.
        TRAINYARD_LEASE_TTL_SECONDS="10",
    )
    body = letters_run(tiny_model, max_steps=6, grpo={"save_steps": 3})
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=300
    )
    assert done.status == "failed"
    assert "No space left on device" in (done.error or ""), done.error
    assert "checkpoint" in (done.error or "")
    async with sessionmaker() as s:
        saved = await s.scalars(
            select(Checkpoint.step).where(Checkpoint.run_id == uuid.UUID(run["id"]))
        )
        assert list(saved) == []
    # The steps before the checkpoint are kept, each rollout once.
    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(3)
    assert not [e for e in await events(sessionmaker, run["id"]) if e.type == "checkpoint"]
    # Nothing half-written is left to fill the disk for the next run.
    left = [p for p in small_disk.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in left) < 100_000, left
