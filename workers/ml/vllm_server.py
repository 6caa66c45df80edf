"""Rollouts on vLLM servers a team already runs (``grpo.engine: vllm-server``).

Two ways, by what the run trains:

- **A LoRA adapter** (``grpo.lora``): the servers are plain ``vllm serve`` OpenAI servers
  started with ``--enable-lora`` and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True``. Before a
  step generates, rank 0 saves the policy's adapter to the run's folder (which the servers
  must read at the same path: shared storage) and loads it into every server under a name
  of that step (vLLM's runtime LoRA loading), unloading the step before's. Every rank then
  asks for its share of the rollouts by token ids through ``/v1/completions``, each group
  from one server, the groups spread over all of them. This is TRL's ``rollout_func``.
- **All the weights**: TRL's own server mode (``trl vllm-serve`` on one base URL), which
  broadcasts the weights over NCCL after every step: GPUs only.

Every request and every adapter load has the run's timeout and is retried within
``vllm_server_max_retries`` (the judges' client, workers/llm/client.py). A server still
failing after them ends the attempt with the reason (:class:`ServerUnavailable`): the run
goes back to the queue and resumes from its last checkpoint once a worker takes it again.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import logging
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from app.runs.spec.grpo import GrpoSettings
from workers.context import AttemptEnded
from workers.llm.client import AnswerRejected, ChatClient, Endpoint, LLMError

log = logging.getLogger(__name__)


def request_seed(run_seed: int, *place: int) -> int:
    """A request's sampling seed, from the run's seed and the request's place in the run
    (step, rank, group; or a gateway call's): the same run asks for the same samples again.
    Spread by a hash, not counted: vLLM seeds the ``n`` choices of a request ``seed``,
    ``seed + 1``, ..., so requests seeded 1, 2, 3 would share their choices' noise."""
    key = ",".join(str(int(part)) for part in (run_seed, *place)).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") % 2**31


def group_seed(run_seed: int, step: int, rank: int, group: int, *, evaluation: bool) -> int:
    """The seed of a LoRA run's group request: its step, rank and group, and for an
    evaluation one more place (an evaluation at step t and training step t + 1 generate at
    the same ``global_step``, and would otherwise draw the same noise). A training request's
    place is the three alone, so its seeds are what they were before evaluations had one."""
    return request_seed(run_seed, step, rank, group, *((1,) if evaluation else ()))


class ServerUnavailable(AttemptEnded):
    """A vLLM server did not answer within its retries: this attempt ends, the run resumes
    later (after the re-dispatch interval, not at once: the server may need a while)."""

    due_now = False


def _client(url: str, grpo: GrpoSettings, concurrency: int) -> ChatClient:
    return ChatClient(
        Endpoint(
            base_url=f"{url}/v1",
            model="",  # each request names its adapter
            timeout_s=grpo.vllm_server_timeout_s,
            max_retries=grpo.vllm_server_max_retries,
            max_concurrency=concurrency,
        )
    )


class WrongBaseModel(RuntimeError):
    """A server serves another model than the one the run's adapter is trained on."""


def check_servers(grpo: GrpoSettings, model_name: str) -> None:
    """Before any step: every server answers ``GET /v1/models`` (else the attempt ends), and
    serves ``model_name``, the base the adapter is loaded onto (else the run fails: an
    adapter of another model would not load, or would generate nonsense)."""
    for url in grpo.server_urls:
        with _client(url, grpo, 1) as client:
            try:
                listed = client.check()
            except LLMError as exc:
                raise ServerUnavailable(f"vLLM server {url}: {exc}") from exc
        bases = {str(m.get("root") or m.get("id")) for m in listed if not m.get("parent")}
        if bases and model_name not in bases:
            raise WrongBaseModel(
                f"vLLM server {url} serves {', '.join(sorted(bases))}, not the run's "
                f"model_name {model_name!r}: start it on that model (the same path or hub id)"
            )


class LoraServers:
    """The run's vLLM servers, serving the policy's adapter as of the trainer's step: the one
    place that saves it and loads it into them, for TRL's rollouts (:class:`ServerRollouts`)
    and for a gateway run's calls (workers/gateway/engine.py)."""

    def __init__(
        self, run_id: str, grpo: GrpoSettings, adapters: Path, ranks: Any, concurrency: int
    ) -> None:
        self.run_id = run_id
        self.grpo = grpo
        self.adapters = adapters
        self.ranks = ranks
        self.urls = grpo.server_urls
        self.clients = [_client(url, grpo, concurrency) for url in self.urls]
        self.loaded: str | None = None  # the adapter the servers generate with now
        self.loading = threading.Lock()  # an asynchronous run's producer and its evaluations
        self.pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max(1, concurrency), thread_name_prefix="vllm-server"
        )

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        for client in self.clients:
            client.close()

    def max_model_len(self) -> int | None:
        """The longest sequence (prompt and completion) every server takes, as their
        ``GET /v1/models`` says (None where none says)."""
        lengths = []
        for url, client in zip(self.urls, self.clients, strict=True):
            try:
                listed = client.check()
            except LLMError as exc:
                raise ServerUnavailable(f"vLLM server {url}: {exc}") from exc
            lengths += [int(m["max_model_len"]) for m in listed if m.get("max_model_len")]
        return min(lengths, default=None)

    @staticmethod
    def version(name: str) -> int:
        """The policy version (the trainer's step) an adapter name stands for."""
        return int(name.rpartition("-step-")[2])

    def name(self, step: int) -> str:
        return f"{self.run_id}-step-{step}"

    def sync(self, trainer: Any) -> str:
        """The name the servers know the policy's adapter by as of the trainer's step: saved
        by rank 0 and loaded into every server unless it is already; the previous one
        unloaded and deleted. Every rank waits for it."""
        name = self.name(int(trainer.state.global_step))
        if name == self.loaded:
            return name
        if self.ranks.writer:
            self.save(trainer)
        self.load(name)
        return name

    def save(self, trainer: Any) -> str:
        """Write the policy's adapter as of the trainer's step to the run's folder, under the
        name the servers will know it by (rank 0; the trainer's thread)."""
        name = self.name(int(trainer.state.global_step))
        trainer.model.save_pretrained(str(self.adapters / name))  # a PEFT model: the adapter
        return name

    def load(self, name: str) -> None:
        """Make ``name`` (saved) the adapter the servers generate with: loaded into every
        server by rank 0, the one before unloaded and its folder, and any older one's,
        deleted. Every rank waits for it."""
        with self.loading:
            if name == self.loaded:
                return
            if self.ranks.writer:
                folder = self.adapters / name
                for url, client in zip(self.urls, self.clients, strict=True):
                    self._call(
                        url,
                        client,
                        "/load_lora_adapter",
                        # In place: a resumed attempt loads its step's name again.
                        {"lora_name": name, "lora_path": str(folder), "load_inplace": True},
                    )
                    if self.loaded is not None:
                        self._call(url, client, "/unload_lora_adapter", {"lora_name": self.loaded})
                # No server reads an older one any more (an asynchronous run may have saved
                # versions it never loaded).
                for older in self.adapters.glob(f"{self.run_id}-step-*"):
                    if self.version(older.name) < self.version(name):
                        shutil.rmtree(older, ignore_errors=True)
                log.info(
                    "run %s: adapter %s loaded into %d server(s)", self.run_id, name, len(self.urls)
                )
            self.ranks.wait()
            self.loaded = name

    def _call(self, url: str, client: ChatClient, path: str, body: dict[str, Any]) -> None:
        try:
            client.post(path, body, lambda answer: answer)
        except LLMError as exc:
            raise ServerUnavailable(
                f"vLLM server {url}: {path} failed: {exc} (is it started with --enable-lora "
                "and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True, and can it read "
                f"{body.get('lora_path', 'the adapter folder')}?)"
            ) from exc

    def complete(self, server: int, body: dict[str, Any]) -> list[tuple[list[int], list[float]]]:
        """``POST /v1/completions`` of ``body`` (token ids in, ``n`` choices) on server
        ``server`` (modulo their number): each choice's token ids and log-probabilities."""
        client = self.clients[server % len(self.clients)]
        body = {**body, "logprobs": 0, "return_token_ids": True}
        try:
            return client.post("/completions", body, lambda answer: _choices(answer, body["n"]))
        except LLMError as exc:
            raise ServerUnavailable(f"vLLM server {client.endpoint.url}: {exc}") from exc


class ServerRollouts:
    """TRL's ``rollout_func`` for a LoRA run on vLLM servers (see the module's docstring)."""

    def __init__(self, run_id: str, grpo: GrpoSettings, adapters: Path, ranks: Any) -> None:
        self.run_id = run_id
        self.grpo = grpo
        self.ranks = ranks
        self.servers = LoraServers(run_id, grpo, adapters, ranks, grpo.groups_per_step)

    def close(self) -> None:
        self.servers.close()

    # -- TRL's hook ------------------------------------------------------------------------
    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, list[Any]]:
        """Completions for this rank's ``prompts`` (each group's prompt repeated once per
        rollout, as TRL's sampler hands them): token ids of prompts and completions, and the
        sampled tokens' log-probabilities."""
        step = int(trainer.state.global_step)
        started = time.monotonic()
        name = self.servers.sync(trainer)
        synced = time.monotonic()
        prompt_ids, _, _ = trainer._tokenize_prompts(prompts)  # TRL's own chat templating
        completion_ids, logprobs = self.generate(
            name, prompt_ids, step, evaluation=not trainer.model.training
        )
        log.info(
            "run %s: step %d: adapter synced in %.2f s, %d rollouts generated in %.2f s",
            self.run_id,
            step,
            synced - started,
            len(completion_ids),
            time.monotonic() - synced,
        )
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": logprobs}

    def generate(
        self, adapter: str, prompt_ids: list[list[int]], step: int, *, evaluation: bool
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Completions of ``prompt_ids`` (each group's prompt repeated once per rollout) by
        the loaded ``adapter``, seeded by their place (``step``: the trainer's global step
        when a synchronous run generates them): token ids and log-probabilities."""
        grpo = self.grpo
        calls = [
            self.servers.pool.submit(
                self.servers.complete,
                self.ranks.rank + i,
                {
                    "model": adapter,
                    "prompt": ids,
                    "n": n,
                    "max_tokens": grpo.max_completion_length,
                    "temperature": grpo.temperature,
                    "top_p": grpo.top_p,
                    "top_k": grpo.top_k or -1,
                    "min_p": grpo.min_p or 0.0,
                    "repetition_penalty": grpo.repetition_penalty,
                    "seed": group_seed(grpo.seed, step, self.ranks.rank, i, evaluation=evaluation),
                },
            )
            for i, (ids, n) in enumerate(_runs_of(prompt_ids))
        ]
        completion_ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        for call in calls:
            for ids, lps in call.result():
                completion_ids.append(ids)
                logprobs.append(lps)
        return completion_ids, logprobs


def _runs_of(prompt_ids: list[list[int]]) -> list[tuple[list[int], int]]:
    """Consecutive equal prompts, as (prompt, how many): one request of ``n`` each."""
    runs: list[tuple[list[int], int]] = []
    for ids in prompt_ids:
        if runs and runs[-1][0] == ids:
            runs[-1] = (ids, runs[-1][1] + 1)
        else:
            runs.append((ids, 1))
    return runs


def _choices(answer: Any, n: int) -> list[tuple[list[int], list[float]]]:
    """Each choice's token ids and their log-probabilities, in the order asked."""
    try:
        choices = sorted(answer["choices"], key=lambda c: c["index"])
        out = [
            ([int(t) for t in c["token_ids"]], [float(x) for x in c["logprobs"]["token_logprobs"]])
            for c in choices
        ]
    except (KeyError, TypeError, ValueError) as exc:
        raise AnswerRejected(
            f"a completion without token_ids or logprobs ({exc}): the server must be vLLM "
            "0.10.2 or later (return_token_ids)"
        ) from exc
    if len(out) != n or any(len(ids) != len(lps) for ids, lps in out):
        raise AnswerRejected(f"asked for {n} completions, got {len(out)} (or ragged logprobs)")
    return out
