"""One GRPO step as Trainyard sees it from inside TRL: :class:`StepBridge` is the run's
reward function. TRL hands it a step's rollouts; it stores them and moves the run to
``scoring`` in one fenced statement, scores the groups, stores the rewards and moves the
run to ``training`` in another (:mod:`app.runs.lifecycle.step_moves`), then hands TRL the rewards.
:class:`~workers.pipeline.callback.RunCallback` reads its :class:`StepStats` at the step's
end. Below both the training loop and the callback, so neither imports the other.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from app.runs.lifecycle import step_moves
from app.runs.spec.parsed import RunSpec
from workers.context import RunContext
from workers.pipeline import episodes
from workers.pipeline.world import Ranks
from workers.pipeline.writes import WriteBehind
from workers.rewards import Group, Rollout, Score, Scorer
from workers.rewards.functions import EvalMetrics

log = logging.getLogger(__name__)


class EveryGroupDropped(RuntimeError):
    def __init__(self, steps: int, reason: str) -> None:
        super().__init__(
            f"every group of the last {steps} steps was dropped, so nothing was trained on "
            f"(grpo.max_dropped_steps); the last reason: {reason}"
        )


def _drop_reason(score: Score) -> str:
    """What a dropped rollout's breakdown says went wrong: its judge's or its episode's error."""
    for value in score.breakdown.values():
        if isinstance(value, dict) and value.get("error"):
            return str(value["error"])
        if isinstance(value, str) and value:
            return value
    return "no reward (the scorer gave none)"


def reward_components(scores: Iterable[Score]) -> dict[str, list[float]]:
    """Each reward part's values over the step's scored rollouts, by metric name:
    ``reward/<function>``, ``reward/ruler``, ``reward/rim/<judge>`` (the judge's adjusted
    score). Dropped rollouts (no reward) are left out, as they are of the reward itself."""
    parts: dict[str, list[float]] = {}
    for score in scores:
        if score.reward is None:
            continue
        found: dict[str, Any] = {}
        breakdown = score.breakdown
        for name, value in (breakdown.get("functions") or {}).items():
            found[f"reward/{name}"] = value
        ruler = breakdown.get("ruler")
        if isinstance(ruler, dict) and "score" in ruler:
            found["reward/ruler"] = ruler["score"]
        rim = breakdown.get("rim")
        if isinstance(rim, dict):
            for judge, value in (rim.get("adjusted") or {}).items():
                found[f"reward/rim/{judge}"] = value
        for name, value in found.items():
            if isinstance(value, int | float) and math.isfinite(value):
                parts.setdefault(name, []).append(float(value))
    return parts


class Batch(NamedTuple):
    """The rollouts the reward function is handed, one list entry each."""

    prompts: list[list[dict[str, str]]]
    texts: list[str]
    tokens: list[int]  # completion tokens
    input_id: list[str]
    context: list[str]


@dataclass
class StepStats:
    rewards: list[float] = field(default_factory=list)
    components: dict[str, list[float]] = field(default_factory=dict)
    dropped_groups: int = 0
    completion_tokens: int = 0
    started: float = 0.0


def build_groups(
    batch: Batch,
    group_size: int,
    episodes: list[episodes.Episode] | None = None,
    environments: list[Any] | None = None,
) -> list[Group]:
    """The batch's rollouts as the scorer takes them: consecutive groups of ``group_size``,
    each one input's."""
    prompts, texts, _, input_id, context = batch
    g = group_size
    if len(texts) % g:
        raise RuntimeError(f"{len(texts)} completions do not split into groups of {g}")
    groups = []
    for gi in range(len(texts) // g):
        part = slice(gi * g, (gi + 1) * g)
        if len(set(input_id[part])) != 1:
            raise RuntimeError("a group mixes inputs: TRL's sampler order is not the plan's")
        first = gi * g
        groups.append(
            Group(
                index=gi,
                input_text=prompts[first][-1]["content"],
                context=json.loads(context[first]),
                rollouts=[
                    Rollout(prompts[i], texts[i])
                    if episodes is None or environments is None
                    else Rollout(prompts[i], texts[i], episodes[i].messages, environments[i])
                    for i in range(first, first + g)
                ],
            )
        )
    return groups


class StepBridge:
    """TRL's reward function: persists, scores and moves the run through its statuses."""

    __name__ = "trainyard"  # TRL names reward functions in its logs

    def __init__(
        self, ctx: RunContext, spec: RunSpec, scorer: Scorer, ranks: Ranks | None = None
    ) -> None:
        self.ctx = ctx
        self.spec = spec
        self.scorer = scorer
        self.engine = spec.grpo.engine
        self.ranks = ranks or Ranks()
        self.group_size = spec.rollouts_per_group
        self.trainer: Any = None
        # An asynchronous run's producer scores the steps ahead while this thread evaluates.
        self.scoring = threading.Lock()
        self.stats = StepStats()
        self.writes = WriteBehind(ctx.runtime)
        self.dropped_in_a_row = 0  # steps whose every group was dropped, up to this one
        self.max_dropped_steps = spec.grpo.max_dropped_steps
        self.eval_metrics = (
            EvalMetrics([m.model_dump() for m in spec.grpo.eval_metrics])
            if spec.grpo.eval_metrics
            else None
        )

    def __call__(
        self,
        prompts: list[list[dict[str, str]]],
        completions: list[Any],
        completion_ids: list[list[int]],
        input_id: list[str],
        context: list[str],
        trainer_state: Any,
        environments: list[Any] | None = None,
        log_metric: Any = None,
        gateway: list[dict[str, Any]] | None = None,
        policy_version: list[int] | None = None,
        scored_ahead: list[dict[str, Any]] | None = None,
        **_: Any,
    ) -> list[float | None]:
        # Cancelled while generating: the generation was cut short; store none of it.
        self.ranks.check(self.ctx, pause_ok=False)
        if gateway is not None:  # a gateway run: each rollout an episode a harness played
            episodes, environments = self._gateway_episodes(gateway)
            if log_metric is not None:
                from workers.gateway.rollouts import step_metrics

                for name, value in step_metrics(gateway).items():
                    log_metric(name, value)
        else:
            episodes = self._episodes(completions, environments)
        if episodes is None:
            texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        else:
            texts = [e.final for e in episodes]
        local = len(texts)
        batch = Batch(prompts, texts, [len(ids) for ids in completion_ids], input_id, context)
        if self.ranks.world > 1:
            # Each rank holds its share of the step's rollouts, in the global batch's order;
            # a group may span ranks. Rank 0 scores them all and stores them, once.
            every = self.ranks.gather(list(zip(*batch, strict=True)))
            batch = Batch(*(list(column) for column in zip(*every, strict=True)))
        evaluating = self.trainer is not None and not self.trainer.model.training
        step = trainer_state.global_step + 1
        # An asynchronous run's rollouts say which adapter sampled them, and come scored
        # (one process).
        ahead = self._ahead(scored_ahead, texts) if scored_ahead and not evaluating else None
        rewards: list[float | None] = self.ranks.on_rank_zero(
            lambda: self._score(
                batch, episodes, environments, step, evaluating, log_metric, ahead, policy_version
            )
        )
        start = self.ranks.rank * local
        return rewards[start : start + local]

    def _score(
        self,
        batch: Batch,
        episodes: list[episodes.Episode] | None,
        environments: list[Any] | None,
        step: int,
        evaluating: bool,
        log_metric: Any,
        ahead: list[list[Score]] | None = None,
        versions: list[int] | None = None,
    ) -> list[float | None]:
        """Score the step's groups (unless they come scored: ``ahead``) and store them (rank
        0: the whole batch); the rewards."""
        prompts, texts, tokens, input_id, _ = batch
        g = self.group_size
        groups = build_groups(batch, g, episodes, environments)
        if hasattr(self.scorer, "completion_tokens"):
            # A scorer that prices the policy's tokens (a teacher run's) gets their counts,
            # in the groups' order: a decoded text does not always re-encode to as many.
            self.scorer.completion_tokens = list(tokens)
        if evaluating:
            # Evaluation: score only; nothing is stored as training data.
            evaluated = self.score(groups)
            self._log_scorer_metrics(log_metric)
            if self.eval_metrics is not None and log_metric is not None:
                # TRL logs them with its eval_ prefix: the series eval_metric/<label>.
                for label, value in self.eval_metrics.averages(groups).items():
                    log_metric(f"metric/{label}", value)
            return [s.reward for row in evaluated for s in row]

        self.ctx.check(pause_ok=False)
        rollouts = [
            {
                "group_index": i // g,
                "rollout_index": i % g,
                "task_input_id": uuid.UUID(input_id[i]),
                "messages": [*prompts[i], *groups[i // g].rollouts[i % g].response],
                "metadata": {
                    "engine": self.engine,
                    "completion_tokens": tokens[i],
                    **(episodes[i].metadata if episodes is not None else {}),
                    **({"policy_version": versions[i]} if versions else {}),
                },
            }
            for i in range(len(texts))
        ]
        # A judge takes seconds: the rollouts are stored (and the run shows "scoring") while
        # it works. Reward functions take microseconds: one transaction stores both.
        instant = ahead is not None or getattr(self.scorer, "instant", False)
        if not instant:
            self.writes.submit(lambda: self._store_rollouts(step, rollouts))

        scores = ahead if ahead is not None else self.score(groups)
        self._log_scorer_metrics(log_metric)
        if episodes is not None:
            # An episode whose environment failed under it (its MCP server gone) is not the
            # policy's doing: it is recorded with the reason and not trained on.
            scores = [
                [
                    Score(None, {"episode_error": episodes[gi * g + ri].failure})
                    if episodes[gi * g + ri].failure
                    else s
                    for ri, s in enumerate(row)
                ]
                for gi, row in enumerate(scores)
            ]
        rewards = [s.reward for row in scores for s in row]
        self.stats.rewards = [r for r in rewards if r is not None]
        self.stats.components = reward_components(s for row in scores for s in row)
        self.stats.dropped_groups = sum(1 for row in scores if all(s.reward is None for s in row))
        self.stats.completion_tokens = sum(tokens)
        rows = [
            {"group_index": gi, "rollout_index": ri, "reward": s.reward, "breakdown": s.breakdown}
            for gi, row in enumerate(scores)
            for ri, s in enumerate(row)
        ]
        if instant:
            scored = [{**r, **row} for r, row in zip(rollouts, rows, strict=True)]
            self.writes.submit(lambda: self._store_scored_rollouts(step, scored))
        else:
            self.writes.submit(lambda: self._store_rewards(step, rows))
        self._count_dropped(scores)
        self.ctx.check(pause_ok=False)
        return rewards

    def score(self, groups: list[Group]) -> list[list[Score]]:
        """The scorer's scores of ``groups``, one caller at a time."""
        with self.scoring:
            return self.scorer.score(groups)

    def _ahead(self, scored: list[dict[str, Any]], texts: list[str]) -> list[list[Score]] | None:
        """Scores an asynchronous run's producer gave the step's rollouts, by group; None
        (score them now) if it scored other texts than TRL decoded (it decodes as TRL does)."""
        if [s["text"] for s in scored] != texts:
            log.warning(
                "run %s: the rollouts scored ahead decode to other texts than TRL's; "
                "scoring them again",
                self.ctx.run_id,
            )
            return None
        g = self.group_size
        flat = [Score(s["reward"], s["breakdown"]) for s in scored]
        return [flat[i : i + g] for i in range(0, len(flat), g)]

    def _log_scorer_metrics(self, log_metric: Any) -> None:
        """A scorer's own metrics of the groups it just scored (a teacher run's
        ``teacher/...``), logged with the step's (TRL's ``log_metric``)."""
        if log_metric is not None:
            for name, value in getattr(self.scorer, "step_metrics", {}).items():
                log_metric(name, value)

    def _count_dropped(self, scores: list[list[Score]]) -> None:
        """Fail the run once every group of ``max_dropped_steps`` steps in a row was dropped,
        with the reason the last step's first group gave."""
        if self.stats.dropped_groups < len(scores):
            self.dropped_in_a_row = 0
            return
        self.dropped_in_a_row += 1
        if self.dropped_in_a_row >= self.max_dropped_steps:
            raise EveryGroupDropped(self.dropped_in_a_row, _drop_reason(scores[0][0]))

    def _episodes(
        self, completions: list[Any], environments: list[Any] | None
    ) -> list[episodes.Episode] | None:
        """Each rollout's episode when the run has an environment (TRL's tool loop ran)."""
        if environments is None:
            return None
        masks = getattr(self.trainer, "last_tool_mask", None) or [None] * len(completions)
        return [
            episodes.build(c, env.records, mask, env.failure)
            for c, env, mask in zip(completions, environments, masks, strict=True)
        ]

    @staticmethod
    def _gateway_episodes(
        gateway: list[dict[str, Any]],
    ) -> tuple[list[episodes.Episode], list[Any]]:
        """A gateway run's episodes as stored, and what its ``environment`` reward reads
        (the harness's reward), from what its rollout function returned."""
        from workers.gateway.rollouts import HarnessOutcome

        return (
            [
                episodes.Episode(g["messages"], g["final"], g["metadata"], g["failure"])
                for g in gateway
            ],
            [HarnessOutcome(g["reward"], g["failure"]) for g in gateway],
        )

    # Each write commits its data with the phase change, fenced on the lease: one statement
    # each (app.runs.lifecycle.step_moves), since the trainer waits on none of them but
    # shares the GIL.
    async def _store_rollouts(self, step: int, rollouts: list[dict[str, Any]]) -> None:
        async with self.ctx.runtime.pg() as conn:
            await step_moves.rollouts_collected(
                conn, self.ctx.run_id, self.ctx.fence, step, rollouts, ttl_seconds=self._ttl
            )

    async def _store_rewards(self, step: int, rows: list[dict[str, Any]]) -> None:
        async with self.ctx.runtime.pg() as conn:
            await step_moves.rewards_scored(
                conn, self.ctx.run_id, self.ctx.fence, step, rows, ttl_seconds=self._ttl
            )

    async def _store_scored_rollouts(self, step: int, scored: list[dict[str, Any]]) -> None:
        """Rollouts with their rewards, and both phase moves, in one statement."""
        async with self.ctx.runtime.pg() as conn:
            await step_moves.rollouts_collected(
                conn,
                self.ctx.run_id,
                self.ctx.fence,
                step,
                scored,
                ttl_seconds=self._ttl,
                scored=True,
            )

    @property
    def _ttl(self) -> float:
        return self.ctx.settings.lease_ttl_seconds
