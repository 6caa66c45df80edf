"""Early stopping on the evaluation reward (``grpo.early_stopping``: transformers'
EarlyStoppingCallback): the run completes at the step it stopped, says why, and with
load_best_model_at_end its final model is the best checkpoint's weights. And an extra
evaluation metric (``grpo.eval_metrics``), recorded at every evaluation."""

from __future__ import annotations

import uuid
from pathlib import Path

from safetensors.torch import load_file
from sqlalchemy import select

from app.checkpoints.models import Checkpoint
from tests.support.runs import events, series, trajectory_keys, wait_for
from tests.support.workers import letter_rows, letters_run

VALIDATION = [{"input_text": t, "split": "validation"} for t in ["Whisper.", "Hum."]]


async def test_a_plateau_stops_the_run_early_keeping_the_best_and_metrics_are_recorded(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home
) -> None:
    start_worker(**worker_home)
    # An improvement counts only above 0.9 (rewards lie in [0, 1]): after the first
    # evaluation sets the best, every one is a plateau, and the second in a row stops it.
    inputs = letters_run(tiny_model)["inputs"] + VALIDATION
    body = letters_run(
        tiny_model,
        max_steps=20,
        inputs=inputs,
        grpo={
            "save_steps": 2,
            "eval_steps": 2,
            "save_total_limit": 1,
            "early_stopping": {"patience": 2, "threshold": 0.9},
            # The reward's own function as a metric: it must read what eval_reward reads;
            # the best checkpoint (and the plateau) by it.
            "eval_metrics": [{"name": "char_fraction", "args": {"char": "a"}, "label": "a"}],
            "metric_for_best_model": "eval_metric/a",
        },
    )
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=300
    )
    assert done.status == "completed", done.error
    assert done.step == 6
    stopped = (done.metrics or {})["stopped_early"]
    evals = await series(sessionmaker, run["id"], "eval_reward")
    assert [step for step, _ in evals] == [0, 2, 4, 6]
    best_step, best = max(evals[1:], key=lambda e: (e[1], -e[0]))
    assert stopped == {
        "step": 6,
        "metric": "eval_metric/a",
        "patience": 2,
        "threshold": 0.9,
        "best_metric": stopped["best_metric"],
        "best_step": best_step,
    }
    assert abs(stopped["best_metric"] - best) < 1e-6
    metric = await series(sessionmaker, run["id"], "eval_metric/a")
    assert [step for step, _ in metric] == [0, 2, 4, 6]
    assert all(abs(m - r) < 1e-6 for (_, m), (_, r) in zip(metric, evals, strict=True))
    # Rollouts of the steps it trained, once; none after it stopped.
    assert await trajectory_keys(sessionmaker, run["id"]) == letter_rows(6)

    said = await events(sessionmaker, run["id"])
    [early_stop] = [e for e in said if e.type == "early_stop"]
    completed = [e for e in said if e.type == "status"][-1]
    async with sessionmaker() as s:
        saved = (
            (await s.execute(select(Checkpoint).where(Checkpoint.run_id == uuid.UUID(run["id"]))))
            .scalars()
            .all()
        )
    assert early_stop.message.startswith(
        "stopped early at step 6 of 20: eval_metric/a rose by no more"
    )
    assert early_stop.data == stopped
    assert "stopped early after 6 of 20 steps" in completed.message
    final = next(c for c in saved if c.is_final)
    assert final.step == 6 and final.metrics["stopped_early"] == stopped
    # The best checkpoint is kept beside the newest (save_total_limit 1 protects it), and
    # its weights are the final model's; the last step's differ.
    resumable = {c.step: c for c in saved if not c.is_final}
    assert set(resumable) == {best_step, 6}
    final_weights = load_file(str(Path(final.path) / "model.safetensors"))

    def same(step: int) -> bool:
        weights = load_file(str(Path(resumable[step].path) / "model.safetensors"))
        assert weights.keys() == final_weights.keys()
        return all(bool((weights[k] == final_weights[k]).all()) for k in weights)

    assert same(best_step)
    if best_step != 6:
        assert not same(6)
