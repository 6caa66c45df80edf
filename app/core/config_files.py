"""YAML presets merged with dotted overrides (``grpo.learning_rate=1e-5``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def load_preset(path: Path) -> dict[str, Any]:
    data = yaml.safe_load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a preset must be a mapping at the top level")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` paths; values are parsed as YAML scalars (1e-5, true, [1,2])."""
    result = dict(data)
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"override {item!r} is not of the form key.path=value")
        node = result
        parts = key.split(".")
        for part in parts[:-1]:
            child = node.get(part)
            node[part] = dict(child) if isinstance(child, dict) else {}
            node = node[part]
        node[parts[-1]] = yaml.safe_load(raw)
    return result
