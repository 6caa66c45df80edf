"""Loading a run's environment (tools, python, mcp) into TRL's environment_factory, in
process: the tools each type offers and the JSON schema the chat template gets for each,
what cannot be loaded and why, and the guard on every call (deadline, output cap, errors
as tool messages, the record of each call, an MCP server that is gone)."""

from __future__ import annotations

import json
import os
import sys
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from transformers.utils import get_json_schema

from tests.support import ROOT, agent_tools
from tests.support.mcp_server import server_processes
from workers.environments import EnvironmentUnavailable, LoadedEnvironment, load_environment
from workers.environments.episode import Episode, tool_method
from workers.environments.loading import _schema_signature
from workers.environments.mcp import McpTool
from workers.environments.safety import TRUNCATED, EpisodeFailed, ToolFailed

USER = "tests.support.agent_tools"
MCP_SERVER = {
    "command": [sys.executable, "-m", "tests.support.mcp_server"],
    "env": {"PYTHONPATH": str(ROOT)},
}


def load(**body: Any) -> LoadedEnvironment:
    return load_environment(agent_tools.environment_spec(**body))


def schema(env: LoadedEnvironment, name: str) -> dict[str, Any]:
    """The tool's schema as TRL's chat template receives it."""
    return get_json_schema(getattr(env.factory, name))["function"]


def started(env: LoadedEnvironment, **row: Any) -> Any:
    """A fresh instance after TRL's reset with a dataset row."""
    instance = env.factory()
    row.setdefault("prompt", [{"role": "user", "content": "go"}])
    instance.reset(**row)
    return instance


def number(description: str) -> dict[str, str]:
    return {"type": "number", "description": description}


# --- tools ---------------------------------------------------------------------------------


def test_builtin_tools_with_their_schemas() -> None:
    env = load(type="tools", tools=["add", "subtract", "multiply", "divide"], max_turns=3)
    assert env.tool_names == ["add", "divide", "multiply", "subtract"]
    assert env.max_turns == 3
    assert schema(env, "divide") == {
        "name": "divide",
        "description": "Divide the first number by the second.",
        "parameters": {
            "type": "object",
            "properties": {"a": number("The dividend."), "b": number("The divisor (not zero).")},
            "required": ["a", "b"],
        },
        "return": {"type": "number"},
    }
    calc = started(env)
    assert calc.add(a=2, b=5) == "7"  # 7.0 written as a person would
    assert calc.divide(a=1, b=4) == "0.25"
    with pytest.raises(ToolFailed, match=r"^cannot divide by zero$"):  # TRL's str(e)
        calc.divide(a=1, b=0)


def test_user_tool_by_import_path_beside_a_builtin() -> None:
    env = load(type="tools", tools=[f"{USER}:greet", "add"])
    assert env.tool_names == ["add", "greet"]
    assert schema(env, "greet") == {
        "name": "greet",
        "description": "Greet someone by name.",
        "parameters": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "description": "Who to greet."},
                "excited": {
                    "type": "boolean",
                    "description": "Whether to end with an exclamation mark.",
                },
            },
            "required": ["name"],
        },
        "return": {"type": "string"},
    }
    instance = started(env)
    assert instance.greet(name="Ada") == "Hello, Ada."
    assert instance.greet(name="Ada", excited=True) == "Hello, Ada!"


# --- python --------------------------------------------------------------------------------


def test_builtin_calculator_rewards_the_contexts_answer() -> None:
    env = load(type="python", factory="calculator")
    assert env.tool_names == ["add", "divide", "multiply", "subtract"]
    assert schema(env, "multiply")["parameters"]["properties"] == {
        "a": number("The first factor."),
        "b": number("The second factor."),
    }
    calc = started(env, context=json.dumps({"answer": 12}))
    assert calc.multiply(a=3, b=4) == "12"
    assert calc._reward("3 * 4 = 12", []) == 1.0
    assert calc._reward("13", []) == 0.0
    calc.reset(prompt=[], context=json.dumps({"answer": 13}))  # a new episode, a new answer
    assert calc._reward("13", []) == 1.0


def test_builtin_lookup_store_from_args_or_the_inputs_context() -> None:
    env = load(type="python", factory="lookup", args={"store": {"b": 2, "a": 1}})
    assert env.tool_names == ["list_keys", "lookup"]
    assert schema(env, "list_keys") == {
        "name": "list_keys",
        "description": "List the keys in the store.",
        "parameters": {"type": "object", "properties": {}},
        "return": {"type": "array", "items": {"type": "string"}},
    }
    assert schema(env, "lookup")["parameters"] == {
        "type": "object",
        "properties": {"key": {"type": "string", "description": "The key to look up."}},
        "required": ["key"],
    }
    store = started(env, context=json.dumps({"answer": "1"}))
    assert store.list_keys() == '["a", "b"]'  # a list result is JSON text
    assert store.lookup(key="a") == "1"
    with pytest.raises(ToolFailed, match=r"""^"no such key: 'z'"$"""):  # str() of a KeyError
        store.lookup(key="z")
    assert store._reward("it is 1", []) == 1.0
    own = started(env, context=json.dumps({"store": {"k": "v"}, "answer": "v"}))
    assert own.list_keys() == '["k"]'


def test_user_class_gets_its_args_and_the_row_and_keeps_episode_state() -> None:
    env = load(type="python", factory=f"{USER}:Counter", args={"start": 2})
    assert env.tool_names == ["bump", "read"]  # not reset, not get_reward
    assert schema(env, "bump") == {
        "name": "bump",
        "description": "Add to the counter.",
        "parameters": {
            "type": "object",
            "properties": {"by": {"type": "integer", "description": "How much to add."}},
        },
        "return": {"type": "integer"},
    }
    counter = env.factory()
    prompt = [{"role": "system", "content": "s"}, {"role": "user", "content": "count"}]
    observation = counter.reset(prompt=prompt, input_id="i-1", context='{"goal": 5}')
    assert observation == "The counter starts at 2."
    assert counter._inner.seen == {
        "prompt": prompt,
        "input_text": "count",
        "context": {"goal": 5},
        "input_id": "i-1",
    }
    assert counter.bump() == "3" and counter.bump(by=2) == "5"
    assert counter.read() == "count=5"
    assert counter._reward("5", []) == 1.0 and counter._reward("4", []) == 0.0
    counter.reset(prompt=prompt)
    assert counter.read() == "count=2"  # state is per episode


def test_a_class_on_trls_contract_runs_as_trl_runs_it() -> None:
    """The same class as under plain TRL: reset with the row, its methods the tools, a
    failed call shown as TRL's loop shows it, get_reward() called with no arguments."""
    env = load(type="python", factory=f"{USER}:SmallCalculator")
    assert env.tool_names == ["add", "multiply"]
    calc = started(env, context=json.dumps({"answer": 7}))
    assert calc._reward("anything", []) == 0.0
    assert calc.add(a=3, b=4) == "7"
    with pytest.raises(ToolFailed) as caught:
        calc.multiply(a=5, b=1)
    # TRL's tool loop: ``except Exception as e: result = {"error": str(e)}``, then str().
    bare = agent_tools.SmallCalculator()
    with pytest.raises(ValueError) as raised:
        bare.multiply(a=5, b=1)
    assert str({"error": str(caught.value)}) == str({"error": str(raised.value)})
    assert str(caught.value) == "5 is too large: this calculator takes numbers up to 4"
    assert calc._reward("anything", []) == 1.0  # its state says a result was the answer
    # Arguments that are not an object fail inside TRL, naming the user's method as there.
    with pytest.raises(TypeError) as trl_refusal:
        calc.add(**"3")  # type: ignore[arg-type]
    with pytest.raises(TypeError) as plain_refusal:
        bare.add(**"3")  # type: ignore[arg-type]
    assert str(trl_refusal.value) == str(plain_refusal.value)
    assert "tests.support.agent_tools.SmallCalculator.add()" in str(trl_refusal.value)


@pytest.mark.parametrize(
    ("factory", "reward", "given"),
    [
        ("KwargsReward", 0.5, {}),  # **kwargs: nothing, as TRL
        ("AsyncMessagesReward", 2.0, None),  # names messages: given them; async: awaited
        ("Counter", 1.0, None),  # names completion: given it
    ],
)
def test_get_reward_gets_completion_and_messages_only_by_name(
    factory: str, reward: float, given: dict[str, Any] | None
) -> None:
    env = load(type="python", factory=f"{USER}:{factory}")
    episode = started(env)
    messages = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "0"}]
    assert episode._reward("0", messages) == reward
    if given is not None:
        assert episode._inner.given == given


# --- what cannot be loaded ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            {"type": "tools", "tools": [f"{USER}:nowhere"]},
            rf"tool '{USER}:nowhere' cannot be imported on this worker",
        ),
        (
            {"type": "tools", "tools": ["no_such_package.tools:add"]},
            r"'no_such_package.tools:add' cannot be imported.*No module named 'no_such_package'",
        ),
        (
            {"type": "python", "factory": f"{USER}:Missing"},
            rf"environment factory '{USER}:Missing' cannot be imported",
        ),
        (
            {"type": "python", "factory": f"{USER}:NoReset"},
            r"has no reset method \(TRL's environment contract\)",
        ),
        (
            {"type": "python", "factory": f"{USER}:RewardNeedsAnswer"},
            r"get_reward needs answer, which nothing gives it: TRL calls get_reward\(\) with "
            r"no arguments, and Trainyard offers only completion and messages",
        ),
        (
            {"type": "python", "factory": f"{USER}:greet"},
            r"'tests.support.agent_tools:greet' is not a class",
        ),
        (
            {"type": "tools", "tools": [f"{USER}:undocumented"]},
            r"tool 'undocumented' has no usable schema \(it needs type hints and a Google-style",
        ),
        (
            {"type": "tools", "tools": [f"{USER}:unhinted"]},
            r"tool 'unhinted' has no usable schema.*type hint",
        ),
        (
            {"type": "python", "factory": f"{USER}:BadTool"},
            r"tool 'poke' has no usable schema",
        ),
        (
            {"type": "python", "factory": f"{USER}:Unbuildable", "args": {"url": "http://db:1"}},
            r"^the environment cannot be constructed: ConnectionError: cannot reach http://db:1$",
        ),
        (
            {"type": "mcp", **MCP_SERVER, "tools": ["add", "teleport"]},
            r"the MCP server cannot be used: .*does not offer the allowed tools \['teleport'\]",
        ),
    ],
    ids=[
        "unknown-tool-path",
        "unknown-module",
        "unknown-class",
        "no-reset",
        "reward-needs-what-nobody-gives",
        "not-a-class",
        "no-docstring",
        "no-type-hints",
        "class-tool-without-hints",
        "constructor-raises",
        "mcp-allow-list-names-a-missing-tool",
    ],
)
def test_unavailable_says_why(body: dict[str, Any], message: str) -> None:
    with pytest.raises(EnvironmentUnavailable, match=message):
        load(**body)


# --- mcp -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def mcp_env() -> Iterator[LoadedEnvironment]:
    env = load(type="mcp", **MCP_SERVER, tool_timeout_seconds=0.5, max_tool_output_chars=1000)
    try:
        yield env
    finally:
        env.close()


def test_mcp_tools_and_schemas_from_the_servers_input_schema(mcp_env: LoadedEnvironment) -> None:
    assert mcp_env.tool_names == ["add", "crash", "flood", "lookup", "sleep"]
    # tests/support/mcp_server.py's add(a: float, b: float): the SDK's input_schema gives
    # type number, both required, and titles "A"/"B", which stand in for descriptions.
    assert schema(mcp_env, "add") == {
        "name": "add",
        "description": "Add two numbers: the plain round trip every test starts from.",
        "parameters": {
            "type": "object",
            "properties": {"a": number("A"), "b": number("B")},
            "required": ["a", "b"],
        },
    }
    assert schema(mcp_env, "flood")["parameters"]["properties"] == {
        "megabytes": {"type": "integer", "description": "Megabytes"}
    }
    assert schema(mcp_env, "crash")["parameters"] == {"type": "object", "properties": {}}
    # A multi-paragraph description becomes one line.
    assert "\n" not in schema(mcp_env, "lookup")["description"]


def test_mcp_calls_errors_timeouts_and_caps(mcp_env: LoadedEnvironment) -> None:
    box = started(mcp_env)
    assert box.add(a=2, b=3) == "5.0"
    assert box.lookup(key="rome") == "Italy"
    with pytest.raises(ToolFailed, match="unknown key: 'oslo'"):
        box.lookup(key="oslo")
    # The tool answers after 5 s: a guard that waited for it would return "slept 5.0".
    with pytest.raises(ToolFailed, match=r"^the tool did not answer within 0.5 s$"):
        box.sleep(seconds=5)
    assert box.add(a=1, b=1) == "2.0"  # the server answers while that tool still sleeps
    text = box.flood(megabytes=1)
    total = 1024 * 1024
    assert text == "x" * 1000 + TRUNCATED.format(cut=total - 1000, total=total)
    assert [(r.name, r.error is not None, r.truncated) for r in box.records] == [
        ("add", False, False),
        ("lookup", False, False),
        ("lookup", True, False),
        ("sleep", True, False),
        ("add", False, False),
        ("flood", False, True),
    ]
    assert box.failure is None  # tool errors and timeouts do not end the episode


def test_mcp_command_python_is_the_workers_interpreter() -> None:
    """`command: [python, ...]` as the docs write it works whatever `python` the server's
    PATH would find: the worker's own interpreter, which has the mcp SDK, runs it."""
    env = load(
        type="mcp",
        command=["python", "-m", "tests.support.mcp_server"],
        env={"PYTHONPATH": str(ROOT)},
        tools=["add"],
    )
    try:
        instance = env.factory()
        assert float(instance.add(a=2, b=3)) == 5.0
    finally:
        env.close()


def test_mcp_allow_list_offers_only_the_allowed_tools() -> None:
    env = load(type="mcp", **MCP_SERVER, tools=["lookup"])
    try:
        assert env.tool_names == ["lookup"]
        assert not hasattr(env.factory, "add")
        assert started(env).lookup(key="lima") == "Peru"
    finally:
        env.close()


def test_mcp_server_gone_fails_the_episode() -> None:
    env = load(type="mcp", **MCP_SERVER, tools=["add", "crash"])
    try:
        box = started(env)
        # crash kills the server; it is restarted once, the retried call kills it again.
        with pytest.raises(EpisodeFailed, match=r"the MCP server is gone: .*exited with code 3"):
            box.crash()
        assert box.failure is not None and box.failure.startswith("the MCP server is gone")
        assert box.records[-1].name == "crash" and box.records[-1].error == box.failure
        servers = server_processes()  # other tests' servers (module fixtures), not this one
        with pytest.raises(EpisodeFailed, match="already restarted once"):
            box.add(a=1, b=1)
        assert server_processes() == servers  # refused without starting a third server
        assert box.failure.startswith("the MCP server is gone")  # the first reason kept
        box.reset(prompt=[])
        assert box.failure is None and box.records == []
    finally:
        env.close()


def mcp_schema(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    """The function schema of a generated MCP tool method (no server needed for the part
    that turns an input_schema into a signature and docstring)."""
    tool = McpTool(
        "search",
        "Search.",
        {"type": "object", "properties": properties, "required": required or []},
    )
    signature, hints, doc = _schema_signature(tool)
    method = tool_method(tool.name, signature, doc, hints, lambda _self, _kwargs: "")
    return get_json_schema(method)["function"]["parameters"]


def test_mcp_schema_optional_arguments_and_enums() -> None:
    parameters = mcp_schema(
        {
            "q": {"type": "string", "description": "The query,\n  over two lines."},
            "unit": {"type": "string", "enum": ["c", "f"], "description": "Unit."},
            "limit": {"type": "integer"},
        },
        required=["q"],
    )
    assert parameters == {
        "type": "object",
        "properties": {
            "q": {"type": "string", "description": "The query, over two lines."},
            "unit": {
                "type": "string",
                "nullable": True,
                "enum": ["c", "f"],
                "description": "Unit.",
            },
            "limit": {"type": "integer", "nullable": True, "description": "The limit."},
        },
        "required": ["q"],
    }


def test_mcp_argument_that_is_no_identifier_is_unavailable() -> None:
    with pytest.raises(EnvironmentUnavailable, match="argument 'max-results' is not a Python"):
        mcp_schema({"max-results": {"type": "integer"}})


@pytest.mark.parametrize(
    ("enum", "kind"), [(["don't know", "yes"], "string"), ([True, False], "boolean")]
)
def test_mcp_enum_values_that_are_not_plain_words(enum: list[Any], kind: str) -> None:
    parameters = mcp_schema({"answer": {"type": kind, "enum": enum, "description": "Pick."}})
    assert parameters["properties"]["answer"]["enum"] == enum


# --- the guard on every call ---------------------------------------------------------------


@pytest.fixture
def risky() -> Iterator[LoadedEnvironment]:
    agent_tools.RELEASE.clear()
    names = ["block", "explode", "leave", "flood", "weather", "greet"]
    env = load(
        type="tools",
        tools=[f"{USER}:{n}" for n in names],
        tool_timeout_seconds=0.2,
        max_tool_output_chars=1000,
    )
    try:
        yield env
    finally:
        agent_tools.RELEASE.set()  # lets the abandoned call's thread finish


def test_a_call_past_its_deadline_is_a_tool_error_at_once(risky: LoadedEnvironment) -> None:
    tools = started(risky)
    with pytest.raises(ToolFailed, match=r"^the tool did not answer within 0.2 s$"):
        tools.block(seconds=60)
    # The call came back while the tool still waits for RELEASE (set only at teardown): its
    # thread is alive, abandoned; had the guard waited for it, block would answer "released".
    (abandoned,) = [t for t in threading.enumerate() if t.name == "tool-block"]
    assert abandoned.is_alive() and abandoned.daemon
    (record,) = tools.records
    assert record.name == "block" and record.error == "the tool did not answer within 0.2 s"
    assert record.duration_ms >= 200  # it waited its deadline out (a floor: no load breaks it)
    # A hung call starves nothing after it: the next ones run on another thread, one reused
    # from call to call (not a thread per call).
    assert tools.greet(name="Bo") == "Hello, Bo."
    runners = {t for t in threading.enumerate() if t.name.startswith("tool-")}
    for _ in range(20):
        assert tools.greet(name="Bo") == "Hello, Bo."
    assert {t for t in threading.enumerate() if t.name.startswith("tool-")} == runners


def test_errors_exits_floods_and_structured_results(risky: LoadedEnvironment) -> None:
    tools = started(risky)
    with pytest.raises(ToolFailed, match=r"^no fuel$"):  # what TRL shows: str(e)
        tools.explode(reason="no fuel")
    # A plain TRL script would end here; the guard keeps the worker, and says what it was.
    with pytest.raises(ToolFailed, match=r"^SystemExit: 3$"):
        tools.leave(code=3)
    assert os.getpid() and tools.greet(name="Cy") == "Hello, Cy."  # still here, still working
    text = tools.flood(megabytes=10)
    total = 10_000_000
    assert len(text) < 1100
    assert text == "x" * 1000 + TRUNCATED.format(cut=total - 1000, total=total)
    assert json.loads(tools.weather(city="Nice")) == {
        "city": "Nice",
        "celsius": 21.5,
        "sunny": True,
        "note": "ça va",
    }
    assert "ça va" in tools.weather(city="Nice")  # readable, not \u escapes
    with pytest.raises(ToolFailed, match=r"^greet\(\) got an unexpected keyword argument 'town'$"):
        tools.greet(town="Nice")  # wrong arguments are the model's news, recorded too
    assert [(r.name, r.error, r.truncated) for r in tools.records] == [
        ("explode", "no fuel", False),
        ("leave", "SystemExit: 3", False),
        ("greet", None, False),
        ("flood", None, True),
        ("weather", None, False),
        ("weather", None, False),
        ("greet", tools.records[-1].error, False),
    ]
    assert tools.records[-1].error.startswith("greet()")
    assert all(r.duration_ms > 0 for r in tools.records)
    assert tools.failure is None  # no tool error ends an episode

    tools.reset(prompt=[])
    assert tools.records == []
    assert started(risky).records == []  # and every instance has its own


def test_a_long_error_message_is_capped_too(risky: LoadedEnvironment) -> None:
    tools = started(risky)
    with pytest.raises(ToolFailed) as caught:
        tools.explode(reason="y" * 50_000)
    message = str(caught.value)
    assert message.startswith("yyy") and "[... output truncated:" in message
    assert len(message) < 1100
    assert tools.records[0].error == message


def test_typed_tool_errors_put_the_exceptions_type_first() -> None:
    """``tool_errors: typed``, Trainyard's option: the type first, even with no text; a
    timeout's message and a tool's SystemExit read as they do by default."""
    agent_tools.RELEASE.clear()
    try:
        env = load(
            type="tools",
            tools=[f"{USER}:explode", f"{USER}:leave", f"{USER}:block", "divide"],
            tool_timeout_seconds=0.2,
            tool_errors="typed",
        )
        tools = started(env)
        with pytest.raises(ToolFailed, match=r"^ValueError: no fuel$"):
            tools.explode(reason="no fuel")
        with pytest.raises(ToolFailed, match=r"^ValueError$"):
            tools.explode(reason="")
        with pytest.raises(ToolFailed, match=r"^ZeroDivisionError: cannot divide by zero$"):
            tools.divide(a=1, b=0)
        with pytest.raises(ToolFailed, match=r"^SystemExit: 3$"):
            tools.leave(code=3)
        with pytest.raises(ToolFailed, match=r"^the tool did not answer within 0.2 s$"):
            tools.block(seconds=60)
    finally:
        agent_tools.RELEASE.set()
    assert [r.error for r in tools.records] == [
        "ValueError: no fuel",
        "ValueError",
        "ZeroDivisionError: cannot divide by zero",
        "SystemExit: 3",
        "the tool did not answer within 0.2 s",
    ]
    # By default, as TRL: an exception without text is an empty message, still an error.
    plain = started(load(type="tools", tools=[f"{USER}:explode"]))
    with pytest.raises(ToolFailed, match=r"^$"):
        plain.explode(reason="")
    assert plain.records[0].error == ""


def test_episode_base_has_no_reward_of_its_own() -> None:
    tools = started(load(type="tools", tools=["add"]))
    assert isinstance(tools, Episode)
    with pytest.raises(NotImplementedError, match="has no reward of its own"):
        tools._reward("1", [])
