"""Training on several processes (``grpo.distributed.num_processes`` > 1), or on a Ray
cluster (``launcher: ray``).

The worker process does for such a run what it does for any: it holds the run's lease and
heartbeats, prepares the inputs and the plan, and settles the outcome. The training itself
runs in N ranks started under ``accelerate launch`` (torch.distributed: NCCL on GPUs, gloo
on CPU), on this machine (:class:`LocalRanks`) or on the nodes Ray places them on
(:mod:`workers.pipeline.ray_ranks`), each building the same TRL trainer from the job the
worker wrote (``python -m workers.pipeline.ranks JOB``):

- each rank generates its share of the step's rollouts; rank 0 gathers them all, scores
  every group (a group may span ranks), writes to the database fenced on the worker's
  lease, and hands each rank its rewards (:class:`Ranks`);
- stops are rank 0's decision, shared with every rank at the same point, so all of them
  raise the same stop together; every rank also watches the run read-only each heartbeat
  (cancel, pause, the lease, the worker being alive, a handover the worker asked for), so a
  cancel ends a generation in progress on every rank;
- each rank writes how it ended to ``outcome-<rank>.json``; the worker turns these into
  what a one-process training would have raised (:func:`outcome`). A rank that died without
  a word (killed, out of memory) ends the attempt: the run goes back to the queue at once,
  the failure counted, and resumes from its last checkpoint on any worker.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import pickle
import signal
import sys
import threading
import time
import traceback
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from app.core.settings import Settings
from app.runs.lifecycle import leases
from app.runs.lifecycle.fence import Fence
from app.runs.lifecycle.state import LeaseLost
from app.runs.spec.grpo import DistributedSettings
from app.runs.spec.parsed import RunSpec
from workers.context import SHUTTING_DOWN, AttemptEnded, HandOver, RunContext, StopRequested
from workers.pipeline.launch import (
    ACCELERATE_CONFIGS,
    OWNER_PID,
    free_port,
    launch_command,
)
from workers.pipeline.paths import RunPaths
from workers.pipeline.plan import InputBatch, PlannedInput
from workers.pipeline.world import FollowedRankZero, raise_stop
from workers.runtime import Runtime
from workers.watched import kill_session

log = logging.getLogger(__name__)


class RankDied(AttemptEnded):
    """A rank ended without saying why (killed, out of memory): the attempt is over and the
    run resumes from its last checkpoint, on this worker or another."""


class RankFailed(RuntimeError):
    """A rank raised: the run fails with its error, as a one-process training would."""


# -- the worker's side ------------------------------------------------------------------
@dataclass
class Job:
    """What every rank needs to build the same trainer as the others."""

    settings: Settings
    run_id: uuid.UUID
    fence: Fence
    worker_pid: int
    plan: list[InputBatch]
    validation: list[PlannedInput]
    resume_from: Path | None
    model: str | None
    placed_servers: list[str] | None  # the vLLM servers Ray placed for the attempt


class DistributedUnavailable(RuntimeError):
    pass


def check_distributed(spec: DistributedSettings, settings: Settings) -> None:
    """Fail before any step if this worker cannot launch the run's ranks: its accelerate
    config is missing, DeepSpeed is not installed or has no GPUs, or it has fewer GPUs than
    ranks; on Ray, it has no cluster or no Ray. (Without GPUs, any number of CPU ranks run
    on gloo.) What a Ray cluster's nodes have is checked when the ranks are placed."""
    ranks, name = spec.num_processes, spec.accelerate_config
    if not spec.in_ranks:
        return
    import importlib.util

    if not (ACCELERATE_CONFIGS / f"{name}.yaml").is_file():
        raise DistributedUnavailable(f"no accelerate config {name!r} in {ACCELERATE_CONFIGS}")
    if spec.launcher == "ray":
        from workers.pipeline.ray_ranks import check_cluster

        check_cluster(settings, "launcher 'ray'")
        return
    import torch

    gpus = torch.cuda.device_count()
    if name.startswith("zero"):
        if importlib.util.find_spec("deepspeed") is None:
            raise DistributedUnavailable(
                f"accelerate_config {name!r} is DeepSpeed's, which is not installed on this "
                "worker (pip install 'trainyard[worker,gpu]')"
            )
        if not gpus:
            raise DistributedUnavailable(
                f"accelerate_config {name!r} (DeepSpeed ZeRO) needs GPUs; this worker has none: "
                "use 'ddp', which runs CPU ranks on gloo"
            )
    if gpus and ranks > gpus:
        raise DistributedUnavailable(
            f"distributed.num_processes is {ranks} but this worker has {gpus} GPU(s): one "
            "rank per GPU"
        )


async def train_on_ranks(
    ctx: RunContext,
    spec: RunSpec,
    plan: list[InputBatch],
    validation: list[PlannedInput],
    paths: RunPaths,
    resume_from: Path | None,
    model: str | None,
) -> Path:
    """Train the run in its ranks; returns the final model's folder, or raises what a
    one-process training would have (a stop, a handover, a lost lease, the error), or
    :class:`RankDied`."""
    distributed = spec.grpo.distributed
    folder = paths.root / "ranks"
    await asyncio.to_thread(_fresh_folder, folder, paths.staging)
    job = folder / "job.pkl"
    payload = Job(
        ctx.settings,
        spec.id,
        ctx.fence,
        os.getpid(),
        plan,
        validation,
        resume_from,
        model,
        ctx.placed_servers,
    )
    await asyncio.to_thread(_write_private, job, pickle.dumps(payload))
    launched: Launched
    if distributed.launcher == "ray":
        from workers.pipeline.ray_ranks import RayRanks

        launched = await RayRanks.start(ctx.settings, spec.id, distributed, job)
    else:
        launched = await LocalRanks.start(spec.id, distributed, job)
    handover = folder / "handover"
    lost_at: float | None = None
    try:
        while not launched.done():
            await launched.wait(ctx.settings.heartbeat_seconds)
            if SHUTTING_DOWN.is_set() and not handover.exists():
                await asyncio.to_thread(handover.touch)  # the ranks stop at the next step end
            if ctx.lost and not launched.done():
                # The ranks see it too (their watch); past a lease's time, they are stuck.
                lost_at = lost_at or time.monotonic()
                if time.monotonic() - lost_at > ctx.settings.lease_ttl_seconds:
                    launched.kill()
    finally:
        await launched.close()  # what is still running (the worker's task was cancelled)
    return await asyncio.to_thread(
        outcome, folder, distributed.num_processes, launched.ended(), ctx, gone=launched.gone
    )


class Launched(Protocol):
    """A run's ranks, started: on this machine, or on a Ray cluster."""

    gone: str | None
    """Set when a machine of the ranks (or what holds them there) is gone: the attempt is
    over, whatever the ranks managed to write."""

    def done(self) -> bool: ...

    async def wait(self, at_most: float) -> None:
        """Until every rank has ended, or ``at_most`` seconds."""

    def kill(self) -> None: ...

    async def close(self) -> None:
        """Kill what still runs, wait for it, and give back what the launch holds."""

    def ended(self) -> str:
        """How the launcher ended, for the worker's log and a dead rank's message."""


class LocalRanks:
    """The ranks under one ``accelerate launch`` on this machine, in a session of its own:
    a signal to the worker's process group (a deploy's SIGTERM) reaches the worker, which
    hands the run over at a step boundary, not the ranks."""

    gone: str | None = None

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    @classmethod
    async def start(
        cls, run_id: uuid.UUID, distributed: DistributedSettings, job: Path
    ) -> LocalRanks:
        command = launch_command(
            job,
            num_processes=distributed.num_processes,
            config=distributed.accelerate_config,
            port=free_port(),
        )
        log.info(
            "run %s: launching %d ranks: %s", run_id, distributed.num_processes, " ".join(command)
        )
        return cls(await asyncio.create_subprocess_exec(*command, start_new_session=True))

    def done(self) -> bool:
        return self.process.returncode is not None

    async def wait(self, at_most: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(at_most):
                await self.process.wait()

    def kill(self) -> None:
        kill_session(self.process.pid)

    async def close(self) -> None:
        if not self.done():
            self.kill()
            await self.process.wait()

    def ended(self) -> str:
        return f"the launcher exited with {self.process.returncode}"


def _fresh_folder(folder: Path, staging: Path) -> None:
    """The job's folder, empty; no half-written checkpoints of a crash in TRL's staging."""
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    shutil.rmtree(staging, ignore_errors=True)
    folder.mkdir(parents=True)


def _write_private(path: Path, data: bytes) -> None:
    """The job holds the worker's settings (its database URL with any password): 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


_CLEAN = {"completed", "cancelled", "paused", "handover", "lost"}


def outcome(
    folder: Path, world: int, ended: str, ctx: RunContext, *, gone: str | None = None
) -> Path:
    """What the ranks' outcome files say, as a one-process training would have ended.

    Rank 0's completion is the final model. A machine ``gone`` (a Ray node, or its actor)
    ends the attempt: :class:`RankDied`. Otherwise rank 0 decides every clean end (a stop, a
    handover, a lost lease); a rank with no outcome died without a word: :class:`RankDied`.
    Otherwise the first error written is the cause (the others are ranks that lost their
    peer after it): an attempt that ended (a vLLM server gone) ends this one too; any other
    error fails the run. ``ended``: how the launcher ended, for the messages."""
    said: dict[int, dict[str, Any]] = {}
    for rank in range(world):
        path = folder / f"outcome-{rank}.json"
        with contextlib.suppress(FileNotFoundError, ValueError):
            said[rank] = json.loads(path.read_text())
    zero = said.get(0, {})
    kind = zero.get("outcome")
    if kind == "completed":
        return Path(zero["final"])
    if gone is not None:
        raise RankDied(f"{gone} ({ended})")
    if kind in _CLEAN:
        raise_stop(kind, ctx)
    silent = [rank for rank in range(world) if rank not in said]
    if silent:
        raise RankDied(
            f"rank {', '.join(map(str, silent))} of {world} died without an outcome ({ended}): "
            "killed or out of memory; see the worker's log"
        )
    errors = sorted(
        (
            (o["at"], rank, o)
            for rank, o in said.items()
            if o.get("outcome") in ("error", "attempt-ended")
        ),
        key=lambda e: (e[0], e[1]),
    )
    if errors:
        _, rank, first = errors[0]
        if first["outcome"] == "attempt-ended":
            ended = AttemptEnded(f"rank {rank} of {world}: {first['error']}")
            ended.due_now = bool(first.get("due_now", True))
            raise ended
        failure = RankFailed(f"rank {rank} of {world}: {first['error']}")
        failure.add_note(first.get("traceback", ""))
        raise failure
    raise RankDied(f"the ranks were terminated ({ended}): {said}")


# -- a rank's side --------------------------------------------------------------------------
class RankContext(RunContext):
    """A rank's view of the run: the worker holds the lease; a rank watches it, read-only,
    and stops when the worker is gone, or asks for a handover."""

    def __init__(self, runtime: Runtime, job: Job, handover: Path) -> None:
        super().__init__(runtime, job.run_id, job.fence)
        self.worker_pid = int(os.environ.get(OWNER_PID, job.worker_pid))
        self.handover = handover
        self.placed_servers = job.placed_servers

    async def lease_state(self) -> leases.LeaseState:
        if not _alive(self.worker_pid):
            raise LeaseLost(self.run_id)
        if self.handover.exists():
            SHUTTING_DOWN.set()
        async with self.runtime.session() as session:
            return await leases.observe(session, self.run_id, self.fence)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    """One rank: train the job's run and say how it ended."""
    from app.core.logs import configure_logging

    args = sys.argv[1:] if argv is None else argv
    job_path = Path(args[0])
    job: Job = pickle.loads(job_path.read_bytes())
    rank = int(os.environ.get("RANK", "0"))
    configure_logging(os.environ.get("TRAINYARD_LOG_LEVEL", "INFO"))
    # The launcher stops the survivors with SIGTERM when a rank fails: end through the
    # ``finally`` below, so this rank says it was terminated rather than nothing.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    said: dict[str, Any] = {"outcome": "error", "error": "did not start"}
    runtime = Runtime(job.settings)
    ctx = RankContext(runtime, job, job_path.parent / "handover")
    watch = asyncio.run_coroutine_threadsafe(ctx.heartbeat_forever(), runtime.loop)
    outcome_path = job_path.parent / f"outcome-{rank}.json"
    threading.Thread(
        target=_exit_when_stuck, args=(ctx, outcome_path), name="rank-watchdog", daemon=True
    ).start()
    try:
        said = {"outcome": "completed", "final": str(_train(ctx, job))}
    except StopRequested as stop:
        said = {"outcome": stop.status.value}
    except HandOver:
        said = {"outcome": "handover"}
    except LeaseLost:
        said = {"outcome": "lost"}
    except FollowedRankZero as exc:
        said = {"outcome": "followed", "error": str(exc)}
    except AttemptEnded as exc:  # a vLLM server gone, say: the run resumes later
        said = {"outcome": "attempt-ended", "error": str(exc), "due_now": exc.due_now}
    except SystemExit:
        said = {"outcome": "terminated"}
    except BaseException as exc:
        log.exception("rank %d failed", rank)
        said = {
            "outcome": "error",
            "error": f"{type(exc).__name__}: {exc}"[:4000],
            "traceback": traceback.format_exc()[-8000:],
        }
    finally:
        watch.cancel()
        _say(outcome_path, said)
    return 1 if said["outcome"] == "error" else 0


def _say(path: Path, said: dict[str, Any]) -> None:
    """This rank's outcome, written whole (the worker may read it at any moment)."""
    said["at"] = time.time()
    path.with_suffix(".tmp").write_text(json.dumps(said))
    os.replace(path.with_suffix(".tmp"), path)


def _exit_when_stuck(ctx: RankContext, path: Path) -> None:
    """The lease is gone (the worker died, or another holds the run) and this rank has not
    stopped a lease's time later: it is stuck in a collective with a peer that is gone, and
    would wait there for gloo's or NCCL's timeout. End it now."""
    while not ctx.lost:
        time.sleep(ctx.settings.heartbeat_seconds)
    time.sleep(ctx.settings.lease_ttl_seconds)
    log.error("run %s: the lease is gone and this rank is stuck; exiting", ctx.run_id)
    _say(path, {"outcome": "lost"})
    os._exit(3)


def _train(ctx: RankContext, job: Job) -> Path:
    from workers.pipeline.training import train
    from workers.rewards import make_scorer

    spec = RunSpec.of(ctx.runtime.run(ctx.load()))
    return train(
        ctx,
        spec,
        job.plan,
        job.validation,
        make_scorer(spec.reward),
        RunPaths(job.settings.artifacts / str(job.run_id)),
        job.resume_from,
        None,
        job.model,
    )


if __name__ == "__main__":
    raise SystemExit(main())
