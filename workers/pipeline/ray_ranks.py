"""A run's ranks on the operator's Ray cluster (``grpo.distributed.launcher: ray``).

The worker that holds the run does what it does for any ranked run (lease, heartbeat, the
job and the outcome files in the run's folder, :func:`workers.pipeline.ranks.outcome`);
only where the ranks start changes. It connects to the cluster (``TRAINYARD_RAY_ADDRESS``)
as a driver and reserves one bundle per node, the CPUs and GPUs of that node's ranks, in a
placement group named after the run (``STRICT_SPREAD``: each bundle on a node of its own).
In each bundle an actor checks that its node sees the run's folder, then runs the unchanged
``accelerate launch`` of :func:`workers.pipeline.ranks.launch_command` for its machine rank,
with the rendezvous on rank 0's node: no launcher of ours across machines.

Ray ties the actors and the group to the worker that made them: a worker that dies takes
them with it, and each rank watches its actor's pid as it watches the worker's on one
machine, so it stops when its actor or its node is gone. A group that outlived its worker
(Ray had not noticed yet) is removed by name before the next attempt places its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from app.core.settings import Settings
from app.runs.spec.grpo import DistributedSettings
from workers.context import AttemptEnded
from workers.pipeline.launch import OWNER_PID, launch_command
from workers.watched import kill_session

log = logging.getLogger(__name__)

# Ray's C++ failure-signal handler (absl's), installed by ray.init in a driver, wraps the
# handlers the process has: on a SIGTERM (a deploy) it calls Celery's warm shutdown, then
# aborts the worker (SIGABRT) before its run is handed over. Read when Ray is imported: this
# module is, before any Ray import of the worker's (every one is in a function here or in
# ray_servers.py).
os.environ["RAY_DISABLE_FAILURE_SIGNAL_HANDLER"] = "1"

NAMESPACE = "trainyard"
# A file the worker writes into the run's folder and every node's actor reads back.
FOLDER_CHECK = "nodes-see-this"
CONNECT_SECONDS = 10.0
# How long the worker waits for killed launchers to return before it kills their actors.
STOP_SECONDS = 30.0
_connecting = threading.Lock()


class PlacementFailed(AttemptEnded):
    """The cluster did not place the run's ranks in time: the attempt ends (counted) and the
    run is dispatched again after the re-dispatch interval, when nodes may have come."""

    due_now = False


class ClusterUnreachable(AttemptEnded):
    """The worker could not connect to the cluster: the attempt ends (counted) and the run is
    dispatched again after the re-dispatch interval."""

    due_now = False


class ClusterUnavailable(RuntimeError):
    """The run asks for Ray and this worker has no cluster or no Ray: the run fails."""


def check_cluster(settings: Settings, asking: str) -> None:
    """Before any step, for a run that asks for Ray (``asking`` says for what)."""
    import importlib.util

    if settings.ray_address is None:
        raise ClusterUnavailable(
            f"the run asks for {asking} but this worker has no Ray cluster: set "
            "TRAINYARD_RAY_ADDRESS (docs/scaling.md)"
        )
    if importlib.util.find_spec("ray") is None:
        raise ClusterUnavailable(
            f"the run asks for {asking} but Ray is not installed on this worker "
            "(pip install 'trainyard[worker,ray]')"
        )


class FolderNotShared(RuntimeError):
    """A node does not see the run's folder: the artifacts must be on storage every node
    mounts at the same path. The run fails: no attempt elsewhere would see it either."""


def group_name(run_id: uuid.UUID) -> str:
    return f"trainyard-{run_id}"


def connect(address: str) -> None:
    """This process as a driver of the cluster, once (a worker may hold several runs)."""
    import ray

    with _connecting:
        if ray.is_initialized():
            return
        # ray.init waits minutes on an address nothing answers: ask the port first.
        host, _, port = address.removeprefix("ray://").rpartition(":")
        try:
            if address != "auto":  # "auto": the cluster this machine is a node of
                socket.create_connection((host, int(port)), timeout=CONNECT_SECONDS).close()
            ray.init(address=address, namespace=NAMESPACE, logging_level=logging.WARNING)
        except (OSError, ValueError, RuntimeError) as exc:
            raise ClusterUnreachable(
                f"the Ray cluster at {address} (TRAINYARD_RAY_ADDRESS) is not reachable: "
                f"{type(exc).__name__}: {exc}"
            ) from exc


def disconnect() -> None:
    import ray

    with _connecting:
        if ray.is_initialized():
            ray.shutdown()


class RankHost:
    """One node's share of a run's ranks: a Ray actor in the node's bundle."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.stopped = False
        self.lock = threading.Lock()

    def where(self, check: str, token: str) -> dict[str, Any]:
        """This node's address, a free port for the rendezvous (used on rank 0's node), and
        whether it sees the run's folder."""
        import ray

        try:
            sees = Path(check).read_text() == token
        except OSError:
            sees = False
        with socket.socket() as s:
            s.bind(("", 0))
            port = int(s.getsockname()[1])
        return {
            "ip": ray.util.get_node_ip_address(),
            "port": port,
            "host": socket.gethostname(),
            "sees": sees,
        }

    def launch(self, job: str, launch: dict[str, Any]) -> int:
        """Run this node's ``accelerate launch`` to its end; its exit code. The ranks watch
        this actor's pid: when Ray kills the actor (its worker or node gone), they stop."""
        command = launch_command(Path(job), **launch)
        with self.lock:
            if self.stopped:
                return -9
            self.process = subprocess.Popen(
                command, env={**os.environ, OWNER_PID: str(os.getpid())}, start_new_session=True
            )
        return self.process.wait()

    def stop(self) -> None:
        with self.lock:
            self.stopped = True
            process = self.process
        if process is not None and process.poll() is None:
            kill_session(process.pid)


class RayRanks:
    """A run's ranks, placed and started on the Ray cluster (the worker's :class:`Launched`)."""

    def __init__(self, group: Any, hosts: list[Any], places: list[dict[str, Any]]) -> None:
        self.group = group
        self.hosts = hosts
        self.places = places
        self.running: dict[Any, int] = {}  # the launch's ref -> its machine rank
        self.codes: dict[int, int] = {}
        self.gone: str | None = None

    @classmethod
    async def start(
        cls, settings: Settings, run_id: uuid.UUID, distributed: DistributedSettings, job: Path
    ) -> RayRanks:
        return await asyncio.to_thread(cls._start, settings, run_id, distributed, job)

    @classmethod
    def _start(
        cls, settings: Settings, run_id: uuid.UUID, distributed: DistributedSettings, job: Path
    ) -> RayRanks:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        assert settings.ray_address is not None  # check_distributed
        connect(settings.ray_address)
        name = group_name(run_id)
        remove_left_over(name)
        nodes, per_node = distributed.num_nodes, distributed.processes_per_node
        gpus = distributed.gpus_per_process
        if gpus is None:
            gpus = 1 if ray.cluster_resources().get("GPU", 0) else 0
        bundle = {"CPU": float(distributed.cpus_per_process * per_node)}
        if gpus:
            bundle["GPU"] = float(gpus * per_node)
        strategy = "STRICT_SPREAD" if nodes > 1 else "PACK"
        began = time.monotonic()
        group = placement_group([bundle] * nodes, strategy=strategy, name=name)
        ranks = cls(group, [], [])
        try:
            try:
                ray.get(group.ready(), timeout=settings.ray_placement_timeout_seconds)
                placed = time.monotonic()
            except ray.exceptions.GetTimeoutError:
                raise PlacementFailed(
                    f"the Ray cluster did not place {nodes} node(s) x {describe(bundle)} "
                    f"({strategy}) in {settings.ray_placement_timeout_seconds:g} s; its nodes: "
                    f"{describe_nodes()}"
                ) from None
            host = ray.remote(max_concurrency=2)(RankHost)
            ranks.hosts = [
                host.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=group, placement_group_bundle_index=index
                    ),
                ).remote()
                for index in range(nodes)
            ]
            check, token = job.parent / FOLDER_CHECK, uuid.uuid4().hex
            check.write_text(token)
            try:
                ranks.places = ray.get(
                    [h.where.remote(str(check), token) for h in ranks.hosts],
                    timeout=settings.ray_placement_timeout_seconds,
                )
            except ray.exceptions.GetTimeoutError:
                raise PlacementFailed(
                    f"the ranks' actors did not start on the placed nodes in "
                    f"{settings.ray_placement_timeout_seconds:g} s (their nodes: "
                    f"{describe_nodes()})"
                ) from None
            check_seen(ranks.places, job.parent)
            main = ranks.places[0]
            for machine_rank, h in enumerate(ranks.hosts):
                launch = {
                    "num_processes": distributed.num_processes,
                    "config": distributed.accelerate_config,
                    "port": main["port"],
                    "machines": nodes,
                    "machine_rank": machine_rank,
                    "main_ip": main["ip"],
                }
                ranks.running[h.launch.remote(str(job), launch)] = machine_rank
        except BaseException:
            ranks._release()
            raise
        log.info(
            "run %s: %d rank(s) on Ray node(s) %s (%s each): placed in %.2f s, actors ready "
            "in %.2f s more",
            run_id,
            distributed.num_processes,
            ", ".join(p["ip"] for p in ranks.places),
            describe(bundle),
            placed - began,
            time.monotonic() - placed,
        )
        return ranks

    def done(self) -> bool:
        return not self.running

    async def wait(self, at_most: float) -> None:
        await asyncio.to_thread(self._wait, at_most)

    def _wait(self, timeout: float) -> None:
        import ray

        ready, _ = ray.wait(list(self.running), num_returns=1, timeout=timeout)
        for ref in ready:
            machine_rank = self.running.pop(ref)
            try:
                self.codes[machine_rank] = ray.get(ref)
            except ray.exceptions.RayError as exc:  # the actor died: its node, or killed
                place = self.places[machine_rank]
                self.gone = self.gone or (
                    f"Ray node {place['host']} {place['ip']} (machine rank {machine_rank}) is "
                    f"gone: {type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                )
                log.error("%s; stopping the other nodes' ranks", self.gone)
                self.kill()

    def kill(self) -> None:
        for machine_rank in self.running.values():
            self.hosts[machine_rank].stop.remote()

    async def close(self) -> None:
        await asyncio.to_thread(self._close)

    def _close(self) -> None:
        if self.running:
            self.kill()
            deadline = time.monotonic() + STOP_SECONDS
            while self.running and time.monotonic() < deadline:
                self._wait(deadline - time.monotonic())
        self._release()

    def _release(self) -> None:
        """The actors and the placement group gone (their ranks stop with them)."""
        import ray
        from ray.util.placement_group import remove_placement_group

        for h in self.hosts:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(h)
        with contextlib.suppress(ray.exceptions.RayError):
            remove_placement_group(self.group)

    def ended(self) -> str:
        codes = ", ".join(f"{rank}: {code}" for rank, code in sorted(self.codes.items()))
        return f"the launchers by machine rank exited with {{{codes}}}"


def check_seen(places: list[dict[str, Any]], folder: Path, consequence: str = "") -> None:
    """FolderNotShared naming the placed nodes (their actors' ``sees``) that do not see the
    run's ``folder``; ``consequence``: what that would break, to say so."""
    blind = [p for p in places if not p["sees"]]
    if blind:
        raise FolderNotShared(
            f"Ray node(s) {', '.join(p['host'] + ' ' + p['ip'] for p in blind)} do not see "
            f"the run's folder {folder}{consequence}: every node must mount the artifacts "
            "folder (TRAINYARD_ARTIFACTS_DIR) at the same path"
        )


def remove_left_over(name: str) -> None:
    from ray.util import get_placement_group
    from ray.util.placement_group import remove_placement_group

    try:
        left = get_placement_group(name)
    except ValueError:
        return
    log.warning("removing placement group %s, left by an earlier attempt", name)
    remove_placement_group(left)


def describe(bundle: dict[str, float]) -> str:
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in bundle.items()) + "}"


def describe_nodes() -> str:
    """Each alive node's address and CPUs/GPUs: what a refusal to place says the cluster has."""
    import ray

    alive = [n for n in ray.nodes() if n.get("Alive")]
    return (
        "; ".join(
            f"{n['NodeManagerAddress']} "
            + describe({k: v for k, v in n["Resources"].items() if k in ("CPU", "GPU")})
            for n in alive
        )
        or "none alive"
    )
