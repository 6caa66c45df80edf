"""Trajectories as training records: RL records with group-relative advantages, and a
Hugging Face ``datasets.Dataset`` built batch by batch from the database."""

from __future__ import annotations

import math
import uuid
from collections import defaultdict
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any, Unpack

from app.training_data.library import TrajectoryFilters, iter_trajectories
from app.training_data.records import TrainingTrajectory

if TYPE_CHECKING:
    from datasets import Dataset  # type: ignore[import-untyped]

EPSILON = 1e-4  # TRL's GRPO: advantage = (reward - group mean) / (group std + 1e-4)


def advantage(reward: float, mean: float, std: float, *, scale: bool = True) -> float:
    centred = reward - mean
    return centred / (std + EPSILON) if scale else centred


def rl_record(t: TrainingTrajectory, mean: float, std: float, *, scale: bool) -> dict[str, Any]:
    """One rollout in TRL's conversational prompt/completion form. The completion is the
    whole episode (tool calls and their results kept, as TRL's tool loop trains on them): a
    single turn is ``[{"role": "assistant", "content": ...}]`` as before."""
    assert t.reward is not None
    return {
        "prompt": t.prompt,
        "completion": t.episode or [{"role": "assistant", "content": ""}],
        "reward": t.reward,
        "advantage": advantage(t.reward, mean, std, scale=scale),
        "trajectory_id": str(t.id),
        "run_id": str(t.run_id),
        "learning_key": t.learning_key,
        "step": t.step,
        "group_index": t.group_index,
        "rollout_index": t.rollout_index,
    }


def to_rl_records(
    trajectories: Iterable[TrainingTrajectory], *, scale_rewards: bool = True
) -> list[dict[str, Any]]:
    """RL training records (the reference's ``sessions_to_rl_records``): prompt messages,
    completion messages (an agent's whole episode), reward and the group-relative advantage,
    as GRPO computes it.

    The group's mean and std come from the database when the trajectories were loaded with
    ``include_group_stats=True`` (the whole group, whatever the filters kept); otherwise from
    the trajectories given, grouped by (run, step, group). Unscored rollouts are skipped.
    """
    scored = [t for t in trajectories if t.reward is not None]
    stats: dict[tuple[uuid.UUID, int, int], tuple[float, float]] = {}
    missing: defaultdict[tuple[uuid.UUID, int, int], list[float]] = defaultdict(list)
    for t in scored:
        if t.group_reward_mean is not None:
            stats[t.group_key] = (t.group_reward_mean, t.group_reward_std or 0.0)
        else:
            missing[t.group_key].append(t.reward)  # type: ignore[arg-type]
    for key, rewards in missing.items():
        mean = sum(rewards) / len(rewards)
        stats[key] = (mean, math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)))
    return [rl_record(t, *stats[t.group_key], scale=scale_rewards) for t in scored]


def _rl_rows(
    db_url: str | None, batch_size: int, scale_rewards: bool, filters: dict[str, Any]
) -> Iterator[dict[str, Any]]:
    for t in iter_trajectories(
        db_url, batch_size=batch_size, include_metadata=False, include_group_stats=True, **filters
    ):
        if t.reward is not None:
            assert t.group_reward_mean is not None
            yield rl_record(t, t.group_reward_mean, t.group_reward_std or 0.0, scale=scale_rewards)


def to_hf_dataset(
    db_url: str | None = None,
    *,
    batch_size: int = 500,
    scale_rewards: bool = True,
    cache_dir: str | None = None,
    **filters: Unpack[TrajectoryFilters],
) -> Dataset:
    """The matching scored trajectories as a ``datasets.Dataset`` of RL records, streamed from
    PostgreSQL ``batch_size`` rows at a time into Arrow (``Dataset.from_generator``): memory
    holds one batch, not the result.

    Each call reads the database afresh (a new fingerprint), never a stale cache of an
    earlier call with the same filters."""
    from datasets import Dataset

    return Dataset.from_generator(
        _rl_rows,
        gen_kwargs={
            "db_url": db_url,
            "batch_size": batch_size,
            "scale_rewards": scale_rewards,
            "filters": dict(filters),
        },
        cache_dir=cache_dir,
        fingerprint=uuid.uuid4().hex,
    )
