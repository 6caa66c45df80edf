"""app.core.storable: the one place that says what PostgreSQL can store."""

from __future__ import annotations

import math

import pytest
from pydantic import BaseModel, ValidationError
from sqlalchemy import text

from app.core import jsontext
from app.core.limits import MAX_JSON_DEPTH, MAX_SERVED_DEPTH
from app.core.storable import (
    TOO_DEEP,
    FiniteFloat,
    NulFreeStr,
    PolicyTextObject,
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


async def test_jsonb_text_is_what_postgresql_takes_whatever_the_value_holds(sessionmaker) -> None:
    """A gateway call is recorded as it came: NUL characters (a young policy writes them,
    a client sends them back) and NaN (a client may send it) would make jsonb refuse the row
    and the call a 500."""
    deep: object = "end"
    for _ in range(300):  # deeper than pydantic-core writes
        deep = [deep]
    cases = [
        (
            {"content": "a\x00b", "k\x00": [math.nan, -math.inf, 1.5]},
            {"content": "a\ufffdb", "k\ufffd": [None, None, 1.5]},
        ),
        # The text's own backslash before the letters u0000 is left alone; a NUL after it not.
        ("\\u0000 \\\x00 \\\\u0000", "\\u0000 \\\ufffd \\\\u0000"),
        ({"plain": ["text", 1, True, None]}, {"plain": ["text", 1, True, None]}),
    ]
    async with sessionmaker() as s:
        for value, stored in cases:
            row = await s.scalar(text("SELECT CAST(:t AS jsonb)"), {"t": jsontext.jsonb(value)})
            assert row == stored
        row = await s.scalar(
            text("SELECT CAST(:t AS jsonb)"), {"t": jsontext.jsonb([deep, "\x00"])}
        )
    assert row == jsonable([deep, "\x00"])  # what an answer can hold of it


class _Finish(RequestModel):
    messages: list[PolicyTextObject]


def test_a_conversation_handed_back_keeps_what_the_policy_wrote_nul_as_u_fffd() -> None:
    said = {"role": "assistant", "content": "a\x00b", "tool_calls": [{"arguments": {"x\x00": 1}}]}
    assert _Finish(messages=[said]).messages == [
        {"role": "assistant", "content": "a\ufffdb", "tool_calls": [{"arguments": {"x\ufffd": 1}}]}
    ]
    deep: object = "\x00"
    for _ in range(MAX_JSON_DEPTH + 1):
        deep = [deep]
    for bad in ({"content": "\x00", "n": math.nan}, {"content": deep}):  # the other limits hold
        with pytest.raises(ValidationError):
            _Finish(messages=[bad])
