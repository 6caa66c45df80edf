"""RULER: a group-relative LLM judge.

One judge call per group. The group's rollouts share their prompt, so the shared message
prefix is sent once (as ``<context>``) and only each trajectory's own continuation is
labelled with an id; the judge scores all of them together, which is what makes the scores
comparable within the group (GRPO only uses them relative to each other anyway).

A group whose judge call fails after the retries (transport errors, bad JSON, a wrong count
of scores, unknown or repeated ids) is dropped: every rollout gets reward None and the
reason in its breakdown, and ``dropped_groups`` counts it. The run goes on.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from app.core.settings import Settings
from app.observability import prometheus
from app.runs.spec.rewards import RulerReward
from workers.llm import AnswerRejected, ChatClient, LLMError, LLMUnavailable
from workers.llm.endpoints import resolve_endpoint
from workers.rewards.base import Group, Score
from workers.rewards.transcript import conversation, reference_block, render_messages
from workers.rewards.transcript import shared_prefix as shared_prefix_length

log = logging.getLogger(__name__)

DEFAULT_RUBRIC = """\
- A trajectory that achieves the goal of the task scores higher than one that does not.
- Among trajectories that achieve the goal, the one that does it more correctly, clearly \
and efficiently scores higher.
- Partial progress towards the goal earns partial credit.
- A trajectory that is wrong, off-topic, incoherent or makes things up scores near 0."""

SYSTEM_PROMPT = """\
You are an impartial judge. You are shown several trajectories: attempts by an AI \
assistant at the same task. They all continue the same shared context, shown once.

Score every trajectory from 0 to 1 against the rubric below. Compare the trajectories with \
each other: a better trajectory must score higher than a worse one; equally good ones may \
share a score.

Rubric:
{rubric}

Answer with a JSON object {{"scores": [...]}} holding exactly one entry per trajectory, \
each with the trajectory's id as "trajectory_id", a one- or two-sentence "explanation" \
(written before the score), and the "score"."""


class RulerItem(BaseModel):
    model_config = ConfigDict(extra="ignore")

    trajectory_id: str
    explanation: str = ""
    score: float = Field(ge=0, le=1, allow_inf_nan=False)

    @field_validator("trajectory_id", mode="before")
    @classmethod
    def _id_text(cls, value: Any) -> Any:
        # Small models answer 1 for "1"; an id is an id.
        return str(value).strip() if isinstance(value, str | int) else value


class RulerAnswer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    scores: list[RulerItem]


def answer_schema(ids: list[str]) -> dict[str, Any]:
    """The judge's JSON schema; the ids as an enum, so guided decoding cannot invent one.

    The score has no minimum/maximum: some guided-decoding backends (vLLM with xgrammar
    forced) reject number bounds with a 400; RulerItem checks the range and it is retried.
    """
    item = {
        "type": "object",
        "properties": {
            "trajectory_id": {"type": "string", "enum": ids},
            "explanation": {"type": "string"},
            "score": {"type": "number"},
        },
        "required": ["trajectory_id", "explanation", "score"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {"scores": {"type": "array", "items": item}},
        "required": ["scores"],
        "additionalProperties": False,
    }


def judge_messages(group: Group, rubric: str, ids: list[str]) -> list[dict[str, str]]:
    """The judge's conversation: rubric in the system prompt, prefix once, then each id."""
    convs = [conversation(r) for r in group.rollouts]
    n = shared_prefix_length(convs)
    parts = [f"<context>\n{render_messages(convs[0][:n])}\n</context>"] if n else []
    parts += [
        f'<trajectory id="{tid}">\n{render_messages(conv[n:])}\n</trajectory>'
        for tid, conv in zip(ids, convs, strict=True)
    ]
    user = (
        "\n\n".join(parts)
        + reference_block(group)
        + f"\n\nScore all {len(ids)} trajectories: ids {', '.join(ids)}."
    )
    return [
        {"role": "system", "content": SYSTEM_PROMPT.format(rubric=rubric.strip())},
        {"role": "user", "content": user},
    ]


def check_ids(answer: RulerAnswer, ids: list[str]) -> None:
    """Exactly one score per trajectory, under the ids we gave; else the answer is retried."""
    got = [s.trajectory_id for s in answer.scores]
    if len(got) != len(ids) or set(got) != set(ids):
        raise AnswerRejected(
            f"expected one score for each of the ids {ids}, got {len(got)} scores for {got}"
        )


class RulerScorer:
    """Scores each group with one judge call; groups run concurrently up to max_concurrency."""

    def __init__(
        self,
        spec: dict[str, Any],
        *,
        settings: Settings | None = None,
        backoff_s: float = 0.5,
    ) -> None:
        if settings is None:
            from app.core.settings import get_settings

            settings = get_settings()
        parsed = RulerReward.model_validate(spec)
        self.rubric = parsed.rubric if parsed.rubric and parsed.rubric.strip() else DEFAULT_RUBRIC
        self.temperature = parsed.temperature
        self.endpoint, self.unconfigured = resolve_endpoint(
            parsed.judge.model_dump() if parsed.judge else None, settings, purpose="RULER"
        )
        self.backoff_s = backoff_s
        self.dropped_groups = 0  # over this scorer's life, for logs and tests

    def check(self) -> None:
        if self.endpoint is None:
            raise LLMUnavailable(self.unconfigured or "RULER has no judge endpoint")
        with ChatClient(self.endpoint, backoff_s=self.backoff_s) as client:
            client.check()

    def score(self, groups: list[Group]) -> list[list[Score]]:
        if self.endpoint is None:
            return [self._dropped(g, self.unconfigured or "no judge") for g in groups]
        endpoint = self.endpoint
        with ChatClient(endpoint, backoff_s=self.backoff_s) as client:
            workers = max(1, min(endpoint.max_concurrency, len(groups)))
            with ThreadPoolExecutor(workers, thread_name_prefix="ruler") as pool:
                rows = list(pool.map(lambda g: self._score_group(client, g), groups))
        self.dropped_groups += sum(1 for row in rows if row and row[0].reward is None)
        return rows

    def _score_group(self, client: ChatClient, group: Group) -> list[Score]:
        if not group.rollouts:
            return []
        ids = [str(i + 1) for i in range(len(group.rollouts))]
        try:
            with prometheus.judge_call("ruler"):
                answer = client.structured(
                    judge_messages(group, self.rubric, ids),
                    name="ruler_scores",
                    schema=answer_schema(ids),
                    model=RulerAnswer,
                    temperature=self.temperature,
                    validate=lambda a: check_ids(a, ids),
                )
        except LLMError as exc:
            return self._dropped(group, str(exc))
        except Exception as exc:  # a bug must not kill the run either; it is logged
            log.exception("RULER: unexpected error judging group %s", group.index)
            return self._dropped(group, f"{type(exc).__name__}: {exc}")
        by_id = {s.trajectory_id: s for s in answer.scores}
        model = client.endpoint.model
        return [
            Score(
                by_id[tid].score,
                {
                    "ruler": {
                        "score": by_id[tid].score,
                        "explanation": by_id[tid].explanation,
                        "judge": model,
                    }
                },
            )
            for tid in ids
        ]

    @staticmethod
    def _dropped(group: Group, error: str) -> list[Score]:
        return [Score(None, {"ruler": {"dropped": True, "error": error}}) for _ in group.rollouts]
