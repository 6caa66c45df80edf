"""Calling LLMs over OpenAI-compatible HTTP: judges, input generation.

:class:`ChatClient` does the calls (key from an environment variable, timeouts, retries
with backoff, JSON-schema structured output); :func:`parse_json_object` recovers the JSON
object from what real models actually answer.
"""

from __future__ import annotations

from workers.llm.client import (
    AnswerRejected,
    ChatClient,
    Endpoint,
    LLMAnswerError,
    LLMCallError,
    LLMError,
    LLMUnavailable,
)
from workers.llm.parsing import JSONExtractionError, parse_json_object, repair_truncated

__all__ = [
    "AnswerRejected",
    "ChatClient",
    "Endpoint",
    "JSONExtractionError",
    "LLMAnswerError",
    "LLMCallError",
    "LLMError",
    "LLMUnavailable",
    "parse_json_object",
    "repair_truncated",
]
