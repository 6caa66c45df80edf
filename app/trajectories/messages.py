"""One trajectory message: what a rollout's ``messages`` hold, in the chat format TRL and
Hugging Face chat templates read, tool calls included.

It extends the reference's TrajectoryMessage (``role``, ``content``) compatibly: a
single-turn rollout is ``[system, user, assistant]`` as before, and an agent's episode adds
assistant messages with ``tool_calls`` and ``tool`` messages with their results (and, as
the workers store them, ``error``, ``duration_ms`` and ``truncated``). Keys it does not name
stay allowed, under the storable rules of free-form JSON, so older stored rows and other
producers' files still validate.

Requests validate with it (JSONL import, ``sft.examples``). Answers do not:
:data:`ServedMessages` documents ``TrajectoryPublic.messages`` as a list of these while
serving whatever a row holds, so a row written around the API never fails a page.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema
from pydantic_core import core_schema as cs

from app.core.errors import inconsistent
from app.core.storable import NulFreeStr, StorableObject, unstorable

MAX_CONTENT_CHARS = 1_000_000
MAX_TOOL_CALLS = 256


class _Open(BaseModel):
    """Named fields checked; other keys kept, under the rules of free-form JSON."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    @model_validator(mode="after")
    def _storable_extras(self) -> Self:
        reason = unstorable(self.__pydantic_extra__) if self.__pydantic_extra__ else None
        if reason:
            raise ValueError(reason)
        return self


class _ServedAsAnyArguments:
    """In answers, arguments are any object or string: served as stored, not re-checked.
    (Stating StorableJson there too would split it into an -Input and an -Output schema,
    recursive schemas never comparing equal.)"""

    def __get_pydantic_json_schema__(
        self, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        if handler.mode == "validation":
            return handler(core_schema)
        return {"anyOf": [{"type": "object"}, {"type": "string"}]}


class ToolFunction(_Open):
    name: NulFreeStr = Field(min_length=1, max_length=500, description="The tool called.")
    arguments: Annotated[StorableObject | NulFreeStr, _ServedAsAnyArguments()] = Field(
        description="Its arguments: an object (TRL's and Hugging Face's format) or a JSON "
        "string of one (OpenAI's)."
    )


class ToolCall(_Open):
    """One call an assistant message makes (``tool_calls[]``)."""

    id: NulFreeStr | None = Field(
        default=None, max_length=500, description="What the tool message's tool_call_id names."
    )
    type: Literal["function"] = "function"
    function: ToolFunction


class TrajectoryMessage(_Open):
    """A chat message of a rollout: the reference's (role, content), plus tool calls."""

    role: Literal["system", "user", "assistant", "tool"]
    content: NulFreeStr | None = Field(
        default=None,
        max_length=MAX_CONTENT_CHARS,
        description="The text; null on an assistant message that only calls tools. A tool "
        "message's is the tool's result (\"\" for none).",
    )
    tool_calls: list[ToolCall] | None = Field(
        default=None,
        max_length=MAX_TOOL_CALLS,
        description="The tools an assistant message calls; only on assistant messages.",
    )
    tool_call_id: NulFreeStr | None = Field(
        default=None, max_length=500, description="On a tool message: the call it answers."
    )
    name: NulFreeStr | None = Field(
        default=None, max_length=500, description="On a tool message: the tool that answered."
    )
    error: NulFreeStr | None = Field(
        default=None,
        max_length=MAX_CONTENT_CHARS,
        description="On a tool message: why the call failed (unknown tool, bad arguments, "
        "timeout, an exception); the content then says so to the model.",
    )
    duration_ms: float | None = Field(
        default=None, ge=0, description="On a tool message: how long the call took."
    )
    truncated: bool | None = Field(
        default=None,
        description="On a tool message: the result was longer than the environment's "
        "max_tool_output_chars, and was cut.",
    )

    @model_validator(mode="after")
    def _roles(self) -> Self:
        if self.tool_calls is not None and self.role != "assistant":
            raise inconsistent(f"tool_calls are only on assistant messages, not {self.role}")
        if self.role == "tool" and self.content is None:
            raise inconsistent('a tool message needs content (the result; "" for none)')
        return self


def dump_messages(messages: list[TrajectoryMessage]) -> list[dict[str, Any]]:
    """Messages as stored: exactly the keys each was given (explicit nulls included, no
    defaults added), so a file imported and exported again reads the same."""
    return [m.model_dump(mode="json", exclude_unset=True) for m in messages]


class _Documented:
    """The document's schema of served messages: a list of :class:`TrajectoryMessage`."""

    def __get_pydantic_json_schema__(
        self, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        base = handler(core_schema)
        items = handler(_MESSAGE)  # {"$ref": …/TrajectoryMessage}, defined once
        extra = {k: v for k, v in base.items() if k not in ("type", "items", "anyOf")}
        return {"anyOf": [{"type": "array", "items": items}, {"type": "null"}], **extra}


# A reference to the model, so the document defines TrajectoryMessage once (the model's own
# core schema would be written out inline here).
_MODEL = TrajectoryMessage.__pydantic_core_schema__
_MESSAGE = cs.definitions_schema(cs.definition_reference_schema(_MODEL["ref"]), [_MODEL])

# What an answer's ``messages`` is: documented as TrajectoryMessage items, served as stored
# (the service validated them on the way in; a row written by hand still renders).
ServedMessages = Annotated[list[Any] | None, _Documented()]
