"""Experiment trackers (``grpo.report_to``): a real run on the tiny model writes its reward
series to TensorBoard event files and to a W&B offline run, both under the run's artifacts
(docs/trackers.md); an unknown tracker is refused at ``POST /runs``."""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.runs import series, wait_for
from tests.support.workers import letters_run
from workers.pipeline.trackers import TrackerUnavailable, check_trackers

PROBLEM = "application/problem+json"
DEMO = [{"role": "user", "content": "Sing."}, {"role": "assistant", "content": "aaaa"}]


def wandb_records(path: Path) -> Iterator[Any]:
    """The records of a W&B run file (``run-<id>.wandb``): wandb 0.31 ships no Python
    reader, and offline there is no ``wandb sync``. The file is a LevelDB-style log: a
    7-byte header, then 32 KiB blocks of chunks (crc32, length, kind: full, first, middle,
    last), each record a protobuf ``Record``."""
    from wandb.proto import wandb_internal_pb2

    raw = path.read_bytes()
    assert raw[:4] == b":W&B", raw[:7]
    block, pos, pending = 32768, 7, b""
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a chunk header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        pending += raw[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


async def test_a_run_reports_its_rewards_to_tensorboard_and_wandb_offline(
    client, tenant, sessionmaker, start_worker, tool_model, worker_home
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    start_worker(**worker_home, WANDB_MODE="offline")
    body = letters_run(
        tool_model,  # its chat template is one TRL can train SFT on
        max_steps=5,
        grpo={"report_to": ["tensorboard", "wandb"], "tracker_project": "letters"},
        sft={"examples": [{"messages": DEMO}] * 4, "epochs": 2, "batch_size": 2},
    )
    r = await client.post("/runs", json=body, headers=tenant.headers)
    assert r.status_code == 202, r.text
    run = r.json()
    done = await wait_for(
        sessionmaker, run["id"], lambda x: x.status in {"completed", "failed"}, within=120
    )
    assert done.status == "completed", done.error
    stored = [value for _, value in await series(sessionmaker, run["id"], "reward_mean")]
    assert len(stored) == 5
    root = Path(worker_home["TRAINYARD_HOME"]) / "artifacts" / run["id"]

    events = EventAccumulator(str(root / "tensorboard" / "grpo"))
    events.Reload()
    rewards = events.Scalars("train/reward")
    assert [e.step for e in rewards] == [1, 2, 3, 4, 5]
    assert [e.value for e in rewards] == pytest.approx(stored, abs=1e-5)

    # The warm-up: its loss by SFT step, in a folder and a W&B run of its own.
    sft = EventAccumulator(str(root / "tensorboard" / "sft"))
    sft.Reload()
    assert [e.step for e in sft.Scalars("train/loss")] == [1, 2, 3, 4]

    runs: dict[str, list[Any]] = {}
    for offline in (root / "wandb" / "wandb").glob("offline-run-*"):
        (log,) = offline.glob("run-*.wandb")
        found = list(wandb_records(log))
        (meta,) = [r.run for r in found if r.WhichOneof("record_type") == "run"]
        runs[meta.display_name] = found
    assert sorted(runs) == ["tiny-letters", "tiny-letters-sft"]
    records = runs["tiny-letters"]
    (meta,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert (meta.display_name, meta.project, meta.run_group) == (
        "tiny-letters",
        "letters",
        run["id"],
    )
    config = {
        item.key: json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") in ("run", "config")
        for item in (r.run.config if r.WhichOneof("record_type") == "run" else r.config).update
    }
    assert config["trainyard_run_id"] == run["id"]
    assert config["run_name"] == "tiny-letters"
    history = [
        {
            item.key or "/".join(item.nested_key): json.loads(item.value_json)
            for item in r.history.item
        }
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    logged = [(h["train/global_step"], h["train/reward"]) for h in history if "train/reward" in h]
    assert [step for step, _ in logged] == [1, 2, 3, 4, 5]
    assert [value for _, value in logged] == pytest.approx(stored, abs=1e-5)
    assert any(r.WhichOneof("record_type") == "exit" for r in records)  # finished, not left open


@pytest.mark.parametrize(
    ("report_to", "field"),
    [(["mlflow"], "body.grpo.report_to[0]"), (["wandb", "wandb"], "body.grpo.report_to")],
)
async def test_an_unknown_or_repeated_tracker_is_422(client, tenant, report_to, field) -> None:
    body = letters_run(Path("/models/tiny"), grpo={"report_to": report_to})
    r = await client.post("/runs", json=body, headers=tenant.headers)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == PROBLEM
    assert [e["field"] for e in r.json()["errors"]] == [field], r.text


def test_wandb_without_a_key_online_fails_before_the_first_step(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A worker has no terminal: W&B online without a key would wait on a login prompt."""
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc
    with pytest.raises(TrackerUnavailable, match="no W&B API key"):
        check_trackers(["tensorboard", "wandb"])
    (tmp_path / ".netrc").write_text("machine api.wandb.ai login user password k\n")
    (tmp_path / ".netrc").chmod(0o600)
    check_trackers(["wandb"])
    (tmp_path / ".netrc").unlink()
    monkeypatch.setenv("WANDB_MODE", "offline")
    check_trackers(["tensorboard", "wandb"])
