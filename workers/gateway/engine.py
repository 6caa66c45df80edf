"""Gateway calls answered by the policy in training, on the run's engine: ``transformers``
(the trainer's model), TRL's vLLM (``vllm-colocate``; ``vllm-server`` without LoRA), or vLLM
servers with the step's LoRA adapter loaded (``vllm-server`` with ``grpo.lora``).

Each call is an OpenAI chat request: messages (with tool calls and tool results), tools and
sampling parameters. Its prompt is rendered with the model's chat template the way TRL
renders one, except when it continues the episode's previous call: then the prompt is that
call's prompt and completion ids, exactly as sampled, plus the new messages' tokens (TRL's
own tool-loop rule, ``GRPOTrainer._get_tool_suffix_ids``), so a multi-turn episode is one
sequence whose every sampled token is the engine's. The reply holds the engine's prompt ids,
completion ids and the sampled tokens' log-probabilities (``log_softmax(logits /
temperature)``, TRL's definition), and the message parsed by TRL's ``parse_response`` (tool
calls by the chat template's response schema, as TRL parses them).

Calls with the same sampling parameters are generated together: one ``generate`` per group
of parameters (left-padded on transformers; vLLM batches them itself).
"""

from __future__ import annotations

import contextlib
import copy
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from workers.ml.vllm_server import LoraServers, request_seed

log = logging.getLogger(__name__)


class BadCall(ValueError):
    """A call the engine cannot answer as asked (its messages do not render, say)."""


def _text(content: Any) -> str:
    """A message's content as text: OpenAI's content parts joined."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(part.get("text", "")) for part in content if isinstance(part, dict))
    return str(content)


def template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI messages as chat templates (and TRL) take them: text content, tool-call
    arguments as objects, tool results named by their call's function."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message.get("role")
        if role == "developer":
            role = "system"
        item: dict[str, Any] = {"role": role, "content": _text(message.get("content"))}
        calls = []
        for call in message.get("tool_calls") or []:
            function = call.get("function") or {}
            arguments = function.get("arguments")
            if isinstance(arguments, str):
                with contextlib.suppress(ValueError):  # else kept as the model wrote it
                    arguments = json.loads(arguments) if arguments.strip() else {}
            name = str(function.get("name", ""))
            if call.get("id"):
                names[str(call["id"])] = name
            calls.append({"type": "function", "function": {"name": name, "arguments": arguments}})
        if calls:
            item["tool_calls"] = calls
        if role == "tool":
            item["name"] = message.get("name") or names.get(str(message.get("tool_call_id")), "")
        out.append(item)
    return out


def same_history(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Whether two template-ready message lists say the same (tool-call ids aside)."""
    return a == b


@dataclass
class Call:
    """One call to answer: what the API forwarded."""

    call_id: str
    episode_id: str
    reply_to: str
    request: dict[str, Any]
    messages: list[dict[str, Any]]  # template-ready
    tools: list[dict[str, Any]] | None
    prompt_ids: list[int] | None = None
    continued: bool = False  # the prompt extends the episode's previous call's ids
    seed: int | None = None  # the sampling seed, where the engine takes one per call
    seq: int = 0  # its number in its claim (the worker's; the API records it under it)
    sent_at: float | None = None  # when the API handed it over (its clock, time.time())


def call_seed(run_seed: int, phase: str, step: int, ask: dict[str, Any]) -> int | None:
    """A call's sampling seed: the harness's ``seed``, else one derived from the run's seed
    and the call's place (the step, the episode's slot in it, which claim, which call), so
    that the same run asks for the same samples again (None where the API did not say the
    place)."""
    asked = (ask.get("request") or {}).get("seed")
    if isinstance(asked, int) and not isinstance(asked, bool):
        return asked % 2**63
    if not isinstance(ask.get("slot"), int) or not isinstance(ask.get("seq"), int):
        return None
    return request_seed(
        run_seed, phase == "eval", step, ask["slot"], int(ask.get("issue", 0)), ask["seq"]
    )


class Engine:
    """Answers calls with the policy the trainer trains, on the run's engine: prompts rendered
    with TRL's rules, each completion cut and parsed the same way; subclasses sample."""

    #: The longest prompt the engine takes (None: no limit of its own).
    max_prompt_tokens: int | None = None

    def __init__(
        self, trainer: Any, max_completion_length: int, *, own_tokenizer: bool = False
    ) -> None:
        self.trainer = trainer
        self.tokenizer = trainer.processing_class
        self.max_completion_length = max_completion_length
        self.generations = 0  # model.generate calls made, for the calls-per-generation metric
        self.eos = set(trainer.eos_token_ids)
        self.pad = self.tokenizer.pad_token_id
        # What closes an assistant turn in the template (ChatML's <|im_end|>, Llama's
        # <|eot_id|>): the tokenizer's EOS.
        self.end_of_turn = int(
            self.tokenizer.eos_token_id
            if self.tokenizer.eos_token_id is not None
            else next(iter(self.eos))
        )
        from trl.chat_template_utils import (
            add_response_schema,
            get_training_chat_template,
            is_chat_template_prefix_preserving,
        )

        # TRL's rule for multi-turn training: a chat template that is not prefix-preserving
        # is replaced by TRL's training variant of it (the one an SFT warm-up trains on too).
        self.chat_template: str | None = getattr(trainer, "chat_template", None)
        if self.chat_template is None and not is_chat_template_prefix_preserving(self.tokenizer):
            self.chat_template = get_training_chat_template(self.tokenizer)
        if (
            getattr(self.tokenizer, "response_template", None) is None
            and getattr(self.tokenizer, "response_schema", None) is None
        ):
            try:
                add_response_schema(self.tokenizer)
            except ValueError:  # a template TRL cannot parse tool calls of: text answers only
                log.info("the chat template has no response schema: answers are text only")
        if own_tokenizer:
            # Calls answered in another thread than the trainer's (an asynchronous run's
            # producer): a fast tokenizer is not for two threads at once.
            self.tokenizer = copy.deepcopy(self.tokenizer)

    def prepare(self, trainer: Any) -> None:
        """Before a batch TRL hands the rollout function is served: the engine made to
        answer with the policy as it is now (where TRL does not do it itself)."""

    # -- prompts -------------------------------------------------------------------------------
    def _template(self, messages: list[dict[str, Any]], tools: Any, generation: bool) -> list[int]:
        trainer = self.trainer
        ids = self.tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            chat_template=self.chat_template,
            add_generation_prompt=generation,
            tokenize=True,
            return_dict=False,
            **(getattr(trainer, "chat_template_kwargs", None) or {}),
        )
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(t) for t in ids]

    def render(self, messages: list[dict[str, Any]], tools: Any) -> list[int]:
        try:
            return self._template(messages, tools, True)
        except Exception as exc:  # the template's own error, whatever its type
            raise BadCall(
                f"the messages do not render with the model's chat template: {exc}"
            ) from exc

    def continuation(self, new: list[dict[str, Any]], tools: Any) -> list[int]:
        """The ids of ``new`` messages (tool results, a user turn) and the next generation
        prompt, as they follow an assistant turn that ended with EOS: TRL's rule."""
        if new[0]["role"] == "tool":
            dummy_calls = [
                {"type": "function", "function": {"name": new[0]["name"], "arguments": {}}}
            ]
            assistant = {"role": "assistant", "content": "", "tool_calls": dummy_calls}
        else:
            assistant = {"role": "assistant", "content": "x"}
        dummy = [{"role": "user", "content": "dummy"}, assistant]
        prefix = self._template(dummy, tools, False)
        full = self._template(dummy + new, tools, True)
        ends = [i for i, t in enumerate(prefix) if t in self.eos]
        if ends:
            prefix = prefix[: ends[-1] + 1]
        if full[: len(prefix)] != prefix:
            raise BadCall("the chat template does not render the new messages after the last")
        return full[len(prefix) :]

    # -- generation ----------------------------------------------------------------------------
    def answer(self, calls: list[Call], policy_version: int) -> list[dict[str, Any]]:
        """Each call's reply, in order; calls with the same sampling parameters together."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for i, call in enumerate(calls):
            groups.setdefault(self._key(call.request), []).append(i)
        replies: list[dict[str, Any]] = [{}] * len(calls)
        for key, members in groups.items():
            began = time.time()
            started = time.monotonic()
            outs = self._generate([calls[i] for i in members], key)
            self.generations += 1
            ms = (time.monotonic() - started) * 1000
            for i, out in zip(members, outs, strict=True):
                replies[i] = {
                    **out,
                    "policy_version": policy_version,
                    "generation_ms": ms,
                    "generation_began": began,
                }
        return replies

    def _key(self, request: dict[str, Any]) -> tuple[Any, ...]:
        args = self.trainer.args
        asked = request.get("max_completion_tokens") or request.get("max_tokens")
        limit = self.max_completion_length
        stop = request.get("stop")
        stops = tuple([stop] if isinstance(stop, str) else stop or ())
        temperature = request.get("temperature")
        top_p = request.get("top_p")
        return (
            min(int(asked), limit) if asked else limit,
            float(args.temperature if temperature is None else temperature),
            float(args.top_p if top_p is None else top_p),
            stops,
        )

    def _cut(self, tokens: list[int], stops: tuple[str, ...], max_new: int) -> tuple[int, str]:
        """Where the completion ends (the EOS kept, as TRL keeps it) and why."""
        for i, t in enumerate(tokens):
            if t in self.eos:
                return i + 1, "stop"
            if stops:
                text = self.tokenizer.decode(tokens[: i + 1])
                if any(s in text for s in stops):
                    return i + 1, "stop"
        n = len(tokens)
        while n and tokens[n - 1] == self.pad and self.pad not in self.eos:
            n -= 1
        return n, "length" if n >= max_new else "stop"

    def _message(
        self, prompt: list[int], completion: list[int], tools: Any, stops: tuple[str, ...]
    ) -> dict[str, Any]:
        from trl.chat_template_utils import parse_response

        try:
            parsed = parse_response(self.tokenizer, completion, prefix=prompt, tools=tools)
        except Exception:  # a completion the schema cannot read: its text, as TRL falls back
            parsed = {"content": self.tokenizer.decode(completion, skip_special_tokens=True)}
        content = parsed.get("content")
        content = content if isinstance(content, str) else _text(content)
        for stop in stops:
            if stop in content:
                content = content[: content.index(stop)]
        calls = []
        for call in parsed.get("tool_calls") or []:
            function = call.get("function") or call
            arguments = function.get("arguments", {})
            calls.append({"name": str(function.get("name", "")), "arguments": arguments})
        return {"content": content, "tool_calls": calls}

    def check(self, prompt_ids: list[int]) -> None:
        """Refuse a prompt the engine cannot take (one call, not the batch it joins)."""
        limit = self.max_prompt_tokens
        if limit is not None and len(prompt_ids) >= limit:
            raise BadCall(
                f"the conversation is {len(prompt_ids)} tokens: the engine takes at most "
                f"{limit - 1} (grpo.vllm_max_model_len)"
            )

    def _generate(self, calls: list[Call], key: tuple[Any, ...]) -> list[dict[str, Any]]:
        max_new, _, _, stops = key
        prompts = [c.prompt_ids or [] for c in calls]
        replies = []
        seeds = [c.seed for c in calls]
        for prompt, call, (tokens, logps) in zip(
            prompts, calls, self._sample(prompts, key, seeds), strict=True
        ):
            n, reason = self._cut(tokens, stops, max_new)
            completion = tokens[:n]
            replies.append(
                {
                    "prompt_ids": prompt,
                    "completion_ids": completion,
                    "logprobs": [round(float(x), 6) for x in logps[:n]],
                    "finish_reason": reason,
                    "message": self._message(prompt, completion, call.tools, stops),
                    "continued": call.continued,
                }
            )
        return replies

    def _sample(
        self, prompts: list[list[int]], key: tuple[Any, ...], seeds: list[int | None]
    ) -> list[tuple[list[int], list[float]]]:
        """Each prompt's sampled tokens (up to ``key``'s limit, perhaps past where the
        completion ends) and each token's log-probability; ``seeds``, each call's seed, where
        the engine samples each call with its own (vLLM servers)."""
        raise NotImplementedError


class TransformersEngine(Engine):
    """Samples with the trainer's model and TRL's generation settings
    (``grpo.engine: transformers``)."""

    def _sample(
        self, prompts: list[list[int]], key: tuple[Any, ...], seeds: list[int | None]
    ) -> list[tuple[list[int], list[float]]]:
        from trl.models.utils import unwrap_model_for_generation

        max_new, temperature, top_p, stops = key
        trainer = self.trainer
        width = max(len(p) for p in prompts)
        pad = self.pad if self.pad is not None else next(iter(self.eos))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        config = trainer.generation_config.__class__.from_dict(trainer.generation_config.to_dict())
        config.max_new_tokens = max_new
        greedy = temperature <= 0
        config.do_sample = not greedy
        if not greedy:
            config.temperature = temperature
            config.top_p = top_p
        extra: dict[str, Any] = {}
        if stops:
            extra = {"stop_strings": list(stops), "tokenizer": self.tokenizer}
        device = trainer.accelerator.device
        with (
            unwrap_model_for_generation(
                trainer.model_wrapped,
                trainer.accelerator,
                gather_deepspeed3_params=trainer.args.ds3_gather_for_generation,
            ) as model,
            torch.no_grad(),
        ):
            out = model.generate(
                input_ids=ids.to(device),
                attention_mask=mask.to(device),
                generation_config=config,
                output_logits=True,
                return_dict_in_generate=True,
                **extra,
            )
        sequences = out.sequences[:, width:].cpu()
        logits = torch.stack(out.logits, dim=1).float().cpu()  # (batch, new, vocab)
        scale = temperature if temperature > 0 else 1.0
        logps = torch.log_softmax(logits / scale, dim=-1)
        chosen = logps.gather(-1, sequences.unsqueeze(-1)).squeeze(-1)
        return list(zip(sequences.tolist(), chosen.tolist(), strict=True))


class VLLMEngine(Engine):
    """Samples with TRL's vLLM (``grpo.engine: vllm-colocate``, in this process; or
    ``vllm-server`` without LoRA, TRL's server mode): TRL syncs the policy's weights into it
    before each batch it hands the rollout function, so every call is answered by the policy
    as it is. The log-probabilities are vLLM's of the sampled tokens after temperature
    (TRL's ``processed_logprobs``), the ones TRL's own vLLM rollouts train with."""

    def __init__(self, trainer: Any, max_completion_length: int) -> None:
        super().__init__(trainer, max_completion_length)
        generation = trainer.vllm_generation
        llm = getattr(generation, "llm", None)
        if llm is not None:  # colocate: the engine's own limit
            self.max_prompt_tokens = int(llm.llm_engine.model_config.max_model_len)
        elif trainer.args.vllm_max_model_length:
            self.max_prompt_tokens = int(trainer.args.vllm_max_model_length)

    def _sample(
        self, prompts: list[list[int]], key: tuple[Any, ...], seeds: list[int | None]
    ) -> list[tuple[list[int], list[float]]]:
        max_new, temperature, top_p, stops = key
        generation = self.trainer.vllm_generation
        # TRL's generate reads its sampling settings from these attributes, set from the
        # run's at start; a call's own (a group of calls that share them) stand in for one
        # generate, then the run's are put back.
        kept = {
            name: getattr(generation, name)
            for name in ("temperature", "top_p", "max_completion_length", "generation_kwargs")
        }
        generation.temperature = temperature
        generation.top_p = top_p
        generation.max_completion_length = max_new
        generation.generation_kwargs = {**(kept["generation_kwargs"] or {})}
        if stops:
            generation.generation_kwargs["stop"] = list(stops)
        try:
            _, completions, logprobs, _ = generation.generate(prompts, None, 1)
        finally:
            for name, value in kept.items():
                setattr(generation, name, value)
        return [
            (
                [int(t) for t in tokens],
                [float(lp[0]) if lp and lp[0] is not None else 0.0 for lp in per_token or []],
            )
            for tokens, per_token in zip(completions, logprobs or [[]] * len(prompts), strict=True)
        ]


class ServerEngine(Engine):
    """Samples on the run's vLLM servers with the policy's LoRA adapter as of this step
    (``grpo.engine: vllm-server`` with ``grpo.lora``): before each batch TRL hands the
    rollout function, the adapter is saved and loaded into every server under the step's
    name (workers/ml/vllm_server.py, as for TRL's own rollouts), so no call is answered by a
    stale one. Each call is one ``/v1/completions`` of its prompt's token ids with the call's
    seed (:func:`call_seed`), the calls of a batch sent together and spread over the servers
    (each batches what arrives together).
    The log-probabilities are what the servers return: TRL's definition (after temperature)
    when they run with ``--logprobs-mode processed_logprobs``."""

    def __init__(
        self,
        trainer: Any,
        max_completion_length: int,
        servers: LoraServers,
        *,
        own_tokenizer: bool = False,
    ) -> None:
        super().__init__(trainer, max_completion_length, own_tokenizer=own_tokenizer)
        self.servers = servers
        self.adapter: str | None = None
        self.sent = 0  # requests sent, so that consecutive batches start on another server
        self.max_prompt_tokens = servers.max_model_len()

    def prepare(self, trainer: Any) -> None:
        self.adapter = self.servers.sync(trainer)

    def use(self, version: int) -> None:
        """Answer with the adapter of policy ``version`` (saved by the trainer): an
        asynchronous run's producer, which does not touch the trainer."""
        self.adapter = self.servers.name(version)
        self.servers.load(self.adapter)

    def _sample(
        self, prompts: list[list[int]], key: tuple[Any, ...], seeds: list[int | None]
    ) -> list[tuple[list[int], list[float]]]:
        max_new, temperature, top_p, stops = key
        grpo = self.servers.grpo
        body: dict[str, Any] = {
            "model": self.adapter,
            "n": 1,
            "max_tokens": max_new,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": grpo.top_k or -1,
            "min_p": grpo.min_p or 0.0,
            "repetition_penalty": grpo.repetition_penalty,
        }
        if stops:
            body["stop"] = list(stops)
        pending = [
            self.servers.pool.submit(
                self.servers.complete,
                self.sent + i,
                {**body, "prompt": prompt, **({} if seed is None else {"seed": seed})},
            )
            for i, (prompt, seed) in enumerate(zip(prompts, seeds, strict=True))
        ]
        self.sent += len(prompts)
        return [future.result()[0] for future in pending]


def engine_for(
    trainer: Any,
    max_completion_length: int,
    servers: LoraServers | None = None,
    *,
    own_tokenizer: bool = False,
) -> Engine:
    """The run's engine: its vLLM servers when it trains a LoRA adapter on them (``servers``),
    vLLM when TRL runs one for the trainer, else transformers. ``own_tokenizer``: a copy of
    the trainer's, for calls answered outside the trainer's thread (servers only)."""
    if servers is not None:
        return ServerEngine(trainer, max_completion_length, servers, own_tokenizer=own_tokenizer)
    if getattr(trainer, "use_vllm", False):
        return VLLMEngine(trainer, max_completion_length)
    return TransformersEngine(trainer, max_completion_length)
