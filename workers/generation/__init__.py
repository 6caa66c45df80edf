"""Generating a run's training inputs (and system prompt) from its task description."""

from __future__ import annotations

from workers.generation.inputs import (
    GeneratedInputs,
    InputGenerationError,
    generate_inputs,
    normalise,
)

__all__ = ["GeneratedInputs", "InputGenerationError", "generate_inputs", "normalise"]
