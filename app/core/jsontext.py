"""JSON text for what the service stores and passes between its processes.

pydantic-core's JSON (Rust) costs a fourth to a fifth of the standard library's on what goes
through the hot paths (a run's columns, a gateway call's token ids and log-probabilities),
with the same values back: floats round-trip exactly, big integers and non-ASCII text too,
NaN is written as the standard library writes it. It stops at 255 levels of nesting, where
the standard library goes on, so a value deeper than that falls back to it (a row stored
deep still reads and writes).
"""

from __future__ import annotations

import json
from typing import Any

import pydantic_core


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
