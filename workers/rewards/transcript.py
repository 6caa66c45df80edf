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


def render_message(message: dict[str, Any]) -> str:
    """One message as a tagged block; an agent's tool calls and results are shown as the
    model wrote and saw them (a failed call is marked)."""
    role = message.get("role", "unknown")
    attrs = f'role="{role}"'
    if role == "tool":
        if message.get("name"):
            attrs += f' name="{message["name"]}"'
        if message.get("error"):
            attrs += ' error="true"'
    body = message_text(message)
    for call in message.get("tool_calls") or []:
        function = call.get("function") or {}
        arguments = function.get("arguments")
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False, default=str)
        body += f'\n<tool_call name="{function.get("name", "")}">{arguments}</tool_call>'
    return f"<message {attrs}>\n{body}\n</message>"


def render_messages(messages: list[dict[str, Any]]) -> str:
    return "\n".join(render_message(m) for m in messages)


def conversation(rollout: Rollout) -> list[dict[str, Any]]:
    """The rollout's whole conversation: its prompt and what the model produced (every
    turn of an episode)."""
    return [*rollout.prompt, *rollout.response]


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
    return a.get("role") == b.get("role") and render_message(a) == render_message(b)


def reference_block(group: Group) -> str:
    """The task's context (e.g. a reference answer) for the judge, or '' when there is none."""
    if not group.context:
        return ""
    data = json.dumps(group.context, ensure_ascii=False, indent=2, default=str)
    return (
        "\n\n<reference>\nReference information about this task, for you as the judge only "
        f"(the assistant did not see it):\n{data}\n</reference>"
    )
