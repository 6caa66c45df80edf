"""What PostgreSQL can store, said in the OpenAPI document as well as checked.

Text and jsonb cannot hold NUL (U+0000) anywhere: not in a string, not in an object's key,
however deep. The models check it (a 422 naming the field); these markers put the same rule
into the JSON Schema of a field, so that a client, or a fuzzer, that follows the document
never sends what the API has to refuse:

- ``Annotated[str, NUL_FREE]``: the string matches :data:`NO_NUL`;
- ``Annotated[dict[str, Any], STORABLE_OBJECT]``: a JSON object whose keys and strings, at
  any depth, match it (``StorableJson`` in the document, defined recursively).

They change the document only; validation stays with the models' validators.
"""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import GetJsonSchemaHandler, TypeAdapter, WithJsonSchema
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema
from typing_extensions import TypeAliasType

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
        # pydantic writes a dict with constrained keys as patternProperties, which leaves
        # other keys unconstrained: say "every key" instead.
        definition["anyOf"] = [
            _object_of(branch["patternProperties"][NO_NUL])
            if "patternProperties" in branch
            else branch
            for branch in definition["anyOf"]
        ]
        extra = {k: v for k, v in base.items() if k not in ("type", "additionalProperties")}
        return {**_object_of(value), **extra}


NUL_FREE: Any = _NulFree()
STORABLE_OBJECT: Any = _StorableObject()
