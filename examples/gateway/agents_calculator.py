"""The calculator agent of calculator.py on the OpenAI Agents SDK, unmodified: an ``Agent``
with function tools of its own, whose model is the episode's endpoint through the Responses
API (``OpenAIResponsesModel``, the SDK's default), run by ``Runner.run``.

    pip install openai-agents==0.24.0 ./sdk/python
    python examples/gateway/agents_calculator.py --url http://127.0.0.1:8000 --key ty_… --run RUN_ID

The run is configs/runs/agent-gateway.yaml with the tools as this agent offers them (the
Agents SDK writes its own JSON schemas: ``--print-tools`` prints them as the run's
``environment.tools``, so the SFT warm-up renders the prompt the agent's calls render). An
episode is rewarded 1 when the agent's final output is the input's ``context.answer``; a
young policy's tool call that is not JSON, or an agent that never stops calling tools, is a
rollout with reward 0 (not a harness failure).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from typing import Any

import trainyard
from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from agents.exceptions import MaxTurnsExceeded, ModelBehaviorError
from calculator import MAX_TURNS, answered  # beside this file: the same task and its check

log = logging.getLogger("harness")


@function_tool
def add(a: float, b: float) -> float:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


@function_tool
def divide(a: float, b: float) -> float:
    """Divide the first number by the second.

    Args:
        a: The dividend.
        b: The divisor (not zero).
    """
    return a / b


@function_tool
def multiply(a: float, b: float) -> float:
    """Multiply two numbers.

    Args:
        a: The first factor.
        b: The second factor.
    """
    return a * b


@function_tool
def subtract(a: float, b: float) -> float:
    """Subtract the second number from the first.

    Args:
        a: The number to subtract from.
        b: The number to subtract.
    """
    return a - b


TOOLS = [add, divide, multiply, subtract]  # the order the python environment offers them


def chat_tools() -> list[dict[str, Any]]:
    """The agent's tools as a run's ``environment.tools`` (Chat Completions' form): what
    the gateway renders from the Responses tools the agent sends."""
    return [
        {
            "type": "function",
            "function": {
                "name": tool.name,
                "description": tool.description,
                "parameters": tool.params_json_schema,
                "strict": tool.strict_json_schema,
            },
        }
        for tool in TOOLS
    ]


async def rollout(episode: trainyard.Episode) -> float:
    system = next((m["content"] for m in episode.messages if m["role"] == "system"), None)
    agent = Agent(
        name="calculator",
        instructions=system,
        tools=TOOLS,
        model=OpenAIResponsesModel("policy", episode.openai_client()),
    )
    try:
        result = await Runner.run(agent, episode.messages[-1]["content"], max_turns=MAX_TURNS + 1)
    except (MaxTurnsExceeded, ModelBehaviorError) as exc:
        log.info("episode %s: %s", episode.id, type(exc).__name__)
        return 0.0
    expected = episode.input["context"].get("answer")
    return 1.0 if answered(str(result.final_output), expected) else 0.0


async def main(url: str, key: str, run_id: str, concurrency: int) -> None:
    set_tracing_disabled(True)  # traces would go to OpenAI's platform
    async with trainyard.Client(url, key) as ty:
        run = await ty.get_run(run_id)
        await run.play(rollout, concurrency=concurrency)
        await run.refresh()
        log.info("run %s ended: %s", run_id, run.status)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url")
    parser.add_argument("--key")
    parser.add_argument("--run")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--print-tools", action="store_true", help="print environment.tools")
    args = parser.parse_args()
    if args.print_tools:
        print(json.dumps(chat_tools()))
        raise SystemExit(0)
    if not (args.url and args.key and args.run):
        parser.error("--url, --key and --run are required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s harness %(message)s")
    asyncio.run(main(args.url, args.key, args.run, args.concurrency))
