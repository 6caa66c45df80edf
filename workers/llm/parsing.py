"""Lenient extraction of one JSON object from an LLM's answer.

Even under a JSON schema, real small models served by vLLM produce answers that
``json.loads`` rejects: prose or a ```json fence around the object, a ``<think>`` block
first, raw control characters inside strings, invalid backslash escapes, trailing commas,
or an object cut off at ``max_tokens`` (often after a run of whitespace). Each of these
costs a judge call when it is treated as a failure, so we repair what can be repaired
without guessing at values: a truncated object keeps only its complete members (plus an
open string value, closed where it was cut), never a number or literal that may itself
have been cut short. Whether the result has the right *shape* is the caller's concern
(pydantic), not this module's.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

_DECODER = json.JSONDecoder(strict=False)  # strict=False: control characters in strings
_THINK = re.compile(r"<think>.*?(</think>|$)", re.DOTALL | re.IGNORECASE)
_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\n?(.*?)(?:```|$)", re.DOTALL)
_ESCAPE = re.compile(r"\\(.)", re.DOTALL)
_TRAILING_COMMA = re.compile(r",(\s*[}\]])")
_TOKEN_CHARS = frozenset("+-.0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
_MAX_STARTS = 32  # object starts tried per source; bounds the work on long prose


class JSONExtractionError(ValueError):
    """No JSON object could be recovered from the text."""


def parse_json_object(text: str) -> dict[str, Any]:
    """The first JSON object in ``text``, repaired if needed; raises JSONExtractionError.

    Every candidate (each fenced block, then the whole text) is tried as it is before any
    is repaired, so a fence inside a string value cannot pass a cut piece off as the answer.
    """
    cleaned = _THINK.sub("", text)
    if "</think>" in cleaned:  # templates that open the block themselves: reasoning first
        cleaned = cleaned.rsplit("</think>", 1)[1]
    cleaned = cleaned.replace("\ufeff", "").strip()
    sources = [m.group(1) for m in _FENCE.finditer(cleaned)]
    sources.append(cleaned)
    for repair in (False, True):
        for source in sources:
            found = _extract(source, repair=repair)
            if found is not None:
                return found
    snippet = text[:200].replace("\n", "\\n")
    raise JSONExtractionError(f"no JSON object found in the answer: {snippet!r}")


def _extract(source: str, *, repair: bool) -> dict[str, Any] | None:
    """The outermost object that parses (as is, or fixed, or closed if cut off).

    Objects nested in a broken one are skipped: when an answer is cut off, its first
    complete inner object (one score of many) must not pass for the answer.
    """
    skip_until = 0
    for start in _starts(source):
        if start < skip_until:
            continue
        found = _decode_object(source, start)
        if found is not None:
            return found
        scan = _scan(source[start:])
        if scan.end is not None:  # balanced but not JSON: prose in braces, say
            skip_until = start + scan.end
            continue
        if not repair:
            return None  # cut off: every later brace is inside it
        if scan.repaired is not None:
            try:
                value = _DECODER.decode(_fix_trailing_commas(_fix_escapes(scan.repaired)))
            except (ValueError, RecursionError):  # absurd nesting is no answer
                continue
            if isinstance(value, dict):
                return value
    return None


def _decode_object(text: str, start: int) -> dict[str, Any] | None:
    for fixer in (_identity, _fix_escapes, _fix_trailing_commas):
        try:
            value, _ = _DECODER.raw_decode(fixer(text[start:]))
        except (ValueError, RecursionError):  # absurd nesting is no answer
            continue
        if isinstance(value, dict):
            return value
    return None


def _identity(text: str) -> str:
    return text


def _fix_escapes(text: str) -> str:
    r"""Make invalid escapes literal: ``\'`` becomes ``'``, ``\x`` a backslash and ``x``."""
    return _ESCAPE.sub(_fix_escape, text)


def _fix_escape(match: re.Match[str]) -> str:
    char = match.group(1)
    if char in '"\\/bfnrtu':
        return match.group(0)
    return "'" if char == "'" else "\\\\" + char


def _fix_trailing_commas(text: str) -> str:
    # Could touch a string containing ", }"; only tried after the text failed as it was.
    return _TRAILING_COMMA.sub(r"\1", text)


def _starts(text: str) -> list[int]:
    starts: list[int] = []
    pos = text.find("{")
    while pos >= 0 and len(starts) < _MAX_STARTS:
        starts.append(pos)
        pos = text.find("{", pos + 1)
    return starts


def repair_truncated(text: str) -> str | None:
    """Close a JSON object cut off mid-way, keeping only what was complete.

    ``text`` starts at the object's ``{``. Returns it up to its closing brace if the object
    is complete; otherwise the longest prefix ending after a complete member (or inside an
    open string *value*, which is closed) followed by the closing brackets; None when
    nothing complete was found. A trailing number or literal is dropped, since ``0.8``
    cut to ``0`` would still parse and lie.
    """
    scan = _scan(text)
    return text[: scan.end] if scan.end is not None else scan.repaired


@dataclass(frozen=True)
class _Scan:
    end: int | None = None  # the object closes here (exclusive), or at a mismatched bracket
    repaired: str | None = None  # the object runs to the end of the text: closed like this


def _scan(text: str) -> _Scan:
    """Walk ``text`` (starting at ``{``) as JSON, tracking strings, brackets, safe cuts."""
    stack: list[str] = []
    in_string = escaped = string_is_key = expect_key = False
    safe: int | None = None  # a prefix ending after a complete value ...
    safe_depth = 0  # ... and how many brackets are open there. Every closing bracket makes
    # a safe point, so after the last one the stack only grows: its first safe_depth
    # entries are the ones open at the safe point (no copies: deep nesting stays linear).
    last_escape = -1
    i, n = 0, len(text)
    while i < n:
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped, last_escape = True, i
            elif ch == '"':
                in_string = False
                if not string_is_key:
                    safe, safe_depth = i + 1, len(stack)
            i += 1
            continue
        if ch == '"':
            in_string, escaped = True, False
            string_is_key = bool(stack) and stack[-1] == "{" and expect_key
        elif ch in "{[":
            stack.append(ch)
            expect_key = ch == "{"
        elif ch in "}]":
            if not stack or (stack[-1] == "{") != (ch == "}"):
                return _Scan(end=i + 1)
            stack.pop()
            if not stack:
                return _Scan(end=i + 1)
            safe, safe_depth = i + 1, len(stack)
        elif ch == ",":
            expect_key = bool(stack) and stack[-1] == "{"
        elif ch == ":":
            expect_key = False
        elif ch in _TOKEN_CHARS:
            j = i
            while j < n and text[j] in _TOKEN_CHARS:
                j += 1
            if j < n:  # something follows, so the token is complete
                safe, safe_depth = j, len(stack)
            i = j
            continue
        i += 1
    if not stack:
        return _Scan()
    if in_string and not string_is_key:
        body = text
        if escaped or (text[last_escape + 1 : last_escape + 2] == "u" and n - last_escape < 6):
            body = text[:last_escape]  # a cut escape: a lone backslash, or half a \uXXXX
        return _Scan(repaired=body + '"' + _closers(stack))
    if safe is None:
        return _Scan()
    return _Scan(repaired=text[:safe].rstrip().rstrip(",") + _closers(stack[:safe_depth]))


def _closers(stack: list[str]) -> str:
    return "".join("}" if c == "{" else "]" for c in reversed(stack))
