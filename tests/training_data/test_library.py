"""The library's filters, counts, lookups and pagination against the corpus's Python model."""

from __future__ import annotations

import asyncio
import uuid
from datetime import timedelta
from typing import Any

import asyncpg
import pytest

from app import training_data as td
from app.core.pg import connect_kwargs, init_connection
from tests.support.training_data import BASE, Corpus


def _filters(corpus: Corpus, name: str) -> dict[str, Any]:
    """Named filter sets; each maps onto both the library call and the Python model."""
    runs = corpus.runs
    alpha = runs["a1"]["learning_key"]
    return {
        "min_reward": {"min_reward": 0.5},
        "max_reward": {"max_reward": 0.25},
        "reward_band": {"min_reward": 0.2, "max_reward": 0.6},
        "project": {"projects": ["a"]},
        "project_b": {"projects": ["b"]},
        "both_projects": {"projects": ["a", "b"]},
        "one_run": {"run_ids": [runs["a3"]["id"]]},
        "two_runs": {"run_ids": [runs["a1"]["id"], runs["b1"]["id"]]},
        "learning_key": {"learning_key": [alpha]},
        "two_keys": {"learning_key": [alpha, runs["a3"]["learning_key"]]},
        "completed": {"statuses": ["completed"]},
        "failed_or_training": {"statuses": ["failed", "training"]},
        "since": {"start_date": BASE + timedelta(days=4)},
        "until": {"end_date": BASE + timedelta(days=3)},
        "window": {"start_date": BASE + timedelta(days=2), "end_date": BASE + timedelta(days=6)},
        "step": {"steps": [1]},
        "steps_range": {"steps": range(1, 3)},
        "main_shape": {
            "min_reward": 0.3,
            "projects": ["a"],
            "start_date": BASE + timedelta(days=1),
            "end_date": BASE + timedelta(days=8),
        },
        "everything": {
            "min_reward": 0.1,
            "max_reward": 0.95,
            "projects": ["a", "b"],
            "learning_key": [alpha],
            "statuses": ["completed"],
            "start_date": BASE,
            "end_date": BASE + timedelta(days=30),
            "steps": [0, 2],
        },
        "nothing": {"projects": ["b"], "learning_key": [runs["a3"]["learning_key"]]},
    }[name]


def _library_args(corpus: Corpus, filters: dict[str, Any]) -> dict[str, Any]:
    args = dict(filters)
    if "projects" in args:
        args["projects"] = [str(corpus.projects[p]) for p in args["projects"]]
    return args


FILTER_NAMES = [
    "min_reward",
    "max_reward",
    "reward_band",
    "project",
    "project_b",
    "both_projects",
    "one_run",
    "two_runs",
    "learning_key",
    "two_keys",
    "completed",
    "failed_or_training",
    "since",
    "until",
    "window",
    "step",
    "steps_range",
    "main_shape",
    "everything",
    "nothing",
]


@pytest.mark.parametrize("name", FILTER_NAMES)
@pytest.mark.parametrize("order", ["newest", "oldest"])
async def test_each_filter_matches_the_model(corpus: Corpus, name: str, order: str) -> None:
    filters = _filters(corpus, name)
    # Limited to the corpus's own projects: the session database holds other tests' rows.
    scoped = {"projects": ["a", "b"], **filters}
    expected = corpus.expected(order=order, **scoped)
    args = _library_args(corpus, scoped)
    got = await td.get_training_trajectories_async(corpus.db_url, order=order, **args)
    assert [t.id for t in got] == expected
    assert await td.count_training_trajectories_async(corpus.db_url, **args) == len(expected)
    if name == "nothing":
        assert expected == []
    else:
        assert expected, f"filter {name} should match something in the corpus"


async def test_projects_by_name_and_unknown_project(corpus: Corpus) -> None:
    names = {label: await _project_name(corpus, pid) for label, pid in corpus.projects.items()}
    by_name = await td.count_training_trajectories_async(corpus.db_url, projects=names["a"])
    assert by_name == len(corpus.expected(projects=["a"]))
    with pytest.raises(td.TrainingDataError) as err:
        await td.count_training_trajectories_async(corpus.db_url, projects=["no-such-project"])
    assert err.value.field == "projects"


async def _project_name(corpus: Corpus, project_id: uuid.UUID) -> str:
    conn = await asyncpg.connect(**connect_kwargs(corpus.db_url))
    try:
        return str(await conn.fetchval("SELECT name FROM projects WHERE id = $1", project_id))
    finally:
        await conn.close()


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"min_reward": 0.9, "max_reward": 0.1}, "min_reward"),
        ({"min_reward": float("nan")}, "min_reward"),
        ({"max_reward": "high"}, "max_reward"),
        ({"run_ids": ["not-a-uuid"]}, "run_ids"),
        ({"run_ids": []}, "run_ids"),
        ({"statuses": ["done"]}, "statuses"),
        ({"steps": [-1]}, "steps"),
        ({"steps": range(5, 2)}, "steps"),
        ({"learning_key": [""]}, "learning_key"),
        ({"learning_key": ["x" * 201]}, "learning_key"),
        ({"start_date": "yesterday"}, "start_date"),
        ({"start_date": BASE, "end_date": BASE - timedelta(days=1)}, "start_date"),
        ({"limit": 0}, "limit"),
        ({"order": "random"}, "order"),
    ],
)
async def test_bad_arguments_name_the_argument(
    corpus: Corpus, args: dict[str, Any], field: str
) -> None:
    with pytest.raises(td.TrainingDataError) as err:
        await td.get_training_trajectories_async(corpus.db_url, **args)
    assert err.value.field == field


async def test_limit_and_selective_loading(corpus: Corpus) -> None:
    project = [str(corpus.projects["a"])]
    full = await td.get_training_trajectories_async(corpus.db_url, projects=project, limit=5)
    assert [t.id for t in full] == corpus.expected(projects=["a"])[:5]
    assert all(t.messages and t.metadata is not None for t in full)
    assert full[0].completion is not None and full[0].prompt[-1]["role"] == "user"

    lean = await td.get_training_trajectories_async(
        corpus.db_url, projects=project, limit=5, include_messages=False, include_metadata=False
    )
    assert [t.id for t in lean] == [t.id for t in full]
    assert all(t.messages is None and t.reward_breakdown is None for t in lean)
    assert [t.reward for t in lean] == [t.reward for t in full]
    with pytest.raises(ValueError, match="include_messages"):
        _ = lean[0].prompt


async def test_get_by_id(corpus: Corpus) -> None:
    row = corpus.rows[7]
    got = await td.get_trajectory_by_id_async(corpus.db_url, row["id"])
    assert got is not None
    assert (got.run_id, got.step, got.group_index, got.rollout_index, got.reward) == (
        row["run_id"],
        row["step"],
        row["group_index"],
        row["rollout_index"],
        row["reward"],
    )
    assert got.messages == row["messages"] and got.created_at == row["created_at"]
    assert await td.get_trajectory_by_id_async(corpus.db_url, uuid.uuid4()) is None
    with pytest.raises(td.TrainingDataError) as err:
        await td.get_trajectory_by_id_async(corpus.db_url, "42")
    assert err.value.field == "trajectory_id"


@pytest.mark.parametrize("order", ["newest", "oldest"])
async def test_pagination_walks_everything_once(corpus: Corpus, order: str) -> None:
    projects = [str(p) for p in corpus.projects.values()]
    batches = [
        [t.id for t in batch]
        async for batch in td.paginate_trajectories(
            corpus.db_url, batch_size=7, projects=projects, order=order, min_reward=0.2
        )
    ]
    assert all(len(b) == 7 for b in batches[:-1]) and 1 <= len(batches[-1]) <= 7
    flat = [i for b in batches for i in b]
    assert flat == corpus.expected(projects=["a", "b"], min_reward=0.2, order=order)

    limited = [
        t.id
        async for batch in td.paginate_trajectories(
            corpus.db_url, batch_size=4, limit=10, projects=projects, order=order
        )
        for t in batch
    ]
    assert limited == corpus.expected(projects=["a", "b"], order=order)[:10]


async def test_cursor_is_stable_while_rows_are_inserted(
    corpus: Corpus, make_tenant: Any, sessionmaker: Any
) -> None:
    """Rows written while a reader pages through never shift or repeat a page: newest first
    they land before the reader's position, oldest first after it (and are then read)."""
    from tests.support.runs import add_trajectories, create_run

    tenant = await make_tenant()
    run = await create_run(sessionmaker, project_id=tenant.project_id)

    async def write(step: int) -> None:
        await add_trajectories(sessionmaker, run.id, step, 3)

    for step in range(4):
        await write(step)
    project = [str(tenant.project_id)]
    before = [
        t.id for t in await td.get_training_trajectories_async(corpus.db_url, projects=project)
    ]
    for order, new_rows_seen in (("newest", False), ("oldest", True)):
        seen: list[uuid.UUID] = []
        step = 100 if order == "newest" else 200
        async for batch in td.paginate_trajectories(
            corpus.db_url, batch_size=2, projects=project, order=order
        ):
            seen += [t.id for t in batch]
            await write(step)  # three new rows after every page
            step += 1
            if len(seen) > 60:
                break
        assert len(seen) == len(set(seen)), "a row was served twice"
        old = [i for i in seen if i in set(before)]
        assert old == (before if order == "newest" else before[::-1])
        if not new_rows_seen:
            assert seen == before
        else:
            assert len(seen) > len(before)
        before = [
            t.id for t in await td.get_training_trajectories_async(corpus.db_url, projects=project)
        ]


async def test_sync_functions_work_inside_a_running_loop(corpus: Corpus) -> None:
    # This test body runs on pytest-asyncio's loop: the reference's sync wrappers fail here.
    asyncio.get_running_loop()
    project = [str(corpus.projects["a"])]
    rows = td.get_training_trajectories(corpus.db_url, projects=project, min_reward=0.5)
    assert [t.id for t in rows] == corpus.expected(projects=["a"], min_reward=0.5)
    assert td.count_training_trajectories(corpus.db_url, projects=project) == len(
        corpus.expected(projects=["a"])
    )
    one = td.get_trajectory_by_id(corpus.db_url, rows[0].id)
    assert one is not None and one.id == rows[0].id
    streamed = [t.id for t in td.iter_trajectories(corpus.db_url, batch_size=5, projects=project)]
    assert streamed == corpus.expected(projects=["a"])
    with pytest.raises(td.TrainingDataError):
        td.count_training_trajectories(corpus.db_url, min_reward=2, max_reward=1)


def test_sync_functions_work_without_a_loop(corpus: Corpus) -> None:
    project = [str(corpus.projects["b"])]
    assert td.count_training_trajectories(corpus.db_url, projects=project) == len(
        corpus.expected(projects=["b"])
    )
    # Stopping early releases the helper thread and its connection.
    first = next(iter(td.iter_trajectories(corpus.db_url, batch_size=2, projects=project)))
    assert first.id == corpus.expected(projects=["b"])[0]


async def test_a_pool_or_connection_serves_many_queries(corpus: Corpus) -> None:
    conn = await asyncpg.connect(**connect_kwargs(corpus.db_url))
    await init_connection(conn)
    try:
        project = [str(corpus.projects["a"])]
        for _ in range(3):
            assert await td.count_training_trajectories_async(conn, projects=project) == len(
                corpus.expected(projects=["a"])
            )
    finally:
        await conn.close()
    with pytest.raises(td.TrainingDataError) as err:
        td.count_training_trajectories(conn)  # type: ignore[arg-type]
    assert err.value.field == "db_url"


async def test_runs_by_the_same_filters(corpus: Corpus) -> None:
    projects = [str(p) for p in corpus.projects.values()]
    alpha = corpus.runs["a1"]["learning_key"]
    runs = await td.get_training_runs_async(corpus.db_url, projects=projects, learning_key=alpha)
    assert {r.id for r in runs} == {corpus.runs[k]["id"] for k in ("a1", "a2", "b1")}
    assert [r.created_at for r in runs] == sorted((r.created_at for r in runs), reverse=True)
    done = await td.get_training_runs_async(
        corpus.db_url, projects=projects, learning_key=alpha, statuses=["completed"]
    )
    assert {r.id for r in done} == {corpus.runs[k]["id"] for k in ("a1", "b1")}
    assert td.count_training_runs(corpus.db_url, projects=projects) == 5
    assert (
        td.get_training_runs(corpus.db_url, projects=projects, limit=2, order="oldest")[0].id
        == (corpus.runs["a1"]["id"])
    )
