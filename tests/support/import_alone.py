"""Import each module named on the command line alone: ``python tests/support/import_alone.py
MODULE…`` prints one JSON object, ``{module: traceback}`` for every module that failed.

Each module is imported in a child forked from this interpreter, which has imported the
third-party modules the code names (``--preload``, ``package.module`` or
``package.module:attribute``) and nothing of the project's own. A child sees what a fresh
interpreter would, as far as the project's modules go: none is imported before the one under
test, so a module that works only because another was imported first fails. The third-party
modules are loaded once instead of once a module (torch, transformers and TRL take seconds
each; a fresh interpreter per module took two minutes of the suite).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import traceback

#: Children importing at once (the machine's two cores).
CONCURRENCY = 2


def _preload(names: list[str], own: tuple[str, ...]) -> None:
    for name in names:
        module, _, attribute = name.partition(":")
        try:  # what this environment lacks (vLLM, say) the module under test guards itself
            loaded = importlib.import_module(module)
            if attribute:
                getattr(loaded, attribute)  # transformers' lazy names load their modules here
        except Exception:
            continue
    leaked = sorted(m for m in sys.modules if m.split(".")[0] in own)
    if leaked:
        raise SystemExit(f"preloading imported the project's own modules: {leaked}")


def _start(module: str) -> tuple[int, int]:
    """Fork a child importing ``module``; its traceback comes back on the pipe."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        os.close(read)
        code = 0
        try:
            importlib.import_module(module)
        except BaseException:
            os.write(write, traceback.format_exc()[-2000:].encode())
            code = 1
        os._exit(code)  # no atexit handlers, no flushing of the parent's buffers
    os.close(write)
    return pid, read


def _finish(pid: int, read: int) -> str | None:
    chunks = []
    while chunk := os.read(read, 65536):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if os.waitstatus_to_exitcode(status) == 0:
        return None
    return b"".join(chunks).decode(errors="replace") or f"exited with status {status}"


def main(argv: list[str]) -> int:
    sys.path[0] = os.getcwd()  # as ``python -c`` in the repository would have it
    parser = argparse.ArgumentParser()
    parser.add_argument("--own", nargs="*", default=[], help="the project's top-level packages")
    parser.add_argument("--preload", nargs="*", default=[])
    parser.add_argument("--modules", nargs="*", default=[])
    args = parser.parse_args(argv)
    _preload(args.preload, tuple(args.own))
    failed: dict[str, str] = {}
    running: list[tuple[str, int, int]] = []
    for module in args.modules:
        running.append((module, *_start(module)))
        if len(running) >= CONCURRENCY:
            name, pid, read = running.pop(0)
            if (error := _finish(pid, read)) is not None:
                failed[name] = error
    for name, pid, read in running:
        if (error := _finish(pid, read)) is not None:
            failed[name] = error
    print(json.dumps(failed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
