"""The MCP toolbox on real MCP server processes (tests/support/mcp_server.py), no mocks:
stdio and streamable HTTP, the allow-list, tool errors, timeouts, a huge answer, a server
that dies (one restart, then gone for good) and a close that leaves no process behind."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest

from tests.support import ROOT
from tests.support.mcp_server import server_processes
from workers.environments.mcp import (
    McpServerGone,
    McpToolbox,
    McpToolError,
    McpUnavailable,
)

SERVER = [sys.executable, "-m", "tests.support.mcp_server"]
ENV = {"PYTHONPATH": str(ROOT)}  # the child gets only the SDK's safe variables besides
TOOLS = {"add", "lookup", "sleep", "flood", "crash"}


@pytest.fixture
def toolbox() -> Iterator[McpToolbox]:
    box = McpToolbox(command=SERVER, env=ENV, startup_timeout=20)
    try:
        yield box
    finally:
        box.close()


def kill_and_wait(pid: int) -> None:
    """SIGKILL the server and wait until the toolbox's loop has reaped it.

    Polled, not ``psutil.Process.wait()``: that would reap our child itself, and asyncio's
    child watcher would then report exit code 255 instead of the signal.
    """
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while psutil.pid_exists(pid):
        assert time.monotonic() < deadline, f"server {pid} still exists 10 s after SIGKILL"
        time.sleep(0.01)


def test_stdio_lists_tools_with_schemas_and_calls_them(toolbox: McpToolbox) -> None:
    tools = {tool.name: tool for tool in toolbox.start()}
    assert set(tools) == TOOLS
    add = tools["add"]
    assert add.description.startswith("Add two numbers")
    assert add.input_schema["type"] == "object"
    assert add.input_schema["required"] == ["a", "b"]
    assert add.input_schema["properties"]["a"]["type"] == "number"
    assert tools["flood"].input_schema["properties"]["megabytes"]["type"] == "integer"

    assert toolbox.call("add", {"a": 2, "b": 3}, timeout=5) == "5.0"
    assert toolbox.call("lookup", {"key": "paris"}, timeout=5) == "France"

    # env is merged over the SDK's safe defaults: PATH is there, the worker's secrets are not.
    assert toolbox.pid is not None
    environ = psutil.Process(toolbox.pid).environ()
    assert environ["PYTHONPATH"] == str(ROOT)
    assert environ["PATH"] == os.environ["PATH"]
    assert "TRAINYARD_DATABASE_URL" not in environ
    assert toolbox.gone is None


def test_allow_list_hides_and_refuses_other_tools() -> None:
    box = McpToolbox(command=SERVER, env=ENV, allow=["lookup", "add"])
    try:
        assert [tool.name for tool in box.start()] == ["lookup", "add"]
        with pytest.raises(McpToolError, match="'sleep' is not allowed"):
            box.call("sleep", {"seconds": 0}, timeout=5)
        assert box.call("add", {"a": 1, "b": 1}, timeout=5) == "2.0"
    finally:
        box.close()


def test_allow_list_naming_a_missing_tool_is_unavailable() -> None:
    box = McpToolbox(command=SERVER, env=ENV, allow=["add", "teleport"])
    with pytest.raises(McpUnavailable, match="teleport") as caught:
        box.start()
    assert "'add'" not in str(caught.value).split("offers")[0]  # names only the missing one
    assert server_processes() == []
    box.close()


def test_a_server_that_cannot_start_is_unavailable() -> None:
    with pytest.raises(McpUnavailable, match="No module named"):
        McpToolbox(command=[sys.executable, "-m", "no_such_mcp_server"]).start()
    with pytest.raises(McpUnavailable, match="no-such-executable"):
        McpToolbox(command=["no-such-executable-for-mcp"]).start()


def test_tool_error_carries_the_tools_message_and_the_next_call_works(
    toolbox: McpToolbox,
) -> None:
    toolbox.start()
    with pytest.raises(McpToolError, match="unknown key: 'atlantis'"):
        toolbox.call("lookup", {"key": "atlantis"}, timeout=5)
    assert toolbox.call("lookup", {"key": "rome"}, timeout=5) == "Italy"


def test_timeout_raises_promptly_and_the_server_stays_up(toolbox: McpToolbox) -> None:
    toolbox.start()
    pid = toolbox.pid
    # The tool answers after 10 s, well inside the toolbox's own outer bound (about 37 s
    # here): a call that waited for the tool would return "slept 10" instead of raising.
    with pytest.raises(TimeoutError, match=r"'sleep' did not answer within 0\.5 s"):
        toolbox.call("sleep", {"seconds": 10}, timeout=0.5)
    # That tool is still sleeping in the server, which answers the next call meanwhile.
    assert toolbox.call("add", {"a": 1, "b": 2}, timeout=5) == "3.0"
    assert toolbox.pid == pid  # not restarted
    assert toolbox.gone is None


def test_a_late_answer_is_dropped_not_handed_to_the_next_call(toolbox: McpToolbox) -> None:
    toolbox.start()
    with pytest.raises(TimeoutError):
        toolbox.call("sleep", {"seconds": 1}, timeout=0.2)
    # The server runs each call in a thread of its own: "slept 1.0" arrives while this call
    # waits for "slept 2.0", and must be dropped, not taken for this call's answer.
    assert toolbox.call("sleep", {"seconds": 2}, timeout=30) == "slept 2.0"
    assert toolbox.call("add", {"a": 1, "b": 2}, timeout=5) == "3.0"
    assert toolbox.gone is None


def test_a_ten_megabyte_answer_arrives_whole(toolbox: McpToolbox) -> None:
    toolbox.start()
    text = toolbox.call("flood", {"megabytes": 10}, timeout=30)
    assert len(text) == 10 * 1024 * 1024
    assert set(text) == {"x"}
    assert toolbox.call("add", {"a": 1, "b": 2}, timeout=5) == "3.0"


def test_a_call_that_kills_its_server_twice_leaves_it_gone(toolbox: McpToolbox) -> None:
    toolbox.start()
    first_pid = toolbox.pid
    # crash kills the server; it is restarted once and the call retried, which kills it again.
    with pytest.raises(McpServerGone, match="exited with code 3") as caught:
        toolbox.call("crash", {}, timeout=5)
    assert "already restarted once" in str(caught.value)
    assert toolbox.gone == str(caught.value)
    second_pid = toolbox.pid
    assert second_pid != first_pid  # the retry ran on a second process
    # Gone is final: each later call fails with the recorded reason, starting no third server.
    for _ in range(3):
        with pytest.raises(McpServerGone) as again:
            toolbox.call("add", {"a": 1, "b": 2}, timeout=5)
        assert str(again.value) == toolbox.gone
        assert toolbox.pid == second_pid
        assert server_processes() == []


def test_an_externally_killed_server_is_restarted_once(toolbox: McpToolbox) -> None:
    toolbox.start()
    pid = toolbox.pid
    assert pid is not None
    assert [process.pid for process in server_processes()] == [pid]
    kill_and_wait(pid)

    assert toolbox.call("add", {"a": 2, "b": 2}, timeout=5) == "4.0"
    assert toolbox.pid not in (None, pid)
    assert toolbox.gone is None
    assert toolbox.call("lookup", {"key": "lima"}, timeout=5) == "Peru"

    # The one restart is spent: the next death is final, and says how it died.
    with pytest.raises(McpServerGone, match="exited with code 3"):
        toolbox.call("crash", {}, timeout=5)
    with pytest.raises(McpServerGone):
        toolbox.call("add", {"a": 1, "b": 2}, timeout=5)


def test_concurrent_calls_that_meet_one_death_share_one_restart(toolbox: McpToolbox) -> None:
    toolbox.start()
    assert toolbox.pid is not None
    kill_and_wait(toolbox.pid)
    with ThreadPoolExecutor(max_workers=4) as pool:
        answers = list(
            pool.map(lambda n: toolbox.call("add", {"a": n, "b": 1}, timeout=5), range(4))
        )
    assert answers == ["1.0", "2.0", "3.0", "4.0"]
    assert toolbox.gone is None
    assert len(server_processes()) == 1


def test_a_killed_server_is_named_by_its_signal(toolbox: McpToolbox) -> None:
    toolbox.start()
    assert toolbox.pid is not None
    kill_and_wait(toolbox.pid)
    toolbox.call("add", {"a": 2, "b": 2}, timeout=5)  # restarted
    assert toolbox.pid is not None
    kill_and_wait(toolbox.pid)
    with pytest.raises(McpServerGone, match="killed by SIGKILL"):
        toolbox.call("add", {"a": 2, "b": 2}, timeout=5)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_http_server(port: int) -> subprocess.Popen[bytes]:
    """The test server on streamable HTTP, once it accepts connections (bounded wait)."""
    process = subprocess.Popen(
        [*SERVER, "--http", str(port)],
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        assert process.poll() is None, "the HTTP MCP server exited"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return process
        except OSError:
            time.sleep(0.05)  # polling a port: there is no event to wait on
    process.kill()
    raise AssertionError(f"the HTTP MCP server did not listen on {port} within 20 s")


def stop(process: subprocess.Popen[bytes]) -> None:
    process.kill()
    process.wait(timeout=10)


def test_streamable_http_lists_calls_and_reconnects_once() -> None:
    port = free_port()
    server = start_http_server(port)
    box = McpToolbox(url=f"http://127.0.0.1:{port}/mcp", startup_timeout=10)
    try:
        assert {tool.name for tool in box.start()} == TOOLS
        assert box.call("add", {"a": 2, "b": 3}, timeout=5) == "5.0"
        assert box.pid is None

        # The endpoint goes away and comes back: the toolbox reconnects once.
        stop(server)
        server = start_http_server(port)
        assert box.call("add", {"a": 4, "b": 4}, timeout=5) == "8.0"

        # It goes away for good: the reconnect is spent, and the reason names the error.
        stop(server)
        with pytest.raises(McpServerGone, match=f"127.0.0.1:{port}"):
            box.call("add", {"a": 1, "b": 1}, timeout=5)
        assert box.gone is not None
    finally:
        box.close()
        if server.poll() is None:
            stop(server)


def test_close_leaves_no_server_process_and_is_idempotent(toolbox: McpToolbox) -> None:
    toolbox.start()
    assert len(server_processes()) == 1
    toolbox.close()
    toolbox.close()
    assert server_processes() == []
    with pytest.raises(RuntimeError):
        toolbox.call("add", {"a": 1, "b": 1}, timeout=5)
