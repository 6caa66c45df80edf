"""A finished episode's calls made into TRL's samples: prompt ids, completion ids, the
sampled tokens' log-probabilities and the mask of what the policy sampled (``env_mask``).

When every call's prompt extends the previous call's prompt and completion ids, the episode
is one sequence: the first prompt, then each completion (trained) and the tokens between
them (tool results, user turns: masked). When one does not (the harness edited or trimmed
its history, or the template renders the past differently), the episode is *split* there
into chains, each a sample of its own; they share the episode's advantage
(workers/pipeline/hooks.py:GatewayTrainer), and the episode's metadata says so. A call
asked again with the same prompt (a harness's retry) replaces the call it retries: the
harness never saw that answer, so the episode's reward does not speak for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StoredCall:
    prompt_ids: list[int]
    completion_ids: list[int]
    logprobs: list[float]


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    calls: int = 0  # the calls the sample holds

    @property
    def trained_tokens(self) -> int:
        return sum(self.env_mask)


def _start(call: StoredCall) -> Sample:
    n = len(call.completion_ids)
    return Sample(list(call.prompt_ids), list(call.completion_ids), list(call.logprobs), [1] * n, 1)


def stitch(calls: list[StoredCall]) -> list[Sample]:
    """The episode's samples, its chains of calls in order (``calls`` in order; at least
    one): a single sample unless the episode is split."""
    kept: list[StoredCall] = []
    for call in calls:
        if kept and call.prompt_ids == kept[-1].prompt_ids:
            kept.pop()  # retried: the answer the harness went on with is the later one
        kept.append(call)
    chains = [_start(kept[0])]
    so_far = [*kept[0].prompt_ids, *kept[0].completion_ids]
    for call in kept[1:]:
        sample = chains[-1]
        if call.prompt_ids[: len(so_far)] != so_far:
            chains.append(_start(call))
        else:
            between = call.prompt_ids[len(so_far) :]
            sample.completion_ids += [*between, *call.completion_ids]
            sample.logprobs += [0.0] * len(between) + list(call.logprobs)
            sample.env_mask += [0] * len(between) + [1] * len(call.completion_ids)
            sample.calls += 1
        so_far = [*call.prompt_ids, *call.completion_ids]
    return chains


_FUNCTION_KEYS = ("name", "description", "parameters", "return")
_SCHEMA_KEYS = ("type", "properties", "required")


def canonical_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools in one key order, the order transformers' ``get_json_schema`` writes (``type``,
    ``function``: ``name``, ``description``, ``parameters``: ``type``, ``properties``,
    ``required``; then anything else): a chat template renders tools as JSON text, and the
    same tools must render the same prompt whether they came from a Python function, a
    harness or a JSONB column (which sorts keys its own way)."""
    if not tools:
        return tools
    return [_ordered(tool, ("type", "function")) for tool in tools]


def _ordered(value: Any, first: tuple[str, ...]) -> Any:
    if not isinstance(value, dict):
        return value
    keys = [k for k in first if k in value] + [k for k in value if k not in first]
    out = {}
    for key in keys:
        item = value[key]
        if key == "function":
            item = _ordered(item, _FUNCTION_KEYS)
        elif key == "parameters":
            item = _ordered(item, _SCHEMA_KEYS)
        out[key] = item
    return out
