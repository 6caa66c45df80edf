"""Every preset under configs/ is a valid run, and dotted overrides do what they say."""

from __future__ import annotations

from pathlib import Path

import pytest

from app.core.config_files import apply_overrides, load_preset
from app.runs.spec.body import RunCreate

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


def test_the_documented_overrides_make_a_valid_run() -> None:
    """The module's example (learning_rate is top-level; grpo.learning_rate used to be the
    example, and is a 422), with 1e-5 a number although PyYAML reads it as a string."""
    import doctest

    import app.core.config_files as module

    assert doctest.testmod(module).failed == 0
    preset = load_preset(PRESETS[0])
    run = RunCreate.model_validate(
        apply_overrides(preset, ["learning_rate=1e-5", "grpo.beta=0", "grpo.temperature=0.7"])
    )
    assert run.learning_rate == 1e-5 and run.grpo.beta == 0 and run.grpo.temperature == 0.7
    assert apply_overrides({}, ["a=1E+3", "b=-2.5e-3", "c=1e5x"]) == {
        "a": 1000.0,
        "b": -0.0025,
        "c": "1e5x",
    }
    with pytest.raises(ValueError, match=r"grpo\.learning_rate"):
        RunCreate.model_validate(apply_overrides(preset, ["grpo.learning_rate=1e-5"]))


def test_a_preset_reads_1e_5_as_a_number(tmp_path: Path) -> None:
    """The API takes numbers strictly ("1e-5" is a 422), so a preset is read as YAML 1.2
    reads it, not as PyYAML's YAML 1.1 would (a string)."""
    preset = tmp_path / "run.yaml"
    preset.write_text("learning_rate: 1e-5\ngrpo:\n  beta: 4E-2\nname: 1e5x\n")
    assert load_preset(preset) == {"learning_rate": 1e-5, "grpo": {"beta": 0.04}, "name": "1e5x"}


def test_every_setting_and_every_grpo_field_says_what_it_does() -> None:
    """Help text on every field, as TRL's GRPOConfig has: the settings (TRAINYARD_*), the
    run body's top level and its GRPO and LoRA settings."""
    from app.core.settings import Settings
    from app.runs.spec.grpo import GrpoSettings, LoraSettings

    for model in (Settings, GrpoSettings, LoraSettings, RunCreate):
        missing = [
            name
            for name, field in model.model_fields.items()
            if not (field.description or "").strip()
        ]
        assert not missing, f"{model.__name__}: no description for {missing}"


ACCELERATE = Path(__file__).resolve().parent.parent / "configs" / "accelerate"


def test_every_accelerate_config_a_run_can_name_is_shipped_and_loads() -> None:
    """configs/accelerate/ holds exactly the configs ``grpo.distributed.accelerate_config``
    accepts, each read by accelerate's own loader as the launcher will."""
    from typing import get_args

    from accelerate.commands.config.config_args import load_config_from_file

    from app.runs.spec.grpo import DistributedSettings

    names = get_args(DistributedSettings.model_fields["accelerate_config"].annotation)
    assert sorted(p.stem for p in ACCELERATE.glob("*.yaml")) == sorted(names)
    kinds = {}
    for name in names:
        config = load_config_from_file(str(ACCELERATE / f"{name}.yaml"))
        kinds[name] = (
            config.distributed_type.value,
            (config.deepspeed_config or {}).get("zero_stage"),
            (config.deepspeed_config or {}).get("offload_param_device"),
        )
    assert kinds == {
        "ddp": ("MULTI_GPU", None, None),
        "zero2": ("DEEPSPEED", 2, "none"),
        "zero3": ("DEEPSPEED", 3, "none"),
        "zero3-offload": ("DEEPSPEED", 3, "cpu"),
    }
