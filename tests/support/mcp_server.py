"""A real MCP server, written with the official SDK, for the MCP toolbox tests.

Run it as ``python -m tests.support.mcp_server`` (stdio, the way a run's ``command`` starts a
server) or ``python -m tests.support.mcp_server --http PORT`` (streamable HTTP on 127.0.0.1,
endpoint ``/mcp``). Each tool exercises one thing the worker must survive: a plain answer, a
tool error, a slow call, a huge answer and a process that dies mid-call.
"""

from __future__ import annotations

import argparse
import os
import time

import psutil
from mcp.server import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

server = MCPServer("trainyard-test-tools", log_level="WARNING")

MODULE = "tests.support.mcp_server"


def server_processes(parent_pid: int | None = None) -> list[psutil.Process]:
    """The live test servers under the process ``parent_pid`` (default: this one), a reaped
    or zombie child not counted: what a toolbox started, for a test to kill."""
    found = []
    for child in psutil.Process(parent_pid).children(recursive=True):
        try:
            if child.status() != psutil.STATUS_ZOMBIE and MODULE in " ".join(child.cmdline()):
                found.append(child)
        except psutil.NoSuchProcess:
            pass
    return found


_TABLE = {"paris": "France", "rome": "Italy", "lima": "Peru"}


@server.tool()
def add(a: float, b: float) -> float:
    """Add two numbers: the plain round trip every test starts from."""
    return a + b


@server.tool()
def lookup(key: str) -> str:
    """Return the country of a capital; an unknown key answers is_error with a message.

    ``ToolError``, not ``ValueError``: MCP SDK 2.3.0 hides the message of an unexpected
    exception ("Error executing tool lookup") and passes a ``ToolError``'s text through.
    """
    if key not in _TABLE:
        raise ToolError(f"unknown key: {key!r}")
    return _TABLE[key]


@server.tool()
def sleep(seconds: float) -> str:
    """Answer after ``seconds``: a call that outlives the caller's timeout.

    A blocking sleep on purpose, like a tool doing slow synchronous work; the SDK runs sync
    tools in a worker thread, so the server keeps answering other calls meanwhile.
    """
    time.sleep(seconds)
    return f"slept {seconds}"


@server.tool()
def flood(megabytes: int) -> str:
    """Return ``megabytes`` MB of text: an answer far larger than any pipe buffer."""
    return "x" * (megabytes * 1024 * 1024)


@server.tool()
def crash() -> str:
    """Kill this server process mid-call (exit code 3), as a segfaulting tool would."""
    os._exit(3)


def main() -> None:
    """Serve on stdio, or on streamable HTTP when ``--http PORT`` is given."""
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--http", type=int, metavar="PORT", help="serve streamable HTTP")
    args = parser.parse_args()
    if args.http is None:
        server.run()
    else:
        server.run("streamable-http", host="127.0.0.1", port=args.http)


if __name__ == "__main__":
    main()
