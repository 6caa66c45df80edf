"""Every preset under configs/ is a valid run, and dotted overrides do what they say."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core.config_files import apply_overrides, load_preset
from app.runs.schemas import RunCreate

PRESETS = sorted((Path(__file__).resolve().parent.parent / "configs" / "runs").glob("*.yaml"))


@pytest.mark.parametrize("preset", PRESETS, ids=[p.stem for p in PRESETS])
def test_presets_validate(preset: Path) -> None:
    RunCreate.model_validate(load_preset(preset))


def test_overrides_set_nested_values_as_yaml_scalars() -> None:
    data = {"grpo": {"beta": 0.04}, "model_name": "m"}
    out = apply_overrides(data, ["grpo.beta=0", "grpo.lora.r=8", "max_steps=10", "x.y=[1, 2]"])
    assert out == {
        "grpo": {"beta": 0, "lora": {"r": 8}},
        "model_name": "m",
        "max_steps": 10,
        "x": {"y": [1, 2]},
    }
    assert data == {"grpo": {"beta": 0.04}, "model_name": "m"}  # the preset is not mutated


def test_bad_override_is_explained() -> None:
    with pytest.raises(ValueError, match=r"key\.path=value"):
        apply_overrides({}, ["no-equals-sign"])
