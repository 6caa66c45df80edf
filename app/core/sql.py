"""Hand-written SQL for asyncpg: ``WHERE`` clauses built one filter at a time, and JSON
objects PostgreSQL renders in the shape of a response model."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from pydantic import BaseModel


class Where:
    """``WHERE`` clauses with ``$n`` parameters, built up one filter at a time."""

    def __init__(self, params: Sequence[Any] = ()) -> None:
        self.clauses: list[str] = []
        self.params: list[Any] = list(params)

    def param(self, value: Any) -> str:
        self.params.append(value)
        return f"${len(self.params)}"

    def add(self, clause: str) -> None:
        self.clauses.append(clause)

    def among(self, column: str, values: Sequence[Any], sql_type: str) -> None:
        """``column`` is one of ``values``: ``=`` for one value, so the planner can walk an
        index in order (``= ANY`` over several cannot)."""
        if len(values) == 1:
            self.add(f"{column} = {self.param(values[0])}")
        else:
            self.add(f"{column} = ANY({self.param(list(values))}::{sql_type}[])")

    def sql(self) -> str:
        return " AND ".join(self.clauses) if self.clauses else "true"


def json_object(model: type[BaseModel], expressions: Mapping[str, str] | None = None) -> str:
    """``json_build_object(...)`` of one ``model`` as the API shows it, for PostgreSQL to
    render: one key per field of the model, in its order, each the column of that name
    unless ``expressions`` gives its SQL.

    The keys come from the model, so the JSON has the fields its schema names and no
    others. The values are the caller's part: columns whose type renders as the field's
    JSON type (``bigint``/``integer`` a number, ``text``/``uuid`` a string, ``timestamptz``
    an RFC 3339 date-time, ``NOT NULL`` where the field is), and an expression narrowing
    any column wider than its field (a ``jsonb`` that must be an object). The tests of
    ``tests/api/test_response_schemas.py`` hold every answer to the document."""
    given = dict(expressions or {})
    unknown = set(given) - set(model.model_fields)
    if unknown:
        raise ValueError(f"{model.__name__} has no field {sorted(unknown)}")
    pairs = ", ".join(
        f"'{field.serialization_alias or name}', {given.get(name, name)}"
        for name, field in model.model_fields.items()
    )
    return f"json_build_object({pairs})"
