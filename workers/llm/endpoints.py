"""Which endpoint a run's LLM work goes to: its own, or the workers' default judge."""

from __future__ import annotations

from typing import Any

from app.core.settings import Settings
from app.runs.spec.rewards import JudgeEndpoint
from workers.llm.client import Endpoint


def resolve_endpoint(
    spec: JudgeEndpoint | dict[str, Any] | None, settings: Settings, *, purpose: str
) -> tuple[Endpoint | None, str | None]:
    """The run's endpoint, else the workers' default judge; or None and why there is none.

    ``purpose`` completes the sentence "<purpose> needs an LLM endpoint", e.g. "RULER"."""
    if spec is not None:
        return Endpoint.from_spec(spec), None
    if settings.judge_base_url and settings.judge_model:
        return (
            Endpoint(
                base_url=settings.judge_base_url,
                model=settings.judge_model,
                api_key_env=settings.judge_api_key_env or None,
            ),
            None,
        )
    missing = [
        name
        for name, value in (
            ("TRAINYARD_JUDGE_BASE_URL", settings.judge_base_url),
            ("TRAINYARD_JUDGE_MODEL", settings.judge_model),
        )
        if not value
    ]
    return None, (
        f"{purpose} needs an LLM endpoint: the run names none and this worker has no default "
        f"judge ({' and '.join(missing)} unset)"
    )
