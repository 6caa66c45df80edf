"""Trajectories as RL records, as a Hugging Face dataset, and through JSON Lines and back."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path
from typing import Any

import pytest

from app import training_data as td
from tests.support.training_data import Corpus


def _group_stats(corpus: Corpus) -> dict[tuple[Any, int, int], tuple[float, float]]:
    groups: dict[tuple[Any, int, int], list[float]] = {}
    for r in corpus.rows:
        if r["reward"] is not None:
            groups.setdefault((r["run_id"], r["step"], r["group_index"]), []).append(r["reward"])
    return {k: (statistics.fmean(v), statistics.pstdev(v)) for k, v in groups.items()}


async def test_rl_records_use_the_whole_group_whatever_the_filter_kept(corpus: Corpus) -> None:
    rows = await td.get_training_trajectories_async(
        corpus.db_url,
        projects=[str(corpus.projects["a"])],
        min_reward=0.5,
        include_group_stats=True,
    )
    records = td.to_rl_records(rows)
    stats = _group_stats(corpus)
    assert len(records) == len(rows) > 0
    for t, rec in zip(rows, records, strict=True):
        mean, std = stats[t.group_key]
        assert t.group_reward_mean == pytest.approx(mean)
        assert rec["advantage"] == pytest.approx((t.reward - mean) / (std + 1e-4))
        assert rec["prompt"] == t.messages[:-1]  # type: ignore[index]
        assert rec["completion"] == [t.messages[-1]]  # type: ignore[index]
    # Without the database's stats, the group is what was given.
    given = td.to_rl_records(
        [
            t
            for t in await td.get_training_trajectories_async(
                corpus.db_url, run_ids=[rows[0].run_id]
            )
        ]
    )
    by_group: dict[Any, list[float]] = {}
    for rec in given:
        by_group.setdefault((rec["step"], rec["group_index"]), []).append(rec["advantage"])
    assert all(abs(sum(adv)) < 1e-6 for adv in by_group.values())


def test_hf_dataset_streams_scored_rollouts(corpus: Corpus, tmp_path: Path) -> None:
    project = [str(corpus.projects["a"])]
    ds = td.to_hf_dataset(corpus.db_url, batch_size=7, projects=project, cache_dir=str(tmp_path))
    scored = [r for r in corpus.rows if r["project_id"] == corpus.projects["a"]]
    scored = [r for r in scored if r["reward"] is not None]
    assert len(ds) == len(scored)
    assert {"prompt", "completion", "reward", "advantage", "run_id", "step"} <= set(ds.column_names)
    first = ds[0]
    newest = max(scored, key=lambda r: (r["created_at"], r["id"]))
    assert first["trajectory_id"] == str(newest["id"])
    assert first["reward"] == pytest.approx(newest["reward"])
    assert first["prompt"] == newest["messages"][:-1]
    assert all(math.isfinite(a) for a in ds["advantage"])
    # A second call reads the database again rather than a cached copy of the first.
    again = td.to_hf_dataset(
        corpus.db_url, projects=project, min_reward=0.5, cache_dir=str(tmp_path)
    )
    assert len(again) == sum(1 for r in scored if r["reward"] >= 0.5)


async def test_jsonl_round_trip_into_another_project(
    corpus: Corpus, make_tenant: Any, tmp_path: Path
) -> None:
    source = [str(corpus.projects["a"])]
    path = tmp_path / "a.jsonl"
    written = await td.export_jsonl_async(corpus.db_url, path, projects=source, min_reward=0.2)
    expected = corpus.expected(projects=["a"], min_reward=0.2)
    assert written == len(expected) == len(path.read_text().splitlines())

    target = await make_tenant()
    result = await td.import_jsonl_async(corpus.db_url, path, project=target.name)
    assert result.trajectories == written and result.project_id == target.project_id
    assert len(result.run_ids) == len({corpus.rows_by_id[i]["run_id"] for i in expected})

    imported = await td.get_training_trajectories_async(
        corpus.db_url, projects=[target.name], order="oldest"
    )
    original = {i: corpus.rows_by_id[i] for i in expected}
    by_source = {
        (str(r["run_id"]), r["step"], r["group_index"], r["rollout_index"]): r
        for r in original.values()
    }
    new_to_source = {v: k for k, v in result.run_ids.items()}
    for t in imported:
        src = by_source[(new_to_source[t.run_id], t.step, t.group_index, t.rollout_index)]
        assert (t.messages, t.reward, t.learning_key) == (
            src["messages"],
            src["reward"],
            src["learning_key"],
        )
        assert t.created_at == src["created_at"] and t.metadata == src["metadata"]
    runs = await td.get_training_runs_async(corpus.db_url, projects=[target.name])
    assert {r.id for r in runs} == set(result.run_ids.values())
    assert all(r.status == "completed" for r in runs)


async def test_a_bad_line_imports_nothing(corpus: Corpus, make_tenant: Any) -> None:
    target = await make_tenant()
    good = {"messages": [{"role": "user", "content": "hi"}], "reward": 0.5}
    lines = [
        json.dumps(good),
        "",
        json.dumps({**good, "reward": "high"}),
        "{not json",
        json.dumps({**good, "messages": []}),
        json.dumps({**good, "messages": [{"role": "wizard", "content": "x"}]}),
        json.dumps({**good, "secret": 1}),
        json.dumps({**good, "messages": [{"role": "user", "content": "a\u0000b"}]}),
        json.dumps(good),  # repeats line 1's (run, step, group, rollout)
    ]
    with pytest.raises(td.JsonlImportError) as err:
        await td.import_jsonl_async(corpus.db_url, lines, project=target.name)
    assert [n for n, _ in err.value.lines] == [3, 4, 5, 6, 7, 8, 9]
    assert "reward" in dict(err.value.lines)[3] and "line 1" in dict(err.value.lines)[9]
    assert await td.count_training_runs_async(corpus.db_url, projects=[target.name]) == 0

    with pytest.raises(td.TrainingDataError) as unknown:
        await td.import_jsonl_async(corpus.db_url, [json.dumps(good)], project="no-such-project")
    assert unknown.value.field == "projects"
    with pytest.raises(td.TrainingDataError, match="no trajectories"):
        await td.import_jsonl_async(corpus.db_url, ["", "  "], project=target.name)

    ok = td.import_jsonl(corpus.db_url, [json.dumps(good)], project=target.name, learning_key="k")
    assert ok.trajectories == 1
    (row,) = await td.get_training_trajectories_async(corpus.db_url, projects=[target.name])
    assert row.learning_key == "k" and row.reward == 0.5 and row.step == 0


def test_cli_exports_and_imports(corpus: Corpus, tmp_path: Path, service_urls: Any) -> None:
    from typer.testing import CliRunner

    from app.cli import app

    runner = CliRunner()
    path = tmp_path / "b.jsonl"
    project = str(corpus.projects["b"])
    done = runner.invoke(app, ["data", "export", str(path), "--project", project])
    assert done.exit_code == 0, done.output
    assert len(path.read_text().splitlines()) == len(corpus.expected(projects=["b"]))
    bad = runner.invoke(
        app, ["data", "export", str(path), "--min-reward", "2", "--max-reward", "1"]
    )
    assert bad.exit_code == 2 and "min_reward" in bad.output
    into = runner.invoke(app, ["data", "import", str(path), "--project", "no-such-project"])
    assert into.exit_code == 2 and "projects" in into.output
