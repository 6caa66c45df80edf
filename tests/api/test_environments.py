"""A run's ``environment`` (app.runs.spec.environments) at POST /runs: each kind accepted, stored
with its defaults and served back; each mistake a 422 naming the field; the document
lists the built-ins."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from app.runs.spec.environments import BUILTIN_ENVIRONMENTS, BUILTIN_TOOLS
from tests.support.database import Tenant
from tests.support.runs import run_body

EPISODE_DEFAULTS = {
    "max_turns": 4,
    "tool_timeout_seconds": 10,
    "max_tool_output_chars": 4000,
    "tool_errors": "trl",
}
ENVIRONMENT_REWARD = {"type": "function", "functions": [{"name": "environment"}]}


async def _create(client: httpx.AsyncClient, tenant: Tenant, **body: Any) -> httpx.Response:
    return await client.post("/runs", json=run_body(**body), headers=tenant.headers)


@pytest.mark.parametrize(
    ("environment", "stored"),
    [
        (
            {"type": "tools", "tools": ["add", "multiply", "my_pkg.tools:search"]},
            {"type": "tools", "tools": ["add", "multiply", "my_pkg.tools:search"]},
        ),
        (
            {"type": "python", "factory": "calculator", "max_turns": 50},
            {"type": "python", "factory": "calculator", "args": {}, "max_turns": 50},
        ),
        (
            {"type": "python", "factory": "lookup", "args": {"store": {"paris": "france"}}},
            {"type": "python", "factory": "lookup", "args": {"store": {"paris": "france"}}},
        ),
        (
            {"type": "python", "factory": "my_pkg.envs:Shop", "args": {"anything": [1, {}]}},
            {"type": "python", "factory": "my_pkg.envs:Shop", "args": {"anything": [1, {}]}},
        ),
        (
            {"type": "mcp", "command": ["python", "-m", "server"], "env": {"API_TOKEN": "x"}},
            {
                "type": "mcp",
                "command": ["python", "-m", "server"],
                "url": None,
                "server": None,
                "tools": None,
                "env": {"API_TOKEN": "x"},
            },
        ),
        (
            {"type": "mcp", "url": "https://tools.example/mcp", "tools": ["search"]},
            {
                "type": "mcp",
                "command": None,
                "url": "https://tools.example/mcp",
                "server": None,
                "tools": ["search"],
                "env": {},
            },
        ),
    ],
    ids=["tools", "calculator", "lookup", "user-class", "mcp-stdio", "mcp-http"],
)
async def test_environments_are_stored_with_their_defaults_and_served(
    client: httpx.AsyncClient, tenant: Tenant, environment: dict[str, Any], stored: Any
) -> None:
    r = await _create(client, tenant, environment=environment)
    assert r.status_code == 202, r.text
    expected = {**EPISODE_DEFAULTS, **stored}
    assert r.json()["environment"] == expected
    got = await client.get(f"/runs/{r.json()['id']}", headers=tenant.headers)
    assert got.status_code == 200 and got.json()["environment"] == expected


async def test_a_run_without_an_environment_serves_null(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    r = await _create(client, tenant)
    assert r.status_code == 202, r.text
    assert r.json()["environment"] is None and r.json()["sft"] is None


async def test_the_environment_reward_with_a_python_environment(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    r = await _create(
        client,
        tenant,
        environment={"type": "python", "factory": "calculator"},
        reward=ENVIRONMENT_REWARD,
    )
    assert r.status_code == 202, r.text
    assert r.json()["reward"]["functions"][0] == {"name": "environment", "weight": 1.0, "args": {}}


@pytest.mark.parametrize(
    "reward",
    [
        {"type": "ruler"},
        {"type": "function", "functions": [{"name": "exact_match"}]},
    ],
)
async def test_other_rewards_stay_valid_with_an_environment(
    client: httpx.AsyncClient, tenant: Tenant, reward: dict[str, Any]
) -> None:
    r = await _create(
        client, tenant, environment={"type": "tools", "tools": ["add"]}, reward=reward
    )
    assert r.status_code == 202, r.text


TOOLS = "body.environment.tools"
PYTHON = "body.environment.python"
MCP = "body.environment.mcp"


@pytest.mark.parametrize(
    ("body", "field", "why"),
    [
        ({"environment": {"type": "tools", "tools": ["sqrt"]}}, f"{TOOLS}.tools", "unknown tool"),
        (
            {"environment": {"type": "tools", "tools": ["not a path"]}},
            f"{TOOLS}.tools",
            "unknown tool",
        ),
        ({"environment": {"type": "tools", "tools": ["add", "add"]}}, f"{TOOLS}.tools", "add"),
        ({"environment": {"type": "tools", "tools": []}}, f"{TOOLS}.tools", "at least 1"),
        (
            {"environment": {"type": "tools", "tools": ["add"], "max_turns": 0}},
            f"{TOOLS}.max_turns",
            "greater than or equal to 1",
        ),
        (
            {"environment": {"type": "tools", "tools": ["add"], "max_turns": 51}},
            f"{TOOLS}.max_turns",
            "less than or equal to 50",
        ),
        (
            {"environment": {"type": "tools", "tools": ["add"], "tool_timeout_seconds": 0}},
            f"{TOOLS}.tool_timeout_seconds",
            "greater than 0",
        ),
        (
            {"environment": {"type": "tools", "tools": ["add"], "max_tool_output_chars": 99}},
            f"{TOOLS}.max_tool_output_chars",
            "100",
        ),
        (
            {"environment": {"type": "tools", "tools": ["add"], "tool_errors": "verbose"}},
            f"{TOOLS}.tool_errors",
            "'trl' or 'typed'",
        ),
        (
            {"environment": {"type": "python", "factory": "chess"}},
            f"{PYTHON}.factory",
            "unknown environment",
        ),
        (
            {"environment": {"type": "python", "factory": "lookup", "args": {"stor": {}}}},
            f"{PYTHON}.args",
            "stor",
        ),
        (
            {"environment": {"type": "python", "factory": "calculator", "args": {"x": 1}}},
            f"{PYTHON}.args",
            "x",
        ),
        (
            {"environment": {"type": "mcp", "command": ["srv"], "url": "http://h/mcp"}},
            f"{MCP}.server",
            "exactly one",
        ),
        ({"environment": {"type": "mcp"}}, f"{MCP}.server", "exactly one"),
        (
            {"environment": {"type": "mcp", "url": "http://h/mcp", "server": "browser"}},
            f"{MCP}.server",
            "exactly one",
        ),
        (
            {"environment": {"type": "mcp", "server": "browser", "env": {"A": "1"}}},
            f"{MCP}.env",
            "its own env",
        ),
        ({"environment": {"type": "mcp", "command": []}}, f"{MCP}.command", "at least 1"),
        ({"environment": {"type": "mcp", "command": ["srv", ""]}}, f"{MCP}.command[1]", "1"),
        ({"environment": {"type": "mcp", "url": "ftp://h/mcp"}}, f"{MCP}.url", "pattern"),
        (
            {"environment": {"type": "mcp", "command": ["srv"], "env": {"1BAD": "x"}}},
            f"{MCP}.env.1BAD.[key]",
            "pattern",
        ),
        (
            {"environment": {"type": "mcp", "url": "http://h/mcp", "tools": ["a", "a"]}},
            f"{MCP}.tools",
            "more than once",
        ),
        ({"environment": {"type": "docker"}}, "body.environment", "tag"),
        (
            {"environment": {"type": "tools", "tools": ["add"]}, "reward": ENVIRONMENT_REWARD},
            "body.reward",
            "python",
        ),
        ({"reward": ENVIRONMENT_REWARD}, "body.reward", "python"),
        (
            {
                "environment": {"type": "python", "factory": "calculator"},
                "reward": {
                    "type": "function",
                    "functions": [{"name": "environment", "args": {"scale": 2}}],
                },
            },
            "body.reward.function.functions[0].args",
            "scale",
        ),
    ],
)
async def test_bad_environments_are_422_naming_the_field(
    client: httpx.AsyncClient, tenant: Tenant, body: dict[str, Any], field: str, why: str
) -> None:
    r = await _create(client, tenant, **body)
    assert r.status_code == 422, r.text
    errors = r.json()["errors"]
    assert [e["field"] for e in errors] == [field], errors
    assert why in errors[0]["message"], errors


async def test_many_env_vars_are_refused(client: httpx.AsyncClient, tenant: Tenant) -> None:
    env = {f"V{i}": "x" for i in range(51)}
    r = await _create(client, tenant, environment={"type": "mcp", "command": ["s"], "env": env})
    assert r.status_code == 422, r.text
    assert r.json()["errors"][0]["field"] == f"{MCP}.env"


def _cases(schema: dict[str, Any], key: str) -> dict[Any, dict[str, Any]]:
    """A model's checks by case (if/then/else on ``key``): {value: its check, None: the rest}."""
    cases: dict[Any, dict[str, Any]] = {}
    while "if" in schema:
        cases[schema["if"]["properties"][key]["const"]] = schema["then"]
        schema = schema["else"]
    cases[None] = schema
    return cases


async def test_the_document_lists_the_builtins(client: httpx.AsyncClient) -> None:
    schemas = (await client.get("/openapi.json")).json()["components"]["schemas"]
    tool = schemas["ToolsEnvironment-Input"]["properties"]["tools"]["items"]
    factory = schemas["PythonEnvironment-Input"]["properties"]["factory"]
    for name, builtin in BUILTIN_TOOLS.items():
        assert name in tool["pattern"] and builtin.summary in tool["description"]
    for name, env in BUILTIN_ENVIRONMENTS.items():
        assert name in factory["pattern"] and env.summary in factory["description"]
    turns = schemas["ToolsEnvironment-Input"]["properties"]["max_turns"]
    assert "max_tool_calling_iterations" in turns["description"]
    assert schemas["RunPublic"]["properties"]["environment"]["anyOf"][1] == {"type": "null"}
    # What the validators refuse, the document says: each built-in's args, every env key.
    cases = _cases(schemas["PythonEnvironment-Input"], "factory")
    args = {value: case["properties"].get("args") for value, case in cases.items()}
    assert (
        args["lookup"]["additionalProperties"] is False and "store" in args["lookup"]["properties"]
    )
    assert args["calculator"]["properties"] == {}
    env = schemas["McpEnvironment-Input"]["properties"]["env"]
    assert env["propertyNames"]["pattern"] == "^[A-Za-z_][A-Za-z0-9_]*$"
    assert "patternProperties" not in env
