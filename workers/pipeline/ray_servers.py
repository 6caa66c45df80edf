"""vLLM servers that Ray places for a run (a catalog fleet with ``ray:``, ``grpo.vllm_servers``
naming it, ``grpo.num_vllm_servers`` of them).

For each attempt the worker that holds the run reserves one bundle per server (the fleet's
CPUs and GPUs) in a placement group named after the run (``SPREAD``: on different nodes where
it can), and in each an actor starts the operator's vLLM command on the run's model, with
LoRA loading at runtime, on the node's address and a free port. The server runs under
:mod:`workers.watched`, so it dies with its actor: when the worker dies (Ray ends
what a dead driver owned) or the node does, nothing is left serving. The worker waits for
every server's ``/health``, then the run's rollouts use them exactly as they use the servers
a team runs (:mod:`workers.ml.vllm_server`, which loads each step's adapter from the run's
folder: every node must see it, which the actors check first). When the attempt ends, for
whatever reason, the servers are stopped and the group removed; the next attempt places
its own. A server that dies mid-run fails its requests, and the attempt ends as with any
server that stops answering.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from app.catalog.models import RayPlacedVllm
from app.runs.spec.parsed import RunSpec
from workers.context import AttemptEnded, RunContext
from workers.pipeline.ray_ranks import (
    FOLDER_CHECK,
    PlacementFailed,
    check_cluster,
    check_seen,
    connect,
    describe,
    describe_nodes,
    remove_left_over,
)

log = logging.getLogger(__name__)

# LoRA ranks vLLM accepts for --max-lora-rank: the server's is the smallest that holds the run's.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
STOP_SECONDS = 20.0  # the watched server's SIGTERM grace is 10 s
# Ray kills an actor's child processes when it ends the actor; the watch would go, the server
# (in a session of its own) would not. Kept, the watch sees the actor's end and takes the
# server's whole session with it.
KEEP_CHILDREN = {"env_vars": {"RAY_kill_child_processes_on_worker_exit": "0"}}


class ServersFailed(AttemptEnded):
    """A server Ray placed did not come up (it exited, or never answered ``/health``): the
    attempt ends (counted) and the run is dispatched again after the re-dispatch interval."""

    due_now = False


def group_name(run_id: uuid.UUID) -> str:
    return f"trainyard-{run_id}-vllm"


def server_command(fleet: RayPlacedVllm, model: str, lora_rank: int) -> list[str]:
    """The fleet's command on the run's model, loading adapters of up to ``lora_rank`` at
    runtime (the step's and the one before it, while they swap), log-probabilities after
    temperature; the node's ``--host`` and
    ``--port`` are added where it runs, and the operator's ``args`` come last."""
    max_rank = next((r for r in LORA_RANKS if r >= lora_rank), lora_rank)
    return [
        *fleet.command,
        "--model",
        model,
        "--enable-lora",
        "--max-lora-rank",
        str(max_rank),
        "--max-loras",
        "2",
        # Log-probabilities after temperature, TRL's definition (as `trl vllm-serve` asks).
        "--logprobs-mode",
        "processed_logprobs",
        *fleet.args,
    ]


class VllmHost:
    """One server of a run: a Ray actor in its bundle; the server a process of its own."""

    def __init__(self) -> None:
        self.process: subprocess.Popen[bytes] | None = None
        self.stopped = False
        self.lock = threading.Lock()

    def start(
        self, command: list[str], env: dict[str, str], log_path: str, check: str, token: str
    ) -> dict[str, Any]:
        """Starts the server unless this node does not see the run's folder; where it is."""
        import ray

        ip = ray.util.get_node_ip_address()
        try:
            sees = Path(check).read_text() == token
        except OSError:
            sees = False
        where = {"ip": ip, "host": socket.gethostname(), "sees": sees, "url": None}
        if not sees:
            return where
        with socket.socket() as s:
            s.bind((ip, 0))
            port = int(s.getsockname()[1])
        argv = [sys.executable, "-m", "workers.watched", str(os.getpid()), "--"]
        argv += [*command, "--host", ip, "--port", str(port)]
        with self.lock:
            if self.stopped:
                return where
            with open(log_path, "ab") as out:
                self.process = subprocess.Popen(
                    argv,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # out of the actor's process group: see KEEP_CHILDREN
                    env={**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", **env},
                )
        return {**where, "url": f"http://{ip}:{port}"}

    def exit_code(self) -> int | None:
        """None while the server runs."""
        return None if self.process is None else self.process.poll()

    def stop(self) -> int | None:
        """SIGTERM, and the server's exit once it has gone (SIGKILL after the grace)."""
        with self.lock:
            self.stopped = True
            process = self.process
        if process is None:
            return None
        if process.poll() is None:
            process.terminate()
        return process.wait()


class RayServers:
    """A run's vLLM servers on the Ray cluster, for one attempt."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.hosts: list[Any] = []
        self.places: list[dict[str, Any]] = []
        self.logs: list[Path] = []

    @property
    def urls(self) -> list[str]:
        return [str(p["url"]) for p in self.places]

    @classmethod
    def start(
        cls, ctx: RunContext, spec: RunSpec, fleet: RayPlacedVllm, folder: Path
    ) -> RayServers:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        settings = ctx.settings
        assert settings.ray_address is not None and spec.grpo.lora is not None  # checked
        connect(settings.ray_address)
        count = spec.grpo.num_vllm_servers or 1
        name = group_name(spec.id)
        remove_left_over(name)
        bundle = {"CPU": float(fleet.cpus_per_server)}
        if fleet.gpus_per_server:
            bundle["GPU"] = float(fleet.gpus_per_server)
        began = time.monotonic()
        servers = cls(placement_group([bundle] * count, strategy="SPREAD", name=name))
        try:
            try:
                ray.get(servers.group.ready(), timeout=settings.ray_placement_timeout_seconds)
            except ray.exceptions.GetTimeoutError:
                raise PlacementFailed(
                    f"the Ray cluster did not place {count} vLLM server(s) x "
                    f"{describe(bundle)} in {settings.ray_placement_timeout_seconds:g} s; "
                    f"its nodes: {describe_nodes()}"
                ) from None
            placed = time.monotonic()
            # From here on, the fleet's startup_timeout_seconds: the actors' processes (a
            # runtime env of their own: see KEEP_CHILDREN), then the servers' /health.
            within = fleet.startup_timeout_seconds
            deadline = placed + within
            host = ray.remote(max_concurrency=2)(VllmHost)
            servers.hosts = [
                host.options(
                    num_cpus=bundle["CPU"],
                    num_gpus=bundle.get("GPU", 0),
                    runtime_env=KEEP_CHILDREN,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=servers.group, placement_group_bundle_index=index
                    ),
                ).remote()
                for index in range(count)
            ]
            folder.mkdir(parents=True, exist_ok=True)
            check, token = folder / FOLDER_CHECK, uuid.uuid4().hex
            check.write_text(token)
            command = server_command(fleet, spec.model_name, spec.grpo.lora.r)
            servers.logs = [folder / f"vllm-{index}.log" for index in range(count)]
            try:
                servers.places = ray.get(
                    [
                        h.start.remote(command, dict(fleet.env), str(path), str(check), token)
                        for h, path in zip(servers.hosts, servers.logs, strict=True)
                    ],
                    timeout=within,
                )
            except ray.exceptions.GetTimeoutError:
                raise ServersFailed(
                    f"the vLLM servers' actors did not start on the placed nodes in {within:g} "
                    f"s (the fleet's startup_timeout_seconds; their nodes: {describe_nodes()})"
                ) from None
            check_seen(
                servers.places,
                folder.parent,
                " (the vLLM servers placed there could not load the run's adapters)",
            )
            servers._wait_healthy(deadline, within)
        except BaseException:
            servers.close()
            raise
        log.info(
            "run %s: %d vLLM server(s) on Ray (%s each) at %s: placed in %.2f s, healthy in "
            "%.2f s more",
            spec.id,
            count,
            describe(bundle),
            ", ".join(servers.urls),
            placed - began,
            time.monotonic() - placed,
        )
        return servers

    def _wait_healthy(self, deadline: float, within: float) -> None:
        """Until every server answers ``GET /health`` with 200 (by ``deadline``, ``within``
        seconds of the placement); ServersFailed naming the first that exited or did not
        answer in time, with the end of its log."""
        import ray

        waiting = dict(enumerate(self.urls))
        with httpx.Client(timeout=5) as http:
            while waiting:
                for index, url in list(waiting.items()):
                    with contextlib.suppress(httpx.HTTPError):
                        if http.get(f"{url}/health").status_code == 200:
                            del waiting[index]
                            continue
                    code = ray.get(self.hosts[index].exit_code.remote())
                    if code is not None:
                        raise ServersFailed(
                            f"vLLM server {index} ({url}) exited with {code} before it "
                            f"answered; the end of its log ({self.logs[index]}):\n"
                            + _tail(self.logs[index])
                        )
                if waiting and time.monotonic() > deadline:
                    index, url = next(iter(waiting.items()))
                    raise ServersFailed(
                        f"vLLM server {index} ({url}) did not answer /health in {within:g} s "
                        f"(the fleet's startup_timeout_seconds); the end of its log "
                        f"({self.logs[index]}):\n" + _tail(self.logs[index])
                    )
                if waiting:
                    # The servers are separate processes on other machines: nothing to wait
                    # on but their answers.
                    time.sleep(1.0)

    def close(self) -> None:
        """Every server stopped (SIGTERM, then SIGKILL after the grace), the actors and the
        group gone."""
        import ray
        from ray.util.placement_group import remove_placement_group

        stops = [h.stop.remote() for h in self.hosts]
        with contextlib.suppress(ray.exceptions.RayError):
            ray.get(stops, timeout=STOP_SECONDS)
        for h in self.hosts:
            with contextlib.suppress(ray.exceptions.RayError):
                ray.kill(h)  # the watched server goes with its actor, if it is still there
        with contextlib.suppress(ray.exceptions.RayError):
            remove_placement_group(self.group)


def _tail(path: Path, lines: int = 20) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(unreadable: {exc})"


@contextlib.asynccontextmanager
async def placed_servers(ctx: RunContext, spec: RunSpec, root: Path) -> AsyncIterator[bool]:
    """For the attempt inside: the run's Ray-placed vLLM servers, if its fleet is one (True),
    started and healthy, their URLs what ``ctx.load()`` resolves the fleet into; stopped
    after."""
    fleet = ctx.runtime.policy.placed_vllm(spec.grpo.vllm_servers)
    if fleet is None:
        yield False
        return
    check_cluster(ctx.settings, "vLLM servers placed by Ray (grpo.vllm_servers)")
    began = time.monotonic()
    servers = await asyncio.to_thread(RayServers.start, ctx, spec, fleet, root / "servers")
    try:
        ctx.placed_servers = servers.urls
        await ctx.event(
            "servers",
            f"{len(servers.urls)} vLLM server(s) placed by Ray and healthy in "
            f"{time.monotonic() - began:.1f} s",
            data={
                "urls": servers.urls,
                "nodes": [p["host"] for p in servers.places],
                "seconds": round(time.monotonic() - began, 3),
            },
        )
        yield True
    finally:
        ctx.placed_servers = None
        await asyncio.to_thread(servers.close)
