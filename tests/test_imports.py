"""The import structure, as the code is read: every module imports alone in a fresh
interpreter (no module works only because another was imported first), no module imports
itself back through others (a circle held apart by imports inside functions still counts:
grimp reads those too), and the API's package imports nothing from the workers'."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grimp
import pytest

from tests.support import ROOT

PACKAGES = ("app", "workers")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, cache_dir=None)


def _cycles(graph: grimp.ImportGraph) -> Iterator[list[str]]:
    """Every strongly connected set of more than one module (Tarjan's algorithm). A package
    and its own submodules are not a cycle: ``from pkg import sub`` names the package."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()

    def edges(module: str) -> list[str]:
        return sorted(
            m
            for m in graph.find_modules_directly_imported_by(module)
            if m.split(".")[0] in PACKAGES and not module.startswith(m + ".")
        )

    def visit(root: str) -> Iterator[list[str]]:
        # Iterative, so a deep import chain cannot hit the recursion limit.
        work = [(root, iter(edges(root)))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(edges(child))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        yield sorted(component)

    for module in sorted(graph.modules):
        if module.split(".")[0] in PACKAGES and module not in index:
            yield from visit(module)


def test_no_module_imports_itself_back(graph: grimp.ImportGraph) -> None:
    cycles = list(_cycles(graph))
    described = []
    for cycle in cycles:
        chain = graph.find_shortest_chain(importer=cycle[0], imported=cycle[1])
        back = graph.find_shortest_chain(importer=cycle[1], imported=cycle[0])
        described.append(f"{' -> '.join(chain or [])} ... {' -> '.join(back or [])}")
    assert not cycles, "import cycles:\n" + "\n".join(described)


def test_the_cycle_finder_finds_a_cycle() -> None:
    """The check above can fail: two modules importing each other are one cycle."""
    graph = grimp.ImportGraph()
    for module in ("app.a", "app.b", "app.c"):
        graph.add_module(module)
    graph.add_import(importer="app.a", imported="app.b")
    graph.add_import(importer="app.b", imported="app.a")
    graph.add_import(importer="app.b", imported="app.c")
    assert list(_cycles(graph)) == [["app.a", "app.b"]]


def test_the_api_imports_nothing_from_the_workers(graph: grimp.ImportGraph) -> None:
    chains = graph.find_shortest_chains(importer="app", imported="workers", as_packages=True)
    assert not chains, f"app imports workers: {sorted(chains)}"


def _modules() -> list[str]:
    graph = grimp.build_graph(*PACKAGES, cache_dir=None)
    return sorted(m for m in graph.modules if m.split(".")[0] in PACKAGES)


def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    def alone(module: str) -> tuple[str, str] | None:
        done = subprocess.run(
            [sys.executable, "-c", f"import {module}"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        return None if done.returncode == 0 else (module, done.stderr[-2000:])

    with ThreadPoolExecutor(max_workers=2) as pool:
        failed = [f for f in pool.map(alone, _modules()) if f is not None]
    assert not failed, "\n\n".join(f"{m}:\n{err}" for m, err in failed)
