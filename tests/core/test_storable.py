"""app.core.storable: the one place that says what PostgreSQL can store."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel, ValidationError

from app.core.limits import MAX_SERVED_DEPTH
from app.core.storable import (
    TOO_DEEP,
    FiniteFloat,
    NulFreeStr,
    RequestModel,
    StorableObject,
    jsonable,
    storable_number,
    unstorable,
)


def test_jsonable_makes_what_the_service_produces_storable() -> None:
    value = {"k\x00": ["a\x00b", float("nan"), float("inf"), 1.5, 2, True, None, ("t",)]}
    assert jsonable(value) == {"k\ufffd": ["a\ufffdb", None, None, 1.5, 2, True, None, ["t"]]}


def test_jsonable_bounds_the_depth_of_what_it_stores() -> None:
    deep: object = 1
    for _ in range(5000):  # deeper than Python's recursion limit
        deep = [deep]
    stored = jsonable({"k": deep})
    levels = 0
    while isinstance(stored, dict | list):
        stored = stored["k"] if isinstance(stored, dict) else stored[0]
        levels += 1
    assert stored == TOO_DEEP and levels == MAX_SERVED_DEPTH
    assert unstorable(jsonable({"k": deep}), max_depth=MAX_SERVED_DEPTH) is None


def test_storable_number() -> None:
    assert storable_number(2) == 2.0 and storable_number(-1.5) == -1.5
    for bad in (float("nan"), float("-inf"), True, "1", None, [1]):
        assert storable_number(bad) is None


class _Body(RequestModel):
    text: NulFreeStr = "x"
    number: float = 0.0
    finite: FiniteFloat = 0.0
    data: StorableObject = {}


class _Loose(BaseModel):
    finite: FiniteFloat = 0.0


@pytest.mark.parametrize(
    ("fields", "where"),
    [
        ({"text": "a\x00"}, "text"),
        ({"number": math.inf}, "number"),
        ({"data": {"k": [math.nan]}}, "data"),
        ({"data": {"k\x00": 1}}, "data"),
        ({"surprise": 1}, "surprise"),
    ],
)
def test_the_types_refuse_what_cannot_be_stored(fields: dict, where: str) -> None:
    with pytest.raises(ValidationError) as caught:
        _Body.model_validate(fields)
    assert [e["loc"][0] for e in caught.value.errors()] == [where]


def test_finite_float_without_request_model() -> None:
    with pytest.raises(ValidationError):
        _Loose(finite=math.nan)
    assert _Loose(finite=1.0).finite == 1.0
