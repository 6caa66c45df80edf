"""A multi-turn rollout as it is stored: every turn TRL's tool loop produced, each tool
message with what its environment recorded about the call, and the episode's counts.

TRL hands the reward function each rollout's completion as messages: assistant messages
(``tool_calls`` parsed by the chat template's response parser), the tool messages its loop
added (``{"role": "tool", "name", "content"}``) and the final answer. The tool calls get
ids, and each tool message is paired with its call and with the environment's
:class:`~workers.environments.safety.CallRecord` (duration, error, truncation). TRL calls
tools in order, so records and tool messages come in the same order; a call TRL refused
before reaching the environment (an unknown tool, arguments that are not an object) has no
record, and its error is TRL's message; a record is matched to a tool message by tool name
and outcome (TRL shows a failed call as ``{'error': message}``, the message the record
holds, whichever ``tool_errors`` style wrote it).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from workers.environments.safety import CallRecord


@dataclass(frozen=True, slots=True)
class Episode:
    messages: list[dict[str, Any]]  # the completion: from the first assistant message on
    final: str  # the last assistant message's content: the episode's answer
    counts: dict[str, Any]  # turns, tool calls (a gateway episode's: its calls, ids, ...)
    failure: str | None = None  # why the environment failed under the episode

    @property
    def metadata(self) -> dict[str, Any]:
        """The trajectory's metadata beyond a single-turn one's."""
        return {**self.counts, **({"episode_error": self.failure} if self.failure else {})}


def _trl_error(content: Any) -> str | None:
    """The message of TRL's ``{'error': ...}`` tool result, if it is one."""
    if isinstance(content, str) and content.startswith("{'error': "):
        try:
            value = ast.literal_eval(content)
        except (ValueError, SyntaxError):
            return None
        if isinstance(value, dict) and set(value) == {"error"}:
            return str(value["error"])
    return None


def build(
    completion: list[dict[str, Any]],
    records: list[CallRecord],
    tool_mask: list[int] | None,
    failure: str | None = None,
) -> Episode:
    messages: list[dict[str, Any]] = []
    pending: list[tuple[str, str]] = []  # (call id, tool name) not yet answered, in order
    queue = list(records)
    n_calls = 0
    final = ""
    for message in completion:
        role = message.get("role")
        if role == "assistant":
            content = message.get("content")
            content = content if isinstance(content, str) else ""
            stored: dict[str, Any] = {"role": "assistant", "content": content}
            calls = []
            for call in message.get("tool_calls") or []:
                n_calls += 1
                function = call.get("function") or {}
                call_id = f"call_{n_calls}"
                calls.append(
                    {
                        "id": call_id,
                        "type": "function",
                        "function": {
                            "name": str(function.get("name", "")),
                            "arguments": function.get("arguments", {}),
                        },
                    }
                )
                pending.append((call_id, str(function.get("name", ""))))
            if calls:
                stored["tool_calls"] = calls
            final = content
            messages.append(stored)
        elif role == "tool":
            name = str(message.get("name", ""))
            call_id = None
            for i, (pid, pname) in enumerate(pending):
                if pname == name:
                    call_id = pid
                    del pending[: i + 1]
                    break
            content = message.get("content")
            content = content if isinstance(content, str) else str(content)
            error = _trl_error(content)
            # The environment's record of this call, if the call reached it: same tool,
            # and the same outcome (a call TRL refused has no record, yet may share its
            # name with the next record's call).
            record = None
            if queue and queue[0].name == name and queue[0].error == error:
                record = queue.pop(0)
            tool: dict[str, Any] = {
                "role": "tool",
                "tool_call_id": call_id,
                "name": name,
                "content": content,
                "error": error,
            }
            if record is not None:
                tool["duration_ms"] = round(record.duration_ms, 3)
                tool["truncated"] = record.truncated
            messages.append(tool)
        else:
            messages.append(dict(message))
    trained = sum(tool_mask) if tool_mask is not None else None
    counts = {
        "turns": sum(1 for m in messages if m["role"] == "assistant"),
        "tool_calls": sum(1 for m in messages if m["role"] == "tool"),
        # ``is not None``: TRL shows ``raise ValueError()`` as an empty message, still an error.
        "tool_errors": sum(
            1 for m in messages if m["role"] == "tool" and m.get("error") is not None
        ),
    }
    if trained is not None and tool_mask is not None:
        counts["trained_tokens"] = int(trained)
        counts["masked_tokens"] = len(tool_mask) - int(trained)
    return Episode(messages, final, counts, failure)
