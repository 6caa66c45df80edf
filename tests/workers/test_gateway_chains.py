"""A gateway episode whose calls do not make one sequence (its harness edited its history) is
trained as one sample per chain of calls, every chain with the episode's advantage: the
stitching of stored calls into chains, and TRL's batch with the earlier chains in it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

from app.gateway.samples import Sample, StoredCall, stitch


def call(prompt: list[int], completion: list[int]) -> StoredCall:
    return StoredCall(prompt, completion, [-0.5] * len(completion))


def test_calls_that_continue_each_other_are_one_sample() -> None:
    (sample,) = stitch([call([1, 2], [3, 4]), call([1, 2, 3, 4, 9, 9], [5])])
    assert sample.prompt_ids == [1, 2]
    assert sample.completion_ids == [3, 4, 9, 9, 5]
    assert sample.env_mask == [1, 1, 0, 0, 1]
    assert sample.logprobs == [-0.5, -0.5, 0.0, 0.0, -0.5]
    assert sample.calls == 2


def test_an_edited_history_splits_the_episode_into_chains_each_a_sample() -> None:
    first = call([1, 2], [3])
    edited = call([1, 7, 8], [4])  # the harness rewrote what came before
    goes_on = call([1, 7, 8, 4, 9], [5])
    chains = stitch([first, edited, goes_on])
    assert [(c.prompt_ids, c.completion_ids, c.env_mask, c.calls) for c in chains] == [
        ([1, 2], [3], [1], 1),
        ([1, 7, 8], [4, 9, 5], [1, 0, 1], 2),
    ]


def test_a_retried_call_replaces_the_call_it_retries() -> None:
    # The same prompt asked again: the harness went on with the second answer only.
    chains = stitch([call([1, 2], [3]), call([1, 2], [4]), call([1, 2, 4, 6], [5])])
    assert [(c.completion_ids, c.calls) for c in chains] == [([4, 6, 5], 2)]


@pytest.fixture
def trainer(tiny_model: Path, tmp_path: Path) -> Any:
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    from datasets import Dataset
    from trl import GRPOConfig

    from workers.pipeline.hooks import GatewayTrainer

    # Two groups of two rollouts, split into two micro-batches. Row 0's episode was split:
    # an earlier chain of its calls comes with it.
    earlier = Sample([5, 6, 7], [8, 9, 10, 11], [-1.0, -1.0, 0.0, -1.0], [1, 1, 0, 1], 2)

    def rollouts(prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        n = len(prompts)
        return {
            "prompt_ids": [[3 + i, 4] for i in range(n)],
            "completion_ids": [[12 + i, 2] for i in range(n)],
            "logprobs": [[-1.0, -1.0] for _ in range(n)],
            "env_mask": [[1, 1] for _ in range(n)],
            "earlier_chains": [[earlier] if i == 0 else [] for i in range(n)],
        }

    def reward(completions: list[Any], **_: Any) -> list[float]:
        return [1.0, 0.0, 0.0, 1.0][: len(completions)]

    config = GRPOConfig(
        output_dir=str(tmp_path / "out"),
        max_steps=1,
        num_generations=2,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        steps_per_generation=2,
        shuffle_dataset=False,
        max_completion_length=8,
        beta=0.04,
        bf16=False,
        dataloader_pin_memory=False,  # no accelerator here
        report_to=[],
        seed=0,
    )
    dataset = Dataset.from_list([{"prompt": f"p{i // 2}"} for i in range(4)])
    built = GatewayTrainer(
        model=str(tiny_model),
        reward_funcs=[reward],
        args=config,
        train_dataset=dataset,
        rollout_func=rollouts,
    )
    built.earlier = earlier
    return built


def test_an_earlier_chain_is_a_row_of_its_own_with_its_episodes_advantage(trainer: Any) -> None:
    trainer.model.train()
    batch = trainer._generate_and_score_completions([{"prompt": f"p{i // 2}"} for i in range(4)])
    earlier = trainer.earlier
    # Four rollouts, the earlier chain, and an empty row so the batch splits in two.
    assert batch["completion_ids"].shape[0] == 6
    advantages = batch["advantages"].tolist()
    assert advantages[4] == advantages[0] != 0
    assert advantages[5] == 0
    n = len(earlier.completion_ids)
    assert batch["completion_ids"][4, :n].tolist() == earlier.completion_ids
    assert batch["prompt_ids"][4, -len(earlier.prompt_ids) :].tolist() == earlier.prompt_ids
    assert batch["tool_mask"][4, :n].tolist() == earlier.env_mask
    trained = batch["completion_mask"] * batch["tool_mask"]
    assert trained[4].sum().item() == earlier.trained_tokens and trained[5].sum().item() == 0
    # The loss is normalised over every trained token, the earlier chain's included.
    assert batch["num_items_in_batch"].item() == 4 * 2 + earlier.trained_tokens
    # Scored against the policy's reference like any row (beta > 0).
    assert torch.isfinite(batch["ref_per_token_logps"][4, :n]).all()


def test_a_step_trains_on_every_row(trainer: Any) -> None:
    trainer.train()
    rows = [chunk["completion_ids"].shape[0] for chunk in trainer._buffered_inputs]
    assert rows == [3, 3]  # none of the six left out of the micro-batches
