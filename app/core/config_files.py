"""YAML presets merged with dotted overrides (``learning_rate=1e-5``, ``grpo.beta=0``).

>>> apply_overrides({"grpo": {"beta": 0.04}}, ["learning_rate=1e-5", "grpo.beta=0"])
{'grpo': {'beta': 0}, 'learning_rate': 1e-05}
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

# YAML 1.1 (PyYAML) reads 1e-5 as a string: it wants a dot in the mantissa (1.0e-5). The API
# takes numbers strictly, so a preset's `learning_rate: 1e-5` is read as YAML 1.2 reads it.
_FLOAT = re.compile(r"^[-+]?(\d+\.?\d*|\.\d+)[eE][-+]?\d+$")


class _Loader(yaml.SafeLoader):
    """PyYAML's safe loader, reading 1e-5 as a number."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", _FLOAT, list("-+0123456789."))


def _load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # a SafeLoader


def load_preset(path: Path) -> dict[str, Any]:
    data = _load(path.read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a preset must be a mapping at the top level")
    return data


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Set ``a.b.c=value`` paths (``grpo.temperature=0.7``); values are parsed as YAML
    scalars (1e-5, true, [1,2]). The paths are the run body's: ``learning_rate`` is a
    top-level field, not one of ``grpo``'s."""
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
        value = _load(raw)
        node[parts[-1]] = value
    return result
