"""Rollouts generated ahead of the step that trains on them (``grpo.async_rollouts``,
docs/async.md): a LoRA run on vLLM servers whose servers generate the next steps while the
trainer trains this one.

A producer thread walks the plan. Step ``s`` (1-based) is admitted once the trainer has
saved the adapter of step ``s - 1 - max_staleness`` or later: it loads the newest saved
adapter into the servers, generates the step's groups with the seeds a synchronous run
would use, scores them with the run's scorer (a judge's seconds overlap training too), and
stores them (token ids, sampled log-probabilities, texts and rewards, the adapter's
version) in ``generated_rollouts`` before the trainer may take them. The trainer's rollout
function saves the adapter of its step (the newest version), waits for its step's rollouts
and hands them to TRL with their log-probabilities and rewards (the step's reward function,
:class:`~workers.pipeline.steps.StepBridge`, stores them as a synchronous step's and scores
nothing again); TRL's importance-sampling correction
(:class:`workers.pipeline.hooks.ServerTrainer`) weighs them by how far the trainer has moved
since. With ``max_staleness`` 0 nothing is generated before the step before is trained: a
synchronous run's steps.

A resumed attempt takes the stored rollouts of the steps after its checkpoint that its
history still holds: sampled by an adapter at or before the checkpoint's step and within the
bound. The others are discarded with the reason and counted; nothing stored is generated or
scored again.
Evaluations generate on the spot with the current adapter, as a synchronous run's do.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import transformers
from packaging.version import Version
from trl.chat_template_utils import parse_response

from app.rollouts import service as generated
from app.runs.lifecycle.state import json_param
from app.runs.spec.parsed import RunSpec
from workers.context import RunContext
from workers.ml.vllm_server import ServerRollouts
from workers.pipeline.admission import Admission
from workers.pipeline.plan import InputBatch, prompt_messages
from workers.pipeline.steps import Batch, StepBridge, build_groups

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ahead:
    """A step's rollouts, generated and scored: by which policy version, and how long each
    took (0 for a resumed attempt's, stored by an earlier one)."""

    version: int
    payload: dict[str, Any]
    texts: list[str]  # as TRL decodes the completions (not stored: decoded again)
    seconds: float  # generating
    scoring: float  # scoring


class RolloutsAhead:
    """TRL's ``rollout_func`` of an asynchronous run (see the module's docstring)."""

    def __init__(
        self,
        ctx: RunContext,
        spec: RunSpec,
        plan: list[InputBatch],
        adapters: Path,
        ranks: Any,
        bridge: StepBridge,
    ) -> None:
        assert spec.grpo.async_rollouts is not None
        self.ctx = ctx
        self.bridge = bridge  # scores the steps ahead, as it scores a synchronous run's
        self.plan = plan
        self.group = spec.rollouts_per_group
        self.bound = spec.grpo.async_rollouts.max_staleness
        self.prompt = lambda text: prompt_messages(spec.system_prompt, text)
        self.sync = ServerRollouts(str(spec.id), spec.grpo, adapters, ranks)
        self.servers = self.sync.servers
        self.admission: Admission[Ahead] = Admission(self.bound)
        self.stored: set[int] = set()  # steps whose rollouts an earlier attempt stored
        self.discarded = 0  # rollouts discarded, not yet reported in a step's metrics
        self.generating = threading.Lock()  # the producer's step, or an evaluation
        self.prompt_ids: dict[str, list[int]] = {}  # by input id
        self.tokenizer: Any = None  # the producer's own copy, to decode as TRL does
        self.parses = False  # whether TRL decodes with parse_response
        self.thread: threading.Thread | None = None

    def close(self) -> None:
        self.admission.close()
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
        # A cancel does not wait for the servers.
        got = self.admission.take(step, lambda: self.ctx.check(pause_ok=False))
        discarded, self.discarded = self.discarded, 0
        waited = time.monotonic() - began
        staleness = step - 1 - got.version
        assert 0 <= staleness <= self.bound, (step, got.version)
        for name, value in {
            "async/staleness": staleness,
            "async/generation_seconds": got.seconds,
            "async/scoring_seconds": got.scoring,
            "async/wait_seconds": waited,
            "async/discarded": discarded,
        }.items():
            trainer._log_metric(name, float(value))
        n = len(got.payload["completion_ids"])
        scored = [
            {**score, "text": text}
            for score, text in zip(got.payload["scored_ahead"], got.texts, strict=True)
        ]
        return {**got.payload, "scored_ahead": scored, "policy_version": [got.version] * n}

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
        self.tokenizer = copy.deepcopy(trainer.processing_class)
        self.parses = Version(transformers.__version__) >= Version("5.0.0") and (
            getattr(trainer._tokenizer, "response_template", None) is not None
            or getattr(trainer._tokenizer, "response_schema", None) is not None
        )
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
                payload = row.payload
                # jsonb has no NaN nor infinities: TRL takes NaN for a log-probability it
                # cannot use (an importance ratio of 1).
                payload["logprobs"] = [
                    [math.nan if x is None else x for x in lps] for lps in payload["logprobs"]
                ]
                texts = self._decode(payload["prompt_ids"], payload["completion_ids"])
                kept[row.step] = Ahead(row.policy_version, payload, texts, 0.0, 0.0)
                continue
            discard.append((row.id, row.rollouts, why))
        for reason in {why for _, _, why in discard}:
            ids = [i for i, _, why in discard if why == reason]
            self.ctx.runtime.run(self._discard(ids, reason))
        self.discarded = sum(n for _, n, _ in discard)
        self.admission.ready.update(kept)  # before the producer starts
        self.stored = set(kept)
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
                while step in self.stored:  # by an earlier attempt (the trainer may have
                    step += 1  # taken it already)
                if step > len(self.plan):
                    return
                # Admitted within the bound, and once this attempt saved an adapter (a
                # resumed one has none older than its checkpoint's).
                version = self.admission.admit(step)
                if version is None:
                    return
                self._generate(step, version)
                step += 1
        except BaseException as exc:  # the trainer raises it at its next step
            self.admission.fail(exc)

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
        began = time.monotonic()
        texts = self._decode(prompt_ids, completion_ids)
        scored = self._score(step, texts, completion_ids)
        scoring = time.monotonic() - began
        payload = {
            "prompt_ids": prompt_ids,
            "completion_ids": completion_ids,
            "logprobs": logprobs,
            "scored_ahead": scored,
        }
        # Serialized here, not on the runtime loop that heartbeats the lease.
        stored = json_param(payload)
        self.ctx.runtime.run(self._store(step, version, len(completion_ids), stored))
        log.info(
            "run %s: step %d generated ahead by the adapter of step %d in %.2f s, scored in %.2f s",
            self.ctx.run_id,
            step,
            version,
            seconds,
            scoring,
        )
        self.admission.put(step, Ahead(version, payload, texts, seconds, scoring))

    def _decode(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> list[str]:
        """The completions' texts as TRL decodes them for the reward function (with the
        producer's own copy of the tokenizer)."""
        if self.parses:
            return [
                parse_response(self.tokenizer, ids, prefix=prefix, tools=None)["content"]
                for prefix, ids in zip(prompt_ids, completion_ids, strict=True)
            ]
        return list(self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True))

    def _score(
        self, step: int, texts: list[str], completion_ids: list[list[int]]
    ) -> list[dict[str, Any]]:
        """The step's rollouts scored as the step's reward function would score them: each
        one's reward and breakdown."""
        items = self._items(step)
        batch = Batch(
            [self.prompt(item.input_text) for item in items],
            texts,
            [len(ids) for ids in completion_ids],
            [item.id for item in items],
            [json.dumps(item.context) for item in items],
        )
        scores = [s for row in self.bridge.score(build_groups(batch, self.group)) for s in row]
        return [{"reward": score.reward, "breakdown": score.breakdown} for score in scores]

    # -- storage ---------------------------------------------------------------------------
    async def _store(self, step: int, version: int, rollouts: int, payload: str) -> None:
        async with self.ctx.runtime.pg() as conn:
            await generated.store(
                conn, self.ctx.run_id, self.ctx.fence, step, version, rollouts, payload
            )

    async def _usable(self, after: int) -> list[generated.Generated]:
        async with self.ctx.runtime.pg() as conn:
            return await generated.usable(conn, self.ctx.run_id, after)

    async def _discard(self, ids: list[uuid.UUID], reason: str) -> None:
        async with self.ctx.runtime.pg() as conn:
            await generated.discard(conn, self.ctx.run_id, self.ctx.fence, ids, reason)
