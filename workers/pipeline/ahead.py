"""Rollouts generated ahead of the step that trains on them (``grpo.async_rollouts``,
docs/async.md): a LoRA run on vLLM servers whose servers generate the next steps while the
trainer trains this one.

A producer thread walks the plan. Step ``s`` (1-based) is admitted once the trainer has
saved the adapter of step ``s - 1 - max_staleness`` or later: it loads the newest saved
adapter into the servers, generates the step's groups with the seeds a synchronous run
would use, and stores them (token ids, sampled log-probabilities, the adapter's version)
in ``generated_rollouts`` before the trainer may take them. The trainer's rollout function
saves the adapter of its step (the newest version), waits for its step's rollouts and hands
them to TRL with their log-probabilities; TRL's importance-sampling correction
(:class:`workers.pipeline.hooks.ServerTrainer`) weighs them by how far the trainer has moved
since. With ``max_staleness`` 0 nothing is generated before the step before is trained: a
synchronous run's steps.

A resumed attempt takes the stored rollouts of the steps after its checkpoint that its
history still holds: sampled by an adapter at or before the checkpoint's step and within the
bound. The others are discarded with the reason and counted; nothing stored is regenerated.
Evaluations generate on the spot with the current adapter, as a synchronous run's do.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.rollouts import service as generated
from app.runs.spec.parsed import RunSpec
from workers.context import RunContext
from workers.ml.vllm_server import ServerRollouts
from workers.pipeline.plan import InputBatch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ahead:
    """A step's rollouts, ready: by which policy version, and how long they took."""

    version: int
    payload: dict[str, Any]
    seconds: float


class RolloutsAhead:
    """TRL's ``rollout_func`` of an asynchronous run (see the module's docstring)."""

    def __init__(
        self, ctx: RunContext, spec: RunSpec, plan: list[InputBatch], adapters: Path, ranks: Any
    ) -> None:
        from workers.pipeline.training import prompt_messages

        assert spec.grpo.async_rollouts is not None
        self.ctx = ctx
        self.plan = plan
        self.group = spec.rollouts_per_group
        self.bound = spec.grpo.async_rollouts.max_staleness
        self.prompt = lambda text: prompt_messages(spec.system_prompt, text)
        self.sync = ServerRollouts(str(spec.id), spec.grpo, adapters, ranks)
        self.servers = self.sync.servers
        self.changed = threading.Condition()  # guards what follows
        self.ready: dict[int, Ahead] = {}
        self.saved = -1  # the newest adapter version the trainer saved
        self.failure: BaseException | None = None
        self.stopping = False
        self.discarded = 0  # rollouts discarded, not yet reported in a step's metrics
        self.generating = threading.Lock()  # the producer's step, or an evaluation
        self.prompt_ids: dict[str, list[int]] = {}  # by input id
        self.thread: threading.Thread | None = None

    def close(self) -> None:
        with self.changed:
            self.stopping = True
            self.changed.notify_all()
        self.sync.close()  # cancels what the producer waits for

    # -- TRL's hook ------------------------------------------------------------------------
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        if not trainer.model.training:
            with self.generating:  # the servers' adapter is the trainer's for its while
                return self.sync(prompts, trainer)
        step = int(trainer.state.global_step) + 1
        if prompts != self._prompts(step):
            raise RuntimeError(f"step {step}: TRL's prompts are not the plan's (sampler order)")
        if self.thread is None:
            self._start(trainer, step)
        self.servers.save(trainer)  # the adapter of step - 1: the newest version
        began = time.monotonic()
        with self.changed:
            self.saved = step - 1
            self.changed.notify_all()
            while step not in self.ready and self.failure is None:
                self.changed.wait(0.25)
                self.ctx.check(pause_ok=False)  # a cancel does not wait for the servers
            if step not in self.ready:
                assert self.failure is not None
                raise self.failure
            got = self.ready.pop(step)
            discarded, self.discarded = self.discarded, 0
        waited = time.monotonic() - began
        staleness = step - 1 - got.version
        assert 0 <= staleness <= self.bound, (step, got.version)
        for name, value in {
            "async/staleness": staleness,
            "async/policy_version": got.version,
            "async/generation_seconds": got.seconds,
            "async/wait_seconds": waited,
            "async/discarded": discarded,
        }.items():
            trainer._log_metric(name, float(value))
        n = len(got.payload["completion_ids"])
        return {**got.payload, "policy_version": [got.version] * n}

    # -- the producer ----------------------------------------------------------------------
    def _prompts(self, step: int) -> list[Any]:
        return [self.prompt(item.input_text) for item in self._items(step)]

    def _items(self, step: int) -> list[Any]:
        return [item for item in self.plan[step - 1].items for _ in range(self.group)]

    def _start(self, trainer: Any, step: int) -> None:
        """Tokenize the plan's prompts (TRL's chat templating, in the trainer's thread: a
        tokenizer is not for two threads), take over what earlier attempts stored, and start
        the producer at ``step``."""
        unique = {item.id: item for batch in self.plan[step - 1 :] for item in batch.items}
        ids, _, _ = trainer._tokenize_prompts([self.prompt(i.input_text) for i in unique.values()])
        self.prompt_ids = dict(zip(unique, ids, strict=True))
        self._resume(step)
        self.thread = threading.Thread(
            target=self._produce, args=(step,), name="rollouts-ahead", daemon=True
        )
        self.thread.start()

    def _resume(self, step: int) -> None:
        """Keep the stored rollouts of steps from ``step`` on that this attempt's history
        holds; discard the others, saying why."""
        kept, discard = {}, []
        stored = self.ctx.runtime.run(self._usable(step - 1))
        for row in stored:
            if row.policy_version > step - 1:
                why = (
                    f"sampled by the adapter of step {row.policy_version}, which this attempt "
                    f"(resumed after step {step - 1}) trains again"
                )
            elif row.step - 1 - row.policy_version > self.bound:
                why = f"more than max_staleness {self.bound} versions behind its step"
            else:
                kept[row.step] = Ahead(row.policy_version, row.payload, 0.0)
                continue
            discard.append((row.id, row.rollouts, why))
        for reason in {why for _, _, why in discard}:
            ids = [i for i, _, why in discard if why == reason]
            self.ctx.runtime.run(self._discard(ids, reason))
        self.discarded = sum(n for _, n, _ in discard)
        self.ready.update(kept)
        if kept or discard:
            log.info(
                "run %s: resumed with the stored rollouts of steps %s; %d rollouts discarded",
                self.ctx.run_id,
                sorted(kept),
                self.discarded,
            )

    def _produce(self, step: int) -> None:
        try:
            while True:
                with self.changed:
                    while step in self.ready:  # stored by an earlier attempt
                        step += 1
                    # Admitted within the bound, and once this attempt saved an adapter (a
                    # resumed one has none older than its checkpoint's).
                    while not self.stopping and self.saved < max(step - 1 - self.bound, 0):
                        self.changed.wait()
                    if self.stopping or step > len(self.plan):
                        return
                    version = self.saved
                self._generate(step, version)
                step += 1
        except BaseException as exc:  # the trainer raises it at its next step
            with self.changed:
                if not self.stopping:
                    self.failure = exc
                self.changed.notify_all()

    def _generate(self, step: int, version: int) -> None:
        with self.generating:
            loaded = self.servers.loaded
            if loaded is not None:  # an evaluation may have loaded a newer one
                version = max(version, self.servers.version(loaded))
            adapter = self.servers.name(version)
            self.servers.load(adapter)
            began = time.monotonic()
            prompt_ids = [self.prompt_ids[item.id] for item in self._items(step)]
            completion_ids, logprobs = self.sync.generate(
                adapter, prompt_ids, step - 1, evaluation=False
            )
            seconds = time.monotonic() - began
        payload = {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}
        self.ctx.runtime.run(self._store(step, version, payload))
        log.info(
            "run %s: step %d generated ahead by the adapter of step %d in %.2f s",
            self.ctx.run_id,
            step,
            version,
            seconds,
        )
        with self.changed:
            self.ready[step] = Ahead(version, payload, seconds)
            self.changed.notify_all()

    # -- storage ---------------------------------------------------------------------------
    async def _store(self, step: int, version: int, payload: dict[str, Any]) -> None:
        async with self.ctx.runtime.pg() as conn:
            await generated.store(conn, self.ctx.run_id, self.ctx.fence, step, version, payload)

    async def _usable(self, after: int) -> list[generated.Generated]:
        async with self.ctx.runtime.pg() as conn:
            return await generated.usable(conn, self.ctx.run_id, after)

    async def _discard(self, ids: list[uuid.UUID], reason: str) -> None:
        async with self.ctx.runtime.pg() as conn:
            await generated.discard(conn, self.ctx.run_id, self.ctx.fence, ids, reason)
