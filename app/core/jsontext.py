"""JSON text for what the service stores and passes between its processes.

pydantic-core's JSON (Rust) costs a fourth to a fifth of the standard library's on what goes
through the hot paths (a run's columns, a gateway call's token ids and log-probabilities),
with the same values back: floats round-trip exactly, big integers and non-ASCII text too,
NaN is written as the standard library writes it. It stops at 255 levels of nesting, where
the standard library goes on, so a value deeper than that falls back to it (a row stored
deep still reads and writes).

What the service records as it came (a gateway call's request and answer) goes through
:func:`jsonb`: PostgreSQL's jsonb refuses NUL characters and NaN, and a young policy emits
the first, a client may send both.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pydantic_core

from app.core.storable import jsonable

# A NUL character's escape in JSON text, ``\u0000``, after an even number of backslashes
# (escaped backslashes of the text); after an odd number, ``\\u0000`` is a backslash of
# the text followed by the letters u0000.
_NUL = re.compile(rb"(?<!\\)((?:\\\\)*)\\u0000")


def dumpb(value: Any) -> bytes:
    """``value`` as compact JSON bytes."""
    try:
        return pydantic_core.to_json(value)
    except ValueError:
        return json.dumps(value, separators=(",", ":")).encode()


def dumps(value: Any) -> str:
    """``value`` as compact JSON text."""
    return dumpb(value).decode()


def loads(text: str | bytes) -> Any:
    """The value of JSON ``text`` (a ``ValueError`` when it is not JSON)."""
    try:
        return pydantic_core.from_json(text)
    except ValueError:
        return json.loads(text)


def jsonb(value: Any) -> str:
    """``value`` as JSON text that jsonb takes, whatever it holds: NUL characters as U+FFFD,
    NaN and infinities as null (what :func:`app.core.storable.jsonable` makes of them),
    nothing else changed."""
    try:
        text = pydantic_core.to_json(value, inf_nan_mode="null")
    except ValueError:  # deeper than pydantic-core goes: what an answer can hold of it
        return json.dumps(jsonable(value), separators=(",", ":"), allow_nan=False)
    return (_NUL.sub(rb"\1\\ufffd", text) if b"\\u0000" in text else text).decode()
