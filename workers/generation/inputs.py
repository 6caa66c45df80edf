"""Training inputs generated from a task description by an LLM, as ART's AutoRL does.

The model is asked for a batch of inputs at a time under a JSON schema, shown the inputs
it already gave (so it looks elsewhere), and its answers are deduplicated on normalised
text. A bad answer (unparseable, wrong shape, nothing new) costs one attempt of a bounded
budget; an endpoint that cannot be reached fails at once, since more attempts would only
wait longer for the same error.
"""

from __future__ import annotations

import math
import re
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict

from app.core.limits import MAX_INPUT_CHARS
from app.core.storable import unstorable
from workers.llm import AnswerRejected, ChatClient, Endpoint, LLMAnswerError, LLMError

_SHOWN_EXISTING = 30  # at most this many earlier inputs go back into the prompt
_SHOWN_CHARS = 300  # each cut to this length

INPUTS_PROMPT = """\
You write training inputs for an AI assistant that will be trained on this task:

<task>
{task}
</task>

Write {count} new, realistic and varied inputs: what a user (or the environment) would \
give the assistant for this task. Vary topic, difficulty, length and phrasing; each input \
must be complete and self-contained, and must not include the answer.{existing}

Answer with a JSON object {{"inputs": [{{"input_text": "..."}}, ...]}}."""

SYSTEM_PROMPT_PROMPT = """\
Write the system prompt for an AI assistant that will be trained on this task:

<task>
{task}
</task>

The system prompt tells the assistant its role, what to do with each input and the form \
of its answer, in a few clear sentences. Answer with a JSON object {{"system_prompt": "..."}}."""


class InputGenerationError(RuntimeError):
    """Not enough distinct inputs (or no system prompt) could be generated."""


@dataclass
class GeneratedInputs:
    inputs: list[dict[str, Any]]  # {"input_text": str, "context": None}
    system_prompt: str | None
    calls: int = 0  # input-generation calls made (each retried by the client on its own)
    bad_answers: int = 0  # calls that never gave a usable answer
    duplicates: int = 0  # inputs dropped as repeats (after normalisation)
    problems: list[str] = field(default_factory=list)


class _Item(BaseModel):
    model_config = ConfigDict(extra="ignore")

    input_text: str


class _InputsAnswer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    inputs: list[_Item]


class _SystemPromptAnswer(BaseModel):
    model_config = ConfigDict(extra="ignore")

    system_prompt: str


INPUTS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "inputs": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"input_text": {"type": "string"}},
                "required": ["input_text"],
                "additionalProperties": False,
            },
        }
    },
    "required": ["inputs"],
    "additionalProperties": False,
}
SYSTEM_PROMPT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"system_prompt": {"type": "string"}},
    "required": ["system_prompt"],
    "additionalProperties": False,
}

_SPACE = re.compile(r"\s+")
_EDGE_PUNCT = re.compile(r"^[\W_]+|[\W_]+$")


def normalise(text: str) -> str:
    """The form two inputs are compared in: NFKC, case-folded, spaces collapsed, and
    punctuation at either end dropped ("What is 2+2?" and "what is 2+2" are one input)."""
    text = _SPACE.sub(" ", unicodedata.normalize("NFKC", text).casefold()).strip()
    return _EDGE_PUNCT.sub("", text)


def generate_inputs(
    endpoint: Endpoint | Mapping[str, Any],
    task_description: str,
    num_examples: int,
    *,
    need_system_prompt: bool,
    seed: int,
    batch_size: int = 10,
    temperature: float = 1.0,
    min_examples: int | None = None,
    max_calls: int | None = None,
    backoff_s: float = 0.5,
) -> GeneratedInputs:
    """``num_examples`` distinct inputs for the task, and a system prompt if asked.

    ``endpoint``: an Endpoint, or a JudgeEndpoint's fields (base_url, model, api_key_env,
    ...); ``workers.llm.endpoints.resolve_endpoint`` gives the run's or the default judge.

    Calls are made until ``num_examples`` distinct inputs exist or ``max_calls`` (default:
    twice the batches needed, plus 3) are spent; then fewer than ``min_examples`` (default:
    half of ``num_examples``, at least 1) is an InputGenerationError, and anything more is
    returned (``len(result.inputs)`` says how many). Each call carries ``seed + call
    number``, so a run's generation is reproducible where the server honours seeds. An
    endpoint that fails in transport or HTTP (after the client's retries) or whose key
    variable is unset is an InputGenerationError at once.
    """
    if num_examples < 1:
        raise ValueError("num_examples must be at least 1")
    ep = Endpoint.from_spec(endpoint)
    batches = math.ceil(num_examples / batch_size)
    max_calls = max_calls if max_calls is not None else 2 * batches + 3
    min_examples = min_examples if min_examples is not None else max(1, math.ceil(num_examples / 2))
    result = GeneratedInputs(inputs=[], system_prompt=None)
    seen: set[str] = set()
    with ChatClient(ep, backoff_s=backoff_s) as client:
        if need_system_prompt:
            result.system_prompt = _system_prompt(client, task_description, seed)
        while len(result.inputs) < num_examples and result.calls < max_calls:
            count = min(batch_size, num_examples - len(result.inputs))
            messages = [
                {
                    "role": "user",
                    "content": INPUTS_PROMPT.format(
                        task=task_description.strip(),
                        count=count,
                        existing=_existing(result.inputs),
                    ),
                }
            ]
            result.calls += 1
            try:
                answer = client.structured(
                    messages,
                    name="training_inputs",
                    schema=INPUTS_SCHEMA,
                    model=_InputsAnswer,
                    temperature=temperature,
                    seed=seed + result.calls,
                )
            except LLMAnswerError as exc:
                result.bad_answers += 1
                result.problems.append(str(exc))
                continue
            except LLMError as exc:  # unreachable, HTTP errors, key unset: fail now
                raise InputGenerationError(
                    f"generating inputs with {ep.describe()} failed: {exc}"
                ) from exc
            added = _add(result, seen, answer.inputs, num_examples)
            if not added:
                result.problems.append(f"call {result.calls}: nothing new")
    if len(result.inputs) < min_examples:
        raise InputGenerationError(
            f"generated only {len(result.inputs)} distinct inputs of the {num_examples} asked "
            f"for (at least {min_examples} needed) in {result.calls} calls to "
            f"{ep.describe()}: {result.bad_answers} bad answers, {result.duplicates} "
            f"duplicates" + (f"; last problem: {result.problems[-1]}" if result.problems else "")
        )
    return result


def _add(result: GeneratedInputs, seen: set[str], items: list[_Item], limit: int) -> int:
    added = 0
    for item in items:
        text = item.input_text.strip()
        key = normalise(text)
        # What an inline input could not be (too long, NUL, which text cannot hold) is
        # skipped, not stored to fail the insert.
        if not key or len(text) > MAX_INPUT_CHARS or unstorable(text):
            continue
        if key in seen:
            result.duplicates += 1
            continue
        if len(result.inputs) >= limit:
            break
        seen.add(key)
        result.inputs.append({"input_text": text, "context": None})
        added += 1
    return added


def _existing(inputs: list[dict[str, Any]]) -> str:
    if not inputs:
        return ""
    shown = "\n".join(f"- {i['input_text'][:_SHOWN_CHARS]}" for i in inputs[-_SHOWN_EXISTING:])
    return f"\n\nThese inputs exist already; write different ones:\n{shown}"


def _system_prompt(client: ChatClient, task_description: str, seed: int) -> str:
    try:
        answer = client.structured(
            [
                {
                    "role": "user",
                    "content": SYSTEM_PROMPT_PROMPT.format(task=task_description.strip()),
                }
            ],
            name="system_prompt",
            schema=SYSTEM_PROMPT_SCHEMA,
            model=_SystemPromptAnswer,
            temperature=0.0,
            seed=seed,
            validate=_non_empty,
        )
    except LLMError as exc:
        raise InputGenerationError(
            f"could not generate a system prompt with {client.endpoint.describe()}: {exc}"
        ) from exc
    return answer.system_prompt.strip()


def _non_empty(answer: _SystemPromptAnswer) -> None:
    if not answer.system_prompt.strip():
        raise AnswerRejected("the system prompt is empty")
