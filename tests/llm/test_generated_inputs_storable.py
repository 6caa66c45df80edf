"""Generated inputs follow the inline inputs' rules (app.core.limits, app.core.storable): one
the run could not have been given is skipped, not stored to fail the insert."""

from __future__ import annotations

from app.core.limits import MAX_INPUT_CHARS
from workers.generation.inputs import GeneratedInputs, _add, _Item


def test_inputs_too_long_or_with_nul_are_skipped() -> None:
    result = GeneratedInputs(inputs=[], system_prompt=None)
    items = [
        _Item(input_text="Say a."),
        _Item(input_text="nul \x00 inside"),
        _Item(input_text="x" * (MAX_INPUT_CHARS + 1)),
        _Item(input_text="y" * MAX_INPUT_CHARS),
    ]
    assert _add(result, set(), items, limit=10) == 2
    assert [i["input_text"][:6] for i in result.inputs] == ["Say a.", "yyyyyy"]
