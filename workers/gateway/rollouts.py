"""TRL's ``rollout_func`` of a gateway run: a step's rollouts are episodes that harnesses
play through the API while this worker answers their model calls.

For each batch TRL asks for (a training step, or an evaluation):

1. *open*: one ``episodes`` row per rollout (group and rollout index, the input, the run's
   prompt), unless a row is there already: a row a crashed attempt left is kept when it
   ended and its calls came from the weights this attempt has now (the checkpoint it
   resumed from); any other is handed out again. Then the API processes are told that
   episodes wait (a Redis channel), and harnesses claim them.
2. *serve*: pop the run's inbox (``app.gateway.wire``): calls are answered in batches by
   the engine (workers/gateway/engine.py), with the episode's history kept so the next call
   continues the last one's exact token ids; an episode that ended wakes the loop. Claims
   past their deadline are taken back and handed out again, up to ``max_issues``, then the
   episode is dropped. Cancel and a lost lease end the wait.
3. *samples*: each episode's calls of its last claim, stitched into TRL's prompt ids,
   completion ids, log-probabilities and ``env_mask`` (app/gateway/samples.py); a split
   episode's earlier chains go with it (``earlier_chains``) for GatewayTrainer to train
   with the episode's advantage; an episode without a reward is a rollout that has none
   (the run's dropped rollouts).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import redis

from app.core import jsontext
from app.core.embedded import redis_py_url
from app.core.services import redis_url
from app.gateway import service as episodes
from app.gateway import wire
from app.gateway.models import EpisodeStatus
from app.gateway.samples import Sample, StoredCall, canonical_tools, stitch
from app.observability import prometheus
from app.runs.spec.environments import GatewayEnvironment
from app.runs.spec.parsed import RunSpec
from workers.context import RunContext
from workers.gateway.engine import (
    BadCall,
    Call,
    Engine,
    ServerEngine,
    call_seed,
    engine_for,
    template_messages,
)
from workers.gateway.push import Pusher
from workers.ml.vllm_server import LoraServers
from workers.pipeline.admission import Admission
from workers.pipeline.plan import InputBatch, dataset_rows

log = logging.getLogger(__name__)

_OPEN_STATE = """
    SELECT count(*) FILTER (WHERE status IN ('pending', 'claimed')) AS open,
           count(*) FILTER (WHERE status = 'pending') AS pending,
           extract(epoch FROM min(deadline) FILTER (WHERE status = 'claimed') - now())
               AS next_deadline
      FROM episodes WHERE run_id = $1 AND phase = $2 AND step = $3
"""

_ENDED = """
    SELECT e.id, e.slot, e.status, e.issued, e.reward, e.metrics, e.messages, e.error,
           e.prompt,
           coalesce(array_agg(c.prompt_ids ORDER BY c.seq) FILTER (WHERE c.id IS NOT NULL),
                    '{}') AS prompts,
           coalesce(array_agg(c.completion_ids ORDER BY c.seq) FILTER (WHERE c.id IS NOT NULL),
                    '{}') AS completions,
           coalesce(array_agg(c.logprobs ORDER BY c.seq) FILTER (WHERE c.id IS NOT NULL),
                    '{}') AS logprobs,
           coalesce(array_agg(c.request ORDER BY c.seq) FILTER (WHERE c.id IS NOT NULL),
                    '{}') AS requests,
           coalesce(array_agg(c.response ORDER BY c.seq) FILTER (WHERE c.id IS NOT NULL),
                    '{}') AS responses,
           coalesce(array_agg(c.policy_version ORDER BY c.seq) FILTER (WHERE c.id IS NOT NULL),
                    '{}') AS versions
      FROM episodes e
      LEFT JOIN episode_calls c ON c.episode_id = e.id AND c.issue = e.issued
     WHERE e.run_id = $1 AND e.phase = $2 AND e.step = $3
     GROUP BY e.id
     ORDER BY e.slot
"""


class _Closed(Exception):
    """The rollout function was closed while it served (the attempt ends)."""


@dataclass(frozen=True)
class Served:
    """A batch served: TRL's rollouts, the policy versions of each episode's calls (those
    with calls), how many ended episodes of an earlier attempt were handed out again, and
    how long it took."""

    out: dict[str, list[Any]]
    versions: list[list[int]]
    discarded: int
    seconds: float


class HarnessOutcome:
    """What the ``environment`` reward function reads for a gateway rollout: the reward the
    harness gave (None: the rollout has none, and is dropped)."""

    def __init__(self, reward: float | None, failure: str | None) -> None:
        self.reward = reward
        self.failure = failure
        self.records: list[Any] = []

    def _reward(self, completion: str, messages: list[dict[str, Any]]) -> float | None:
        return self.reward


class GatewayRollouts:
    """TRL's ``rollout_func`` for a gateway run (see the module's docstring)."""

    def __init__(
        self,
        ctx: RunContext,
        spec: RunSpec,
        resumed_at: int | None,
        servers: LoraServers | None = None,
        plan: list[InputBatch] | None = None,
    ) -> None:
        assert isinstance(spec.environment, GatewayEnvironment)
        self.ctx = ctx
        self.spec = spec
        self.env = spec.environment
        self.resumed_at = resumed_at  # the checkpoint's step this attempt started from
        prefix = ctx.settings.broker_prefix
        self.redis = redis.Redis.from_url(redis_py_url(redis_url(ctx.settings)))
        self.inbox = wire.inbox(prefix, spec.id)
        self.available = wire.available(prefix, spec.id)
        self.engine: Engine | None = None
        self.servers = servers  # a LoRA run's vLLM servers: the engine that answers
        self.pusher: Pusher | None = None
        if self.env.push:  # the worker hands each episode to the run's harness
            url = self.env.harness_url
            assert url is not None, "the catalog's harness is resolved to its url on the worker"
            batch = spec.grpo.groups_per_step * spec.rollouts_per_group
            self.pusher = Pusher(
                ctx,
                str(spec.id),
                url,
                self.env.episode_timeout_seconds,
                min(64, batch),
                lambda message: self.redis.rpush(self.inbox, message),
            )
        # Per claim (episode, issue) of the batch served: the template messages and token ids
        # its last call ended with, and how many calls it made (numbered from 1, at most
        # max_calls; the API records each under its number).
        self.history: dict[tuple[str, int], tuple[list[dict[str, Any]], list[int], Any]] = {}
        self.seqs: dict[tuple[str, int], int] = {}
        # The batch's claims (episode, issue) an API process said ended: their calls are
        # refused at once (an API process that kept the claim would otherwise have one
        # generated for nothing). A claim's, not the episode's: an end of an earlier
        # attempt's claim may arrive after the episode was handed out again.
        self.ended: set[tuple[str, int]] = set()
        # When the last batch's answers went out (time.time()): a call handed over before
        # then waited for this worker.
        self.busy_until = 0.0
        # One batch is served at a time: an asynchronous run's producer serves the steps
        # ahead, and an evaluation waits for the step it is serving to end.
        self.serving = threading.Lock()
        ahead = spec.grpo.async_rollouts
        self.bound = ahead.max_staleness if ahead is not None else None
        self.plan = plan or []
        self.admission: Admission[Served] = Admission(self.bound or 0)  # closed: serving ends
        self.producer: threading.Thread | None = None

    def close(self) -> None:
        self.admission.close()
        if self.producer is not None:
            self.producer.join(timeout=10)  # its serving loop looks at `stopping` every second
        if self.pusher is not None:
            self.pusher.close()
        if self.servers is not None:
            self.servers.close()
        self.redis.close()

    # -- TRL's hook ------------------------------------------------------------------------
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        if self.engine is None:
            self.engine = engine_for(
                trainer,
                self.spec.grpo.max_completion_length,
                self.servers,
                own_tokenizer=self.bound is not None,
            )
        phase = "train" if trainer.model.training else "eval"
        version = int(trainer.state.global_step)
        if phase == "train" and self.bound is not None:
            return self._take(prompts, trainer, version + 1)
        step = version + 1 if phase == "train" else version
        with self.serving:
            self.engine.prepare(trainer)
            reuse = (version, version) if version == self.resumed_at else None
            return self._batch(phase, step, version, prompts, trainer.gateway_inputs, reuse).out

    def _batch(
        self,
        phase: str,
        step: int,
        version: int,
        prompts: list[Any],
        rows: list[dict[str, Any]],
        reuse: tuple[int, int] | None,
    ) -> Served:
        """Open the batch's episodes, serve their calls until each has ended, and make TRL's
        rollouts of them (with the serving lock held)."""
        assert self.engine is not None
        started = time.monotonic()
        generations = self.engine.generations
        discarded = self._open(phase, step, prompts, rows, reuse)
        if self.pusher is None:
            self.redis.publish(self.available, b"1")  # pull: the harnesses' claims wake
        served = self._serve(phase, step, version)
        generations = self.engine.generations - generations
        episodes = self.ctx.runtime.run(self._ended(phase, step))
        out = self._samples(episodes, prompts)
        for view in out["gateway"]:
            view["serving"] = {"calls": served, "generations": generations}
        seconds = time.monotonic() - started
        log.info(
            "run %s: %s step %d: %d episodes ended, %d calls answered in %d generations, %.2f s",
            self.spec.id,
            phase,
            step,
            len(episodes),
            served,
            generations,
            seconds,
        )
        self.history.clear()
        self.seqs.clear()
        self.ended.clear()
        versions = [list(row["versions"]) for row in episodes]
        return Served(out, [vs for vs in versions if vs], discarded, seconds)

    # -- an asynchronous run: the steps ahead --------------------------------------------------
    def _take(self, prompts: list[Any], trainer: Any, step: int) -> dict[str, list[Any]]:
        """A training step's rollouts on an asynchronous run: the adapter of the step before
        saved (the newest version, which admits the next steps), then the step's episodes
        as the producer served them."""
        assert self.servers is not None and self.bound is not None
        if prompts != self._prompts(step):
            raise RuntimeError(f"step {step}: TRL's prompts are not the plan's (sampler order)")
        if self.producer is None:
            self.producer = threading.Thread(
                target=self._produce, args=(step,), name="gateway-ahead", daemon=True
            )
            self.producer.start()
        self.servers.save(trainer)  # the adapter of step - 1
        began = time.monotonic()
        # A cancel does not wait for the harnesses.
        got = self.admission.take(step, lambda: self.ctx.check(pause_ok=False))
        waited = time.monotonic() - began
        oldest = min((min(vs) for vs in got.versions), default=step - 1)
        newest = max((max(vs) for vs in got.versions), default=step - 1)
        if not (step - 1 - self.bound <= oldest and newest <= step - 1):
            raise RuntimeError(f"step {step}: calls of policy versions {oldest}-{newest}")
        for name, value in {
            "async/staleness": step - 1 - oldest,
            "async/generation_seconds": got.seconds,
            "async/wait_seconds": waited,
            "async/discarded": got.discarded,
        }.items():
            trainer._log_metric(name, float(value))
        return got.out

    def _items(self, step: int) -> list[Any]:
        group = self.spec.rollouts_per_group
        return [item for item in self.plan[step - 1].items for _ in range(group)]

    def _prompts(self, step: int) -> list[Any]:
        return [row["prompt"] for row in dataset_rows(self.spec.system_prompt, self._items(step))]

    def _produce(self, step: int) -> None:
        """The producer thread: step after step, admitted once the trainer saved the adapter
        of ``step - 1 - max_staleness`` or later, served with the newest saved one."""
        try:
            while step <= len(self.plan):
                version = self.admission.admit(step)
                if version is None:
                    return
                self.admission.put(step, self._produce_step(step, version))
                step += 1
        except _Closed:
            return
        except BaseException as exc:  # the trainer raises it at its next step
            self.admission.fail(exc)

    def _produce_step(self, step: int, version: int) -> Served:
        assert self.bound is not None and self.servers is not None
        assert isinstance(self.engine, ServerEngine)
        with self.serving:
            loaded = self.servers.loaded
            if loaded is not None:  # an evaluation may have loaded a newer one
                version = max(version, self.servers.version(loaded))
            self.engine.use(version)
            rows = dataset_rows(self.spec.system_prompt, self._items(step))
            # An earlier attempt's ended episodes of this step are kept when their calls
            # came from versions this attempt's history holds (its checkpoint's or older),
            # within the bound.
            low = max(step - 1 - self.bound, 0)
            reuse = (low, self.resumed_at) if self.resumed_at is not None else None
            return self._batch("train", step, version, [r["prompt"] for r in rows], rows, reuse)

    # -- 1. open -------------------------------------------------------------------------------
    def _open(
        self,
        phase: str,
        step: int,
        prompts: list[Any],
        rows: list[dict[str, Any]],
        reuse: tuple[int, int] | None,
    ) -> int:
        """The batch's episodes opened; how many ended ones an earlier attempt left were
        handed out again (not reusable)."""
        g = self.spec.rollouts_per_group
        payload = [
            {
                "slot": i,
                "group_index": i // g,
                "rollout_index": i % g,
                "task_input_id": row.get("input_id"),
                "prompt": prompt,
                "context": jsontext.loads(row.get("context") or "{}") or {},
            }
            for i, (prompt, row) in enumerate(zip(prompts, rows, strict=True))
        ]
        fence = self.ctx.fence
        env = self.env

        async def open_rows() -> int:
            async with self.ctx.runtime.pg() as conn:
                return await episodes.open_step(
                    conn,
                    self.spec.id,
                    phase,
                    step,
                    fence,
                    reuse=reuse,
                    limits=(env.max_issues, env.max_calls, env.episode_timeout_seconds),
                    rows=payload,
                )

        return self.ctx.runtime.run(open_rows())

    # -- 2. serve ------------------------------------------------------------------------------
    def _serve(self, phase: str, step: int, version: int) -> int:
        """Answer calls until every episode of the batch has ended; the calls answered."""
        answered = 0
        refresh = True
        wait = 0.0
        while True:
            self.ctx.check(pause_ok=False)
            if self.admission.stopping:  # closed: the attempt ends
                raise _Closed
            if refresh:
                still_open, pending, next_deadline, reissued = self.ctx.runtime.run(
                    self._state(phase, step)
                )
                if not still_open:
                    return answered
                if self.pusher is not None and pending:
                    self.pusher.push_waiting(pending)
                elif reissued:
                    self.redis.publish(self.available, b"1")
                wait = 1.0 if next_deadline is None else min(1.0, max(0.05, next_deadline))
                checked = time.monotonic()
            popped = self.redis.blpop([self.inbox], timeout=wait)
            popped_at = time.time()
            messages = [popped[1]] if popped else []
            if popped:
                messages += self.redis.lpop(self.inbox, 255) or []
            calls = []
            ended = False
            for raw in messages:
                try:
                    message = wire.loads(raw)
                except ValueError:
                    continue
                if message.get("kind") == "call":
                    calls.append(message)
                elif message.get("kind") == "ended":
                    ended = True
                    self.ended.add((str(message.get("episode_id")), message.get("issue", -1)))
            if calls:
                answered += self._answer(calls, phase, step, version, popped_at)
            refresh = ended or not popped or time.monotonic() - checked > 0.5

    async def _state(self, phase: str, step: int) -> tuple[int, int, float | None, int]:
        async with self.ctx.runtime.pg() as conn:
            expired = await episodes.expire_claims(conn, self.spec.id, phase, step)
            state = await conn.fetchrow(_OPEN_STATE, self.spec.id, phase, step)
        reissued = sum(1 for status in expired if status == EpisodeStatus.pending)
        prometheus.GATEWAY_EPISODES.labels("expired").inc(len(expired))
        prometheus.GATEWAY_EPISODES.labels("dropped").inc(len(expired) - reissued)
        deadline = state["next_deadline"]
        return (
            int(state["open"]),
            int(state["pending"]),
            None if deadline is None else float(deadline),
            reissued,
        )

    def _answer(
        self, asks: list[dict[str, Any]], phase: str, step: int, version: int, popped_at: float
    ) -> int:
        """Answer one batch of calls (popped from the inbox at ``popped_at``)."""
        assert self.engine is not None
        calls: list[Call] = []
        pipe = self.redis.pipeline()
        for ask in asks:
            request = ask.get("request") or {}
            refused = self._number(ask, phase, step)
            if refused is not None:
                self._refuse(pipe, ask, *refused)
                continue
            try:
                call = Call(
                    call_id=str(ask["call_id"]),
                    episode_id=str(ask["episode_id"]),
                    reply_to=str(ask["reply_to"]),
                    request=request,
                    messages=template_messages(list(request.get("messages") or [])),
                    tools=canonical_tools(request.get("tools") or None),
                    seed=call_seed(self.spec.grpo.seed, phase, step, ask),
                    seq=ask["seq"],
                    sent_at=float(ask["sent_at"]) if ask.get("sent_at") else None,
                )
                self._prompt(call, int(ask.get("issue", 0)))
            except BadCall as exc:  # that call's 400
                self._refuse(pipe, ask, 400, str(exc))
                continue
            except (KeyError, TypeError, ValueError) as exc:
                log.warning("run %s: a gateway call that does not parse: %s", self.spec.id, exc)
                continue
            call.request["_issue"] = int(ask.get("issue", 0))
            calls.append(call)
        if calls:
            try:
                replies = self.engine.answer(calls, version)
            except Exception as exc:
                for call in calls:
                    failed = {"ok": False, "status": 500, "message": str(exc)[:500]}
                    self._reply(pipe, call.reply_to, {"call_id": call.call_id, **failed})
                pipe.execute()
                raise
            for call, reply in zip(calls, replies, strict=True):
                began = reply.pop("generation_began")
                reply["queued_ms"] = self._queued_ms(call.sent_at, popped_at, began)
                self._remember(call, reply)
                answer = {"call_id": call.call_id, "ok": True, "seq": call.seq, **reply}
                self._reply(pipe, call.reply_to, answer)
        pipe.execute()
        self.busy_until = time.time()
        return len(calls)

    def _queued_ms(self, sent_at: float | None, popped_at: float, began: float) -> float:
        """How long a call waited for the engine before its own generation began: from when
        the API handed it over (``sent_at``, the API's clock) if the worker was busy with
        the batch before, else from when it was popped; its batch's prompts rendered and
        the generations before its own included. The rest of its time before its answer is
        the gateway's own path: the API, the hops through Redis while the worker waited for
        work. Never below zero where the API's clock is another machine's."""
        waited_from = sent_at if sent_at is not None and sent_at < self.busy_until else popped_at
        return max(0.0, (began - waited_from) * 1000)

    def _number(self, ask: dict[str, Any], phase: str, step: int) -> tuple[int, str] | None:
        """Give the call its number in its claim (``ask["seq"]``), or the status and reason
        it is not answered: its episode is not of the batch served (a call that outlived its
        step), has ended, or the claim has made its ``max_calls``."""
        if (ask.get("phase"), ask.get("step")) != (phase, step):
            return 409, "The episode's step is over."
        try:
            claim = (str(ask["episode_id"]), int(ask["issue"]))
        except (KeyError, TypeError, ValueError):
            return 400, "A call without its claim."
        if claim in self.ended:
            return 409, "The episode has ended."
        made = self.seqs.get(claim, 0)
        if made >= self.env.max_calls:
            return 409, f"The episode has made its {self.env.max_calls} calls (max_calls)."
        self.seqs[claim] = ask["seq"] = made + 1
        return None

    def _refuse(self, pipe: Any, ask: dict[str, Any], status: int, message: str) -> None:
        """That call's error (the API matches replies by call_id)."""
        refused = {"call_id": ask.get("call_id"), "ok": False, "status": status}
        self._reply(pipe, str(ask.get("reply_to")), {**refused, "message": message})

    def _reply(self, pipe: Any, key: str, body: dict[str, Any]) -> None:
        pipe.rpush(key, wire.dumps(body))
        pipe.expire(key, wire.REPLY_TTL_SECONDS)

    def _prompt(self, call: Call, issue: int) -> None:
        """The call's prompt ids: the episode's last ids and the new messages' when the call
        continues the episode's last one (same history, same tools), else rendered whole."""
        assert self.engine is not None
        last = self.history.get((call.episode_id, issue))
        if last is not None:
            before, ids, tools = last
            new = call.messages[len(before) :]
            if (
                call.messages[: len(before)] == before
                and tools == call.tools
                and new
                and new[-1]["role"] != "assistant"
            ):
                call.prompt_ids = ids + self.engine.continuation(new, call.tools)
                call.continued = True
        if not call.continued:
            call.prompt_ids = self.engine.render(call.messages, call.tools)
        self.engine.check(call.prompt_ids)

    def _remember(self, call: Call, reply: dict[str, Any]) -> None:
        """The episode's history after this call: its messages with the answer, and the
        ids a next call continues from. A completion cut at its token limit did not end
        its turn: the template's end of turn (EOS) follows it there, a token the policy did
        not sample (masked, like a tool result)."""
        assert self.engine is not None
        ids = [*reply["prompt_ids"], *reply["completion_ids"]]
        if not reply["completion_ids"] or ids[-1] not in self.engine.eos:
            ids.append(self.engine.end_of_turn)
        message = reply["message"]
        assistant: dict[str, Any] = {"role": "assistant", "content": message["content"]}
        if message["tool_calls"]:
            assistant["tool_calls"] = [
                {"type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in message["tool_calls"]
            ]
        self.history[(call.episode_id, call.request["_issue"])] = (
            [*call.messages, assistant],
            ids,
            call.tools,
        )

    # -- 3. samples ----------------------------------------------------------------------------
    async def _ended(self, phase: str, step: int) -> list[Any]:
        async with self.ctx.runtime.pg() as conn:
            return list(await conn.fetch(_ENDED, self.spec.id, phase, step))

    def _samples(self, episodes: list[Any], prompts: list[Any]) -> dict[str, list[Any]]:
        assert self.engine is not None
        out: dict[str, list[Any]] = {
            "prompt_ids": [],
            "completion_ids": [],
            "logprobs": [],
            "env_mask": [],
            "earlier_chains": [],
            "gateway": [],
        }
        if len(episodes) != len(prompts):
            raise RuntimeError(f"{len(prompts)} rollouts asked, {len(episodes)} episodes found")
        eos = next(iter(self.engine.eos))
        for row, prompt in zip(episodes, prompts, strict=True):
            calls = [
                StoredCall(wire.unpack_ids(p), wire.unpack_ids(c), wire.unpack_floats(lp))
                for p, c, lp in zip(
                    row["prompts"], row["completions"], row["logprobs"], strict=True
                )
            ]
            failure = _failure(row, calls)
            if calls:
                chains = stitch(calls)
            else:  # nothing the policy sampled: a rollout without reward, trained on nothing
                chains = [
                    Sample(self.engine.render(template_messages(prompt), None), [eos], [0.0], [0])
                ]
            # The last chain is the rollout's row; the earlier ones of an episode with a
            # reward are rows of their own with its advantage (GatewayTrainer). An episode
            # without one trains on nothing: its advantage is zero.
            trained = chains if failure is None else chains[-1:]
            sample = chains[-1]
            out["prompt_ids"].append(sample.prompt_ids)
            out["completion_ids"].append(sample.completion_ids)
            out["logprobs"].append(sample.logprobs)
            out["env_mask"].append(sample.env_mask)
            out["earlier_chains"].append(trained[:-1])
            out["gateway"].append(_episode_view(row, chains, trained, calls, prompt, failure))
        return out


def _failure(row: Any, calls: list[StoredCall]) -> str | None:
    status = row["status"]
    if status == "failed":
        return f"the harness failed the episode: {row['error'] or 'no reason given'}"
    if status == "dropped":
        return str(row["error"])
    if row["reward"] is None:
        return "the harness finished the episode without a reward"
    if not calls:
        return "the harness finished the episode without calling the model"
    return None


def _conversation(row: Any, prompt: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The episode as stored with its trajectory: the harness's final messages if it sent
    them, else its last call's messages and answer; what repeats the run's prompt left out."""
    messages = row["messages"]
    if isinstance(messages, str):
        messages = jsontext.loads(messages)
    if not messages and row["requests"]:
        last_request = row["requests"][-1]
        last_response = row["responses"][-1]
        if isinstance(last_request, str):
            last_request = jsontext.loads(last_request)
            last_response = jsontext.loads(last_response)
        messages = [*last_request.get("messages", []), last_response.get("message", {})]
    messages = list(messages or [])
    n = 0
    while (
        n < len(prompt)
        and n < len(messages)
        and messages[n].get("role") == prompt[n]["role"]
        and (messages[n].get("content") == prompt[n]["content"])
    ):
        n += 1
    return messages[n:]


def _episode_view(
    row: Any,
    chains: list[Sample],
    trained: list[Sample],
    calls: list[StoredCall],
    prompt: list[dict[str, Any]],
    failure: str | None,
) -> dict[str, Any]:
    metrics = row["metrics"]
    if isinstance(metrics, str):
        metrics = jsontext.loads(metrics)
    messages = _conversation(row, prompt)
    final = ""
    for message in reversed(messages):
        if message.get("role") == "assistant":
            content = message.get("content")
            final = content if isinstance(content, str) else ""
            break
    versions = list(row["versions"])
    return {
        "episode_id": str(row["id"]),
        "reward": None if failure else row["reward"],
        "failure": failure,
        "messages": messages,
        "final": final,
        "metadata": {
            "episode_id": str(row["id"]),
            "episode_status": row["status"],
            "issues": int(row["issued"]),
            "calls": len(calls),
            "sequence": "split" if len(chains) > 1 else "one",
            "chains": len(chains),
            "trained_calls": sum(c.calls for c in trained),
            "trained_tokens": sum(c.trained_tokens for c in trained),
            "masked_tokens": sum(len(c.env_mask) - c.trained_tokens for c in trained),
            "policy_version": versions[-1] if versions else None,
            **({"harness_metrics": metrics} if metrics else {}),
        },
    }


def step_metrics(gateway: list[dict[str, Any]]) -> dict[str, float]:
    """A step's gateway numbers, charted with its other metrics: episodes dropped (never
    finished), failed (by the harness), handed out more than once, split, and calls."""
    meta = [g["metadata"] for g in gateway]
    n = max(1, len(meta))
    return {
        "gateway/episodes_dropped": float(sum(m["episode_status"] == "dropped" for m in meta)),
        "gateway/episodes_failed": float(sum(m["episode_status"] == "failed" for m in meta)),
        "gateway/episodes_reissued": float(sum(m["issues"] > 1 for m in meta)),
        "gateway/episodes_split": float(sum(m["sequence"] == "split" for m in meta)),
        "gateway/calls_per_episode": sum(m["calls"] for m in meta) / n,
        **_serving(gateway),
    }


def _serving(gateway: list[dict[str, Any]]) -> dict[str, float]:
    """How many calls each of the step's generations answered together."""
    serving = gateway[0].get("serving") if gateway else None
    if not serving or not serving["generations"]:
        return {}
    return {"gateway/calls_per_generation": serving["calls"] / serving["generations"]}
