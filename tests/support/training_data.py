"""A seeded corpus of runs and trajectories for the training-data tests, shared by
their fixtures and assertions."""

from __future__ import annotations

import random
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker

from app.auth.roles import Role
from app.auth.service import create_key, get_or_create_project
from app.core.pg import connect_kwargs, init_connection
from app.runs.lifecycle.status import RunStatus
from tests.support.runs import create_run

BASE = datetime(2026, 6, 1, tzinfo=UTC)
STEPS, GROUPS, ROLLOUTS = 3, 2, 3

_INSERT = """
INSERT INTO trajectories (id, run_id, project_id, learning_key, step, group_index,
                          rollout_index, messages, reward, reward_breakdown, metadata, created_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
"""


@dataclass
class Corpus:
    db_url: str
    projects: dict[str, uuid.UUID]  # name → id
    keys: dict[str, str]  # name → API key
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)  # label → run facts
    rows: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rows_by_id(self) -> dict[uuid.UUID, dict[str, Any]]:
        return {r["id"]: r for r in self.rows}

    def expected(
        self,
        *,
        min_reward: float | None = None,
        max_reward: float | None = None,
        projects: list[str] | None = None,
        run_ids: list[uuid.UUID] | None = None,
        learning_key: list[str] | None = None,
        statuses: list[str] | None = None,
        start_date: datetime | None = None,
        end_date: datetime | None = None,
        steps: list[int] | range | None = None,
        order: str = "newest",
    ) -> list[uuid.UUID]:
        """The ids the filters should return, in order: the model the SQL is checked by."""
        status_of = {r["id"]: r["status"] for r in self.runs.values()}
        project_ids = {self.projects[p] for p in projects} if projects is not None else None

        def keep(row: dict[str, Any]) -> bool:
            reward = row["reward"]
            return (
                (min_reward is None or (reward is not None and reward >= min_reward))
                and (max_reward is None or (reward is not None and reward <= max_reward))
                and (project_ids is None or row["project_id"] in project_ids)
                and (run_ids is None or row["run_id"] in run_ids)
                and (learning_key is None or row["learning_key"] in learning_key)
                and (statuses is None or status_of[row["run_id"]] in statuses)
                and (start_date is None or row["created_at"] >= start_date)
                and (end_date is None or row["created_at"] <= end_date)
                and (steps is None or row["step"] in steps)
            )

        kept = sorted(
            (r for r in self.rows if keep(r)),
            key=lambda r: (r["created_at"], r["id"]),
            reverse=order == "newest",
        )
        return [r["id"] for r in kept]


async def seed_corpus(
    maker: async_sessionmaker[AsyncSession], db_url: str, *, seed: int = 7
) -> Corpus:
    """Two projects; runs with and without learning keys in several statuses; 18 rollouts
    per run over 3 steps, with known rewards (some unscored) and creation times spread over
    ten days."""
    rng = random.Random(seed)
    tag = uuid.uuid4().hex[:6]
    names = {"a": f"td-a-{tag}", "b": f"td-b-{tag}"}
    corpus = Corpus(db_url=db_url, projects={}, keys={})
    async with maker() as s:
        for label, name in names.items():
            project = await get_or_create_project(s, name)
            _, plain = await create_key(s, project, role=Role.admin)
            corpus.projects[label] = project.id
            corpus.keys[label] = plain
        await s.commit()
    plan = [
        ("a1", "a", f"alpha-{tag}", RunStatus.COMPLETED),
        ("a2", "a", f"alpha-{tag}", RunStatus.FAILED),
        ("a3", "a", f"beta-{tag}", RunStatus.COMPLETED),
        ("a4", "a", None, RunStatus.TRAINING),
        ("b1", "b", f"alpha-{tag}", RunStatus.COMPLETED),
    ]
    for label, project, key, status in plan:
        run = await create_run(
            maker, project_id=corpus.projects[project], status=status, learning_key=key
        )
        corpus.runs[label] = {"id": run.id, "status": status.value, "learning_key": key}

    minute = 0
    for label, project, key, _ in plan:
        for step in range(STEPS):
            for group in range(GROUPS):
                for rollout in range(ROLLOUTS):
                    minute += rng.randint(60, 180)
                    reward = None if rng.random() < 0.1 else round(rng.random(), 3)
                    corpus.rows.append(
                        {
                            "id": uuid.uuid4(),
                            "run_id": corpus.runs[label]["id"],
                            "project_id": corpus.projects[project],
                            "learning_key": key,
                            "step": step,
                            "group_index": group,
                            "rollout_index": rollout,
                            "messages": [
                                {"role": "system", "content": "Answer with a."},
                                {"role": "user", "content": f"input {group} of {label}"},
                                {"role": "assistant", "content": "a" * (rollout + 1)},
                            ],
                            "reward": reward,
                            "reward_breakdown": {"char_fraction": reward},
                            "metadata": {"engine": "transformers"},
                            "created_at": BASE + timedelta(minutes=minute),
                        }
                    )
    conn = await asyncpg.connect(**connect_kwargs(db_url))
    try:
        await init_connection(conn)
        await conn.executemany(_INSERT, [tuple(r.values()) for r in corpus.rows])
    finally:
        await conn.close()
    return corpus
