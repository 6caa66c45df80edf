"""What PostgreSQL can store: the one place that says it, checks it and makes it so.

Text and jsonb cannot hold NUL (U+0000) anywhere: not in a string, not in an object's key,
however deep. jsonb holds no NaN or Infinity (JSON has none; Python's parser lets them
through). And what the API accepts it must be able to serve back, so a free-form JSON value
nests at most :data:`~app.core.limits.MAX_JSON_DEPTH` levels.

For request models (a 422 naming the field, and the rule written into the OpenAPI document
so that a client, or a fuzzer, that follows it never sends what the API has to refuse):

- :data:`NulFreeStr`: a string without NUL;
- :data:`StorableObject`: a JSON object without NUL in its keys or strings, without
  non-finite numbers, and nested at most ``MAX_JSON_DEPTH`` deep;
- :data:`FiniteFloat`, or :class:`RequestModel` for every float of a model: no NaN/Infinity.

For answers: :data:`StoredObject`, a free-form object documented as StorableObject is.

For values the service produces itself (a young policy's output, a worker's metrics), which
are stored whatever they hold: :func:`jsonable` and :func:`storable_number`. For values read
back from the database: :func:`servable`, which makes any stored value renderable.

``NUL_FREE`` and ``STORABLE_OBJECT`` are the document-only markers the types are built from.
"""

from __future__ import annotations

import math
from typing import Annotated, Any, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    TypeAdapter,
    WithJsonSchema,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema
from typing_extensions import TypeAliasType

from app.core.limits import MAX_JSON_DEPTH, MAX_SERVED_DEPTH

# A regular expression that pydantic, JSON Schema and Python read alike.
NO_NUL = r"^[^\x00]*$"

_Text = Annotated[str, WithJsonSchema({"type": "string", "pattern": NO_NUL})]
# Any JSON value; its strings and keys match NO_NUL (recursive, hence the alias).
_StorableJson: Any = TypeAliasType(
    "StorableJson",
    Union[bool, int, float, _Text, list["_StorableJson"], dict[_Text, "_StorableJson"], None],  # type: ignore[misc]  # noqa: UP007
)
_VALUE = TypeAdapter[Any](_StorableJson).core_schema


def _object_of(value: JsonSchemaValue) -> JsonSchemaValue:
    return {"type": "object", "propertyNames": {"pattern": NO_NUL}, "additionalProperties": value}


def _any_storable(value: JsonSchemaValue) -> JsonSchemaValue:
    """StorableJson without a union: keywords that each apply to one kind of value (a
    string's ``pattern``, an array's ``items``, an object's keys and, under ``if``, values),
    so any JSON value of those rules matches, however deep. The same values as the union of
    seven branches that pydantic writes, but client generators read a recursive union as
    an error (openapi-python-client refuses it, and every model that uses it) where they
    read this as any value (openapi-python-client: ``Any``; openapi-typescript:
    ``unknown``). An object's values are under ``if`` because openapi-typescript reads a
    bare ``additionalProperties`` as "this is an object"."""
    return {
        "description": f"Any JSON value; no NUL in keys or strings, nested at most "
        f"{MAX_JSON_DEPTH} deep.",
        "pattern": NO_NUL,
        "items": value,
        "propertyNames": {"pattern": NO_NUL},
        "if": {"type": "object"},
        "then": {"additionalProperties": value},
    }


class _NulFree:
    def __get_pydantic_json_schema__(
        self, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        schema = handler(core_schema)
        if "pattern" in schema:
            schema.setdefault("allOf", []).append({"pattern": NO_NUL})
        else:
            schema["pattern"] = NO_NUL
        return schema


class _StorableObject:
    def __get_pydantic_json_schema__(
        self, core_schema: CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        base = handler(core_schema)  # keeps title, description … of the field
        value = handler(_VALUE)  # {"$ref": …/StorableJson}, defined once per document
        definition = handler.resolve_ref_schema(value)
        if "anyOf" in definition:  # pydantic's union, the first time the document needs it
            definition.clear()
            definition.update(_any_storable(value))
        extra = {k: v for k, v in base.items() if k not in ("type", "additionalProperties")}
        return {**_object_of(value), **extra}


NUL_FREE: Any = _NulFree()
STORABLE_OBJECT: Any = _StorableObject()


# --- checks ---------------------------------------------------------------------------------

NUL_MESSAGE = "must not contain NUL (\\u0000) characters"
NAN_MESSAGE = "must not contain NaN or Infinity"
DEPTH_MESSAGE = f"must not nest more than {MAX_JSON_DEPTH} levels deep"
_CONTAINERS = (dict, list, tuple)


def unstorable(value: Any, *, max_depth: int = MAX_JSON_DEPTH, nul: bool = False) -> str | None:
    """Why ``value`` cannot be stored and served back, or None; with ``nul``, NUL characters
    are not a reason (the caller replaces them). Iterative (a deep value cannot exhaust the
    stack) and lean: it runs for every line of a 100,000-line dataset."""
    kind = type(value)
    if kind is str:
        return NUL_MESSAGE if "\x00" in value and not nul else None
    if kind is float:
        return None if math.isfinite(value) else NAN_MESSAGE
    if kind not in _CONTAINERS:
        return None
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > max_depth:
            return DEPTH_MESSAGE
        if type(item) is dict:
            for key in item:
                if type(key) is str and "\x00" in key and not nul:
                    return NUL_MESSAGE
            children = item.values()
        else:
            children = item
        for child in children:
            t = type(child)
            if t is str:
                if "\x00" in child and not nul:
                    return NUL_MESSAGE
            elif t is float:
                if not math.isfinite(child):
                    return NAN_MESSAGE
            elif t in _CONTAINERS:
                stack.append((child, depth + 1))
    return None


def _nul_free(value: str) -> str:
    if "\x00" in value:
        raise ValueError(NUL_MESSAGE)
    return value


def _storable(value: Any) -> Any:
    reason = unstorable(value)
    if reason:
        raise ValueError(reason)
    return value


def _storable_but_nul(value: Any) -> Any:
    reason = unstorable(value, nul=True)
    if reason:
        raise ValueError(reason)
    return jsonable(value)  # within the limits: only NUL characters change


NulFreeStr = Annotated[str, NUL_FREE, AfterValidator(_nul_free)]
# An http(s) URL. One pattern that also refuses NUL, rather than a pattern on a NulFreeStr:
# in an optional field pydantic writes only NulFreeStr's pattern into the document, so
# clients (and the fuzzer) would not be told that the URL must start with http(s)://.
HTTP_URL_PATTERN = r"^https?://[^\x00]*$"
HttpUrlStr = Annotated[str, Field(pattern=HTTP_URL_PATTERN)]
StorableObject = Annotated[dict[str, Any], STORABLE_OBJECT, AfterValidator(_storable)]
# What a harness hands back of a conversation with the policy: a StorableObject, except that
# NUL characters (a young policy emits them, and the gateway sends them on as written) are
# stored as U+FFFD, not refused. Documented as a StorableObject: a client need not send them.
PolicyTextObject = Annotated[dict[str, Any], STORABLE_OBJECT, AfterValidator(_storable_but_nul)]
# In an answer: a stored free-form object, documented as what it holds (what StorableObject
# let in, or what jsonable made storable) and served as it is, without a check.
StoredObject = Annotated[dict[str, Any], STORABLE_OBJECT]
FiniteFloat = Annotated[float, Field(allow_inf_nan=False)]


def _strict_scalars(schema: Any) -> Any:
    """``schema`` (a pydantic core schema) with its number and boolean leaves strict, in
    place."""
    if isinstance(schema, dict):
        # Not "int": JSON Schema's integer takes 3.0, and so do the generated clients.
        if schema.get("type") in ("float", "bool"):
            schema["strict"] = True
        for key, value in schema.items():
            if key not in {"metadata", "serialization", "ref"}:
                _strict_scalars(value)
    elif isinstance(schema, list):
        for item in schema:
            _strict_scalars(item)
    return schema


class RequestModel(BaseModel):
    """A request body (or part of one): unknown fields are a 422, so a request cannot set
    what exists only on the table, and so are NaN and Infinity in any float field."""

    # Answers that show one (a run's reward, grpo …) show every field: in the answer-side
    # (serialization mode) schema, fields with defaults are `required` too.
    model_config = ConfigDict(
        extra="forbid", allow_inf_nan=False, json_schema_serialization_defaults_required=True
    )

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: type[BaseModel], handler: GetCoreSchemaHandler
    ) -> CoreSchema:
        """Numbers and booleans strict: a number field takes a number, a boolean field a
        boolean. Pydantic's lax mode takes ``false`` as 0.0, ``"0.5"`` as 0.5 and ``"yes"``
        as true; its strict mode for the whole model would also refuse an enum's value read
        from a YAML file or a stored row. Integer fields stay lax: JSON Schema's integer
        takes 3.0, which strict mode would refuse."""
        return _strict_scalars(handler(source))


# --- making values storable -----------------------------------------------------------------

# What stands in for the parts of a value nested deeper than an answer can hold.
TOO_DEEP = f"(nested deeper than {MAX_SERVED_DEPTH} levels: not shown)"


def jsonable(value: Any, *, max_depth: int = MAX_SERVED_DEPTH) -> Any:
    """``value`` as jsonb takes it and an answer can serve it, for what the service produces
    and must store whatever it holds: NUL characters (a young policy emits them happily)
    become U+FFFD, NaN and infinities null, and containers deeper than ``max_depth`` (a
    model's tool-call arguments can nest anyhow) :data:`TOO_DEEP`."""
    if isinstance(value, str):
        return value.replace("\x00", "\ufffd")
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list | tuple | dict):
        if max_depth <= 0:
            return TOO_DEEP
        if isinstance(value, dict):
            return {jsonable(k): jsonable(v, max_depth=max_depth - 1) for k, v in value.items()}
        return [jsonable(v, max_depth=max_depth - 1) for v in value]
    return value


def storable_number(value: object) -> float | None:
    """``value`` as a float8 column takes it: a finite number, else None (NaN, infinities,
    booleans and anything that is not a number)."""
    if type(value) is bool or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


# --- serving stored values ------------------------------------------------------------------


def servable(value: Any, *, max_depth: int = MAX_SERVED_DEPTH) -> Any:
    """A stored JSON value as an answer can render it: ``value`` itself (the same object)
    when it nests at most ``max_depth`` deep, else a copy whose deeper containers are
    replaced by :data:`TOO_DEEP`. Rows stored before the depth limit existed, or written
    around the API, then still answer instead of failing every page they are on."""
    if type(value) not in _CONTAINERS:
        return value
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        for child in item.values() if type(item) is dict else item:
            if type(child) in _CONTAINERS:
                if depth >= max_depth:
                    return _clip(value, max_depth)
                stack.append((child, depth + 1))
    return value


def _clip(value: Any, levels: int) -> Any:
    # Recursion is bounded by max_depth here: the walk stops where the clipping starts.
    if type(value) not in _CONTAINERS:
        return value
    if levels == 0:
        return TOO_DEEP
    if type(value) is dict:
        return {k: _clip(v, levels - 1) for k, v in value.items()}
    return [_clip(v, levels - 1) for v in value]
