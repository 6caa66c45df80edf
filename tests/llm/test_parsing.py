"""The lenient JSON parser on what real small models answer."""

from __future__ import annotations

import json

import pytest

from workers.llm import JSONExtractionError, parse_json_object, repair_truncated


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"a": 1}', {"a": 1}),
        ('  \n\n {"a": 1}  \n', {"a": 1}),
        ('\ufeff{"a": 1}', {"a": 1}),
        ('```json\n{"a": 1}\n```', {"a": 1}),
        ('```JSON\n{"a": 1}\n```', {"a": 1}),
        ('```\n{"a": 1}\n```', {"a": 1}),
        ('```json\n{"a": 1}', {"a": 1}),  # fence never closed
        ('Sure! Here it is:\n```json\n{"a": "x"}\n```\nAnything else {?}', {"a": "x"}),
        ('The scores are {"a": 1} as requested.', {"a": 1}),
        ('The scores are {"a": 1} and {"b": 2}', {"a": 1}),
        ('<think>maybe {"a": 2}?</think>\n{"a": 3}', {"a": 3}),
        ('<think>never closed, {"a": 2}', None),
        ('reasoning the template opened {"a": 2}</think>{"a": 3}', {"a": 3}),
        ('prose {with braces} then {"a": 1}', {"a": 1}),
        ('{"a": "line1\nline2\tand \x01 \x1f"}', {"a": "line1\nline2\tand \x01 \x1f"}),
        ('{"a": "it\\\'s"}', {"a": "it's"}),
        ('{"a": "C:\\path\\x"}', {"a": "C:\\path\\x"}),
        ('{"a": "ok \\"quoted\\" \\\\ \\u00e9"}', {"a": 'ok "quoted" \\ é'}),
        ('{"a": [1, 2,],}', {"a": [1, 2]}),
        ('```json\n{"a": "see ```x``` here"}\n```', {"a": "see ```x``` here"}),  # fence in a string
        ('{\n\n\n   "a"   :\n\n 1 \n\n\n}', {"a": 1}),
    ],
)
def test_parses(text: str, expected: dict[str, object] | None) -> None:
    if expected is None:
        with pytest.raises(JSONExtractionError):
            parse_json_object(text)
    else:
        assert parse_json_object(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # Cut inside a string value: the string is closed where it was cut.
        (
            '{"scores": [{"id": "1", "why": "this is cu',
            {"scores": [{"id": "1", "why": "this is cu"}]},
        ),
        # Cut after complete members: those are kept, the rest closed.
        (
            '{"scores": [{"id": "1", "s": 0.5}, {"id": "2", "s": 0.8}, ',
            {"scores": [{"id": "1", "s": 0.5}, {"id": "2", "s": 0.8}]},
        ),
        # A number at the very end may itself be cut (0.85 -> 0.8): dropped, not trusted.
        ('{"a": "x", "s": 0.8', {"a": "x"}),
        ('{"a": "x", "ok": tru', {"a": "x"}),
        # A key without its value is dropped.
        ('{"a": "x", "b', {"a": "x"}),
        ('{"a": "x", "b": ', {"a": "x"}),
        # A cut escape is dropped before closing the string.
        ('{"a": "x\\', {"a": "x"}),
        ('{"a": "x\\u00', {"a": "x"}),
        ('{"a": "x \\\\u00', {"a": "x \\u00"}),  # an escaped backslash, then plain text
        # Brackets and braces inside strings do not count.
        ('{"a": "say \\"hi\\" {not} ]", "b": [1,', {"a": 'say "hi" {not} ]', "b": [1]}),
        # Whitespace until max_tokens (guided decoding that wanders).
        ('{"a": 1,' + "\n" * 500, {"a": 1}),
        # Fenced and cut.
        ('```json\n{"a": {"b": 1}, "c": {"d": "cu', {"a": {"b": 1}, "c": {"d": "cu"}}),
    ],
)
def test_repairs_truncated(text: str, expected: dict[str, object]) -> None:
    assert parse_json_object(text) == expected


def test_truncated_answer_is_not_mistaken_for_its_first_inner_object() -> None:
    text = '{"scores": [{"id": "1", "s": 0.5}, {"id": "2", "s": 0.8}, {"id": "3", "s'
    assert parse_json_object(text) == {
        "scores": [{"id": "1", "s": 0.5}, {"id": "2", "s": 0.8}, {"id": "3"}]
    }


@pytest.mark.parametrize(
    "text",
    ["", "   ", "nothing here", "{", '{"a', "[1, 2, 3]", '"just a string"', "{not json}"],
)
def test_gives_up_clearly(text: str) -> None:
    with pytest.raises(JSONExtractionError, match="no JSON object"):
        parse_json_object(text)


def test_repair_truncated_returns_complete_objects_up_to_their_end() -> None:
    assert repair_truncated('{"a": [1, {"b": 2}]} trailing') == '{"a": [1, {"b": 2}]}'
    assert repair_truncated('{"a": [1, {"b": "x') == '{"a": [1, {"b": "x"}]}'
    assert repair_truncated("{") is None


def test_absurd_nesting_is_no_answer_not_a_crash() -> None:
    deep = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(JSONExtractionError):
        parse_json_object(deep)
    cut = '{"a": ' + "[" * 100_000
    with pytest.raises(JSONExtractionError):
        parse_json_object(cut)


def _is_prefix_of(part: object, whole: object) -> bool:
    """``part`` could have been read from a cut-off ``whole``: nothing invented or altered."""
    if isinstance(part, dict) and isinstance(whole, dict):
        return all(k in whole and _is_prefix_of(v, whole[k]) for k, v in part.items())
    if isinstance(part, list) and isinstance(whole, list):
        return len(part) <= len(whole) and all(
            _is_prefix_of(p, w) for p, w in zip(part, whole, strict=False)
        )
    if isinstance(part, str) and isinstance(whole, str):
        return whole.startswith(part)
    return type(part) is type(whole) and part == whole


def test_every_cut_of_an_answer_is_faithful_or_refused() -> None:
    answer = {
        "scores": [
            {"trajectory_id": "1", "explanation": 'Good: "x" {y} [z] \\ é\n', "score": 0.85},
            {"trajectory_id": "2", "explanation": "", "score": 1},
            {"trajectory_id": "3", "explanation": "wrong", "score": 0.0, "ok": False},
        ],
        "note": None,
        "nested": {"deep": [[1.5, -2e-3], {"t": True}]},
    }
    for text in (json.dumps(answer), json.dumps(answer, indent=2, ensure_ascii=False)):
        assert parse_json_object(text) == answer
        for cut in range(1, len(text)):
            try:
                got = parse_json_object(text[:cut])
            except JSONExtractionError:
                continue
            assert _is_prefix_of(got, answer), (cut, text[:cut], got)
