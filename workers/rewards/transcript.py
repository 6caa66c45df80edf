"""How judges see conversations: messages as tagged blocks, plus the task's reference data.

Tags rather than JSON because small judges read prose better than escaped JSON strings;
the role is an attribute so a message that itself contains tags stays attributable.
"""

from __future__ import annotations

import json
from typing import Any

from workers.rewards.base import Group, Rollout


def message_text(message: dict[str, Any]) -> str:
    """A message's content as text (multimodal parts: their text parts; None: empty)."""
    content = message.get("content")
    if content is None:
        return ""
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) if isinstance(p, dict) else str(p) for p in content)
    return str(content)


def render_messages(messages: list[dict[str, Any]]) -> str:
    return "\n".join(
        f'<message role="{m.get("role", "unknown")}">\n{message_text(m)}\n</message>'
        for m in messages
    )


def conversation(rollout: Rollout) -> list[dict[str, Any]]:
    """The rollout's whole conversation: its prompt and the assistant's answer."""
    return [*rollout.prompt, {"role": "assistant", "content": rollout.completion}]


def shared_prefix(conversations: list[list[dict[str, Any]]]) -> int:
    """How many leading messages all conversations share, leaving each at least one own."""
    if not conversations:
        return 0
    limit = min(len(c) for c in conversations) - 1
    n = 0
    while n < limit and all(_same(c[n], conversations[0][n]) for c in conversations):
        n += 1
    return n


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.get("role") == b.get("role") and message_text(a) == message_text(b)


def reference_block(group: Group) -> str:
    """The task's context (e.g. a reference answer) for the judge, or '' when there is none."""
    if not group.context:
        return ""
    data = json.dumps(group.context, ensure_ascii=False, indent=2, default=str)
    return (
        "\n\n<reference>\nReference information about this task, for you as the judge only "
        f"(the assistant did not see it):\n{data}\n</reference>"
    )
