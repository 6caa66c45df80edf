"""An agent run is the TRL run it says it is: the same ``python`` environment class, whose
tools sometimes raise, trained through the service (a real worker, after its SFT warm-up)
and by a plain TRL script (``GRPOTrainer(environment_factory=...)``, TRL's own
``get_reward`` handling, nothing of Trainyard's), from the same warmed-up model, settings,
seed and inputs in the same order: every rollout of every step, tool errors included, and
every reward are the same.

The plain script is this module run as ``python -m tests.workers.test_trl_parity``, in a
process of its own with the worker's thread count (torch's CPU kernels may sum in another
order on another number of threads). Its ``GRPOConfig`` is written out value by value from
the run as the API stored it, as a user following TRL's documentation would: it must not
borrow the worker's mapping (a mistake there would then hide in both sides). It watches
the rollouts with a reward function of weight 0 (``reward_weights=[0.0]``; TRL adds the
environment's ``get_reward`` after it, with weight 1), which changes no reward: 0 × 0 adds
nothing to the weighted sum.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

from sqlalchemy import select

from app.core.storable import jsonable
from app.inputs.models import TaskInput
from app.trajectories.models import Trajectory
from tests.support import ROOT
from tests.support.runs import wait_for
from tests.support.workers import agent_run

ENVIRONMENT = "tests.support.agent_tools:SmallCalculator"
STEPS = 20
THREADS = {"OMP_NUM_THREADS": "1"}  # the worker's and the script's


def turns(messages: list[dict[str, Any]]) -> list[tuple[str, str, list[Any]]]:
    """An episode as the model saw it: each message's role, text and tool calls (name and
    arguments), as stored (``jsonable``: stored text holds no NUL)."""
    return [
        (
            m["role"],
            jsonable(m.get("content") or ""),
            [
                (c["function"]["name"], jsonable(c["function"].get("arguments")))
                for c in m.get("tool_calls") or []
            ],
        )
        for m in messages
    ]


async def test_a_python_environment_with_failing_tools_trains_as_under_plain_trl(
    client, tenant, sessionmaker, start_worker, tool_model, worker_home, tmp_path
) -> None:
    start_worker(**worker_home, **THREADS)
    body = agent_run(
        tool_model,
        max_steps=STEPS,
        environment={"type": "python", "factory": ENVIRONMENT},
        grpo={"groups_per_step": 2},
    )
    run = (await client.post("/runs", json=body, headers=tenant.headers)).json()
    assert run.get("environment", {}).get("tool_errors") == "trl", run
    done = await wait_for(
        sessionmaker, run["id"], lambda r: r.status in {"completed", "failed"}, within=900
    )
    assert done.status == "completed", done.error

    async with sessionmaker() as s:
        rows = (
            await s.execute(
                select(Trajectory, TaskInput)
                .join(TaskInput, TaskInput.id == Trajectory.task_input_id)
                .where(Trajectory.run_id == uuid.UUID(run["id"]))
                .order_by(Trajectory.step, Trajectory.group_index, Trajectory.rollout_index)
            )
        ).all()
    g = run["rollouts_per_group"]
    assert len(rows) == STEPS * run["grpo"]["groups_per_step"] * g
    # The plan's order, one input per group, as the worker's dataset held it.
    inputs = [
        {"input_text": i.input_text, "context": i.context} for t, i in rows if t.rollout_index == 0
    ]
    service = [
        {
            "step": t.step,
            "turns": turns(t.messages[len(t.messages) - _completion_length(t.messages) :]),
            "reward": t.reward,
        }
        for t, _ in rows
    ]

    spec = tmp_path / "plain.json"
    out = tmp_path / "plain-rollouts.json"
    warmed = Path(worker_home["TRAINYARD_HOME"]) / "artifacts" / run["id"] / "sft" / "model"
    spec.write_text(json.dumps({"run": run, "inputs": inputs, "model": str(warmed)}))
    script = await asyncio.to_thread(
        subprocess.run,
        [sys.executable, "-m", "tests.workers.test_trl_parity", str(spec), str(out)],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", **THREADS},
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert script.returncode == 0, script.stderr[-5000:]
    plain = [
        {"step": r["step"], "turns": turns(r["completion"]), "reward": r["reward"]}
        for r in json.loads(out.read_text())
    ]

    # The tools failed, and the model was shown TRL's text for it.
    errors = [
        content
        for r in service
        for role, content, _ in r["turns"]
        if role == "tool" and content.startswith("{'error': ")
    ]
    assert len(errors) >= STEPS, f"too few failed calls to show anything: {len(errors)}"
    assert "{'error': '5 is too large: this calculator takes numbers up to 4'}" in errors
    assert {r["reward"] for r in service} == {0.0, 1.0}, "both rewards occur, so it learns"

    assert len(plain) == len(service)
    for step in range(1, STEPS + 1):
        mine = [(r["turns"], r["reward"]) for r in service if r["step"] == step]
        theirs = [(r["turns"], r["reward"]) for r in plain if r["step"] == step]
        assert mine == theirs, f"step {step} differs"


def _completion_length(messages: list[dict[str, Any]]) -> int:
    """How many of a stored episode's messages TRL generated: from the first assistant
    message on (before it, the prompt)."""
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return len(messages) - first


# --- the plain TRL script ------------------------------------------------------------------


def plain_trl(spec_file: Path, out_file: Path) -> None:
    """GRPO in the environment with TRL alone, from the service's warmed-up model; writes
    every rollout (its completion as TRL's loop left it) and its reward, by step."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from tests.support.agent_tools import SmallCalculator

    spec = json.loads(spec_file.read_text())
    run, grpo = spec["run"], spec["run"]["grpo"]
    g = run["rollouts_per_group"]
    system = [{"role": "system", "content": run["system_prompt"]}] if run["system_prompt"] else []
    dataset = Dataset.from_list(
        [
            {
                "prompt": [*system, {"role": "user", "content": i["input_text"]}],
                "context": i["context"],
            }
            for i in spec["inputs"]
        ]
    )
    seen: list[dict[str, Any]] = []

    def watch(
        completions: list[Any],
        environments: list[SmallCalculator],
        trainer_state: Any,
        **_: Any,
    ) -> list[float]:
        for completion, environment in zip(completions, environments, strict=True):
            seen.append(
                {
                    "step": trainer_state.global_step + 1,
                    "completion": json.loads(json.dumps(completion)),  # as it was now
                    "reward": environment.get_reward(),
                }
            )
        return [0.0] * len(completions)

    accumulation = grpo["gradient_accumulation_steps"]
    config = GRPOConfig(
        output_dir=str(out_file.parent / "plain-staging"),
        learning_rate=run["learning_rate"],
        max_steps=run["max_steps"],
        num_train_epochs=1,
        num_generations=g,
        per_device_train_batch_size=grpo["groups_per_step"] * g // accumulation,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        shuffle_dataset=False,
        seed=grpo["seed"],
        beta=grpo["beta"],
        loss_type=grpo["loss_type"],
        scale_rewards=grpo["scale_rewards"],
        temperature=grpo["temperature"],
        top_p=grpo["top_p"],
        top_k=grpo.get("top_k") or 0,
        min_p=grpo.get("min_p"),
        repetition_penalty=grpo["repetition_penalty"],
        max_completion_length=grpo["max_completion_length"],
        warmup_steps=grpo["warmup_ratio"],
        weight_decay=grpo["weight_decay"],
        max_grad_norm=grpo["max_grad_norm"],
        gradient_checkpointing=grpo["gradient_checkpointing"],
        bf16=False,
        fp16=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        max_tool_calling_iterations=run["environment"]["max_turns"],
        reward_weights=[0.0],  # watch's; TRL appends get_reward's, weight 1
    )
    trainer = GRPOTrainer(
        model=spec["model"],
        reward_funcs=[watch],
        args=config,
        train_dataset=dataset,
        environment_factory=SmallCalculator,
    )
    trainer.train()
    out_file.write_text(json.dumps(seen))


if __name__ == "__main__":
    plain_trl(Path(sys.argv[1]), Path(sys.argv[2]))
