"""The step plan: which inputs each GRPO step trains on.

Train inputs are shuffled once per epoch with a seed derived from the run's seed and the
epoch, then taken ``groups_per_step`` at a time (the reference's TrainingInputBatch: step,
epoch, epoch_step, items). ``max_steps``, when given, sets the number of steps whatever
``num_epochs`` says, as in TRL. The plan is a pure function of the inputs and the settings,
so a resumed run continues at exactly the input it would have reached.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class PlannedInput:
    id: str
    index: int
    input_text: str
    context: dict[str, Any] | None


@dataclass(frozen=True)
class InputBatch:
    step: int
    epoch: int
    epoch_step: int
    items: tuple[PlannedInput, ...]


def prompt_messages(system_prompt: str | None, input_text: str) -> list[dict[str, str]]:
    """The chat an input is asked as: the run's system prompt, then the input."""
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*messages, {"role": "user", "content": input_text}]


def dataset_rows(system_prompt: str | None, items: list[PlannedInput]) -> list[dict[str, Any]]:
    """The rows of TRL's dataset for ``items``: the chat each is asked as, its id, its
    context (JSON text)."""
    return [
        {
            "prompt": prompt_messages(system_prompt, item.input_text),
            "input_id": item.id,
            "context": json.dumps(item.context),
        }
        for item in items
    ]


def steps_per_epoch(n_train: int, groups_per_step: int) -> int:
    return math.ceil(n_train / groups_per_step) if n_train else 0


def total_steps(n_train: int, groups_per_step: int, num_epochs: int, max_steps: int | None) -> int:
    """As in TRL: ``max_steps``, when given, is the number of steps (it overrides
    ``num_epochs``; the inputs are gone through again as often as needed); otherwise
    ``num_epochs`` passes over the train inputs."""
    if not n_train:
        return 0
    if max_steps:
        return max_steps
    return steps_per_epoch(n_train, groups_per_step) * num_epochs


def build_plan(
    inputs: list[PlannedInput],
    *,
    groups_per_step: int,
    num_epochs: int,
    max_steps: int | None,
    seed: int,
) -> list[InputBatch]:
    """Every step's batch. The last batch of an epoch is topped up from the start of the
    same epoch's order, so every step has exactly ``groups_per_step`` groups."""
    ordered = sorted(inputs, key=lambda i: i.index)
    if not ordered:
        return []
    per_epoch = steps_per_epoch(len(ordered), groups_per_step)
    n_steps = total_steps(len(ordered), groups_per_step, num_epochs, max_steps)
    plan: list[InputBatch] = []
    epoch = 0
    while len(plan) < n_steps:
        order = ordered[:]
        random.Random(f"{seed}:{epoch}").shuffle(order)
        padded = order + order[: per_epoch * groups_per_step - len(order)]
        for epoch_step in range(per_epoch):
            if len(plan) == n_steps:
                break
            items = tuple(padded[epoch_step * groups_per_step : (epoch_step + 1) * groups_per_step])
            plan.append(InputBatch(len(plan), epoch, epoch_step, items))
        epoch += 1
    return plan
