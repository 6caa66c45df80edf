"""A harness outside Trainyard: an arithmetic agent on the plain ``openai`` SDK with tools
of its own, playing a gateway run's episodes (``make demo-gateway`` starts it in a process
of its own; docs/gateway.md).

    python examples/gateway/calculator.py --url http://127.0.0.1:8000 --key ty_… --run RUN_ID

It offers the model the tools the run declares (``environment.tools``) and implements them
here; an episode is at most ``MAX_TURNS`` rounds of tool calls, then the answer, rewarded 1
when it is the input's ``context.answer``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import re
from typing import Any

import trainyard

MAX_TURNS = 2
TOOLS = {
    "add": lambda a, b: a + b,
    "subtract": lambda a, b: a - b,
    "multiply": lambda a, b: a * b,
    "divide": lambda a, b: a / b,
}

log = logging.getLogger("harness")


NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def plain(x: float) -> str:
    """7.0 → "7": what a person (and the warm-up's demonstrations) would write."""
    return str(int(x)) if math.isfinite(x) and float(x).is_integer() else str(x)


def call_tool(name: str, arguments: str) -> str:
    """A tool's result as the model is shown it; a failure as TRL shows one."""
    try:
        return plain(TOOLS[name](**json.loads(arguments or "{}")))
    except Exception as exc:
        return json.dumps({"error": str(exc)})


def answered(text: str, expected: Any) -> bool:
    """The answer is the last number in the text."""
    found = NUMBER.findall(text)
    try:
        return bool(found) and math.isclose(float(found[-1]), float(expected))
    except (TypeError, ValueError):
        return False


def make_rollout(tools: list[dict[str, Any]]):
    async def rollout(episode: trainyard.Episode) -> float:
        client = episode.openai_client()
        messages: list[dict[str, Any]] = episode.messages
        for _ in range(MAX_TURNS + 1):
            answer = await client.chat.completions.create(
                model="policy", messages=messages, tools=tools
            )
            message = answer.choices[0].message
            messages.append(message.model_dump(exclude_none=True))
            if not message.tool_calls:
                break
            for call in message.tool_calls:
                messages.append(
                    {
                        "role": "tool",
                        "tool_call_id": call.id,
                        "content": call_tool(call.function.name, call.function.arguments),
                    }
                )
        final = messages[-1].get("content") or "" if messages[-1]["role"] == "assistant" else ""
        return 1.0 if answered(final, episode.input["context"].get("answer")) else 0.0

    return rollout


async def main(url: str, key: str, run_id: str, concurrency: int) -> None:
    async with trainyard.Client(url, key) as ty:
        run = await ty.get_run(run_id)
        tools = (run.data.get("environment") or {}).get("tools") or []
        log.info("playing run %s with tools %s", run_id, [t["function"]["name"] for t in tools])
        await run.play(make_rollout(tools), concurrency=concurrency)
        await run.refresh()
        log.info("run %s ended: %s", run_id, run.status)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--run", required=True)
    parser.add_argument("--concurrency", type=int, default=64)  # a whole step at once
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s harness %(message)s")
    asyncio.run(main(args.url, args.key, args.run, args.concurrency))
