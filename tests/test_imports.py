"""The import structure, as the code is read: every module imports alone (in a child of an
interpreter that has loaded only third-party code: no module works only because another of
ours was imported first), no module imports
itself back through others (a circle held apart by imports inside functions still counts:
grimp reads those too), and the API's package imports nothing from the workers'."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

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


def _third_party(graph: grimp.ImportGraph, modules: list[str]) -> list[str]:
    """What the modules import from outside the project, as ``module`` or
    ``module:attribute`` (a ``from … import`` may name a lazily loaded attribute)."""
    names: set[str] = set()
    for module in modules:
        for imported in graph.find_modules_directly_imported_by(module):
            if imported.split(".")[0] in PACKAGES:
                continue
            names.add(imported)
            for detail in graph.get_import_details(importer=module, imported=imported):
                try:
                    node = ast.parse(detail["line_contents"].strip()).body[0]
                except SyntaxError:  # one line of an import over several: the package will do
                    continue
                if isinstance(node, ast.Import):
                    names.update(alias.name for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                    names.add(node.module)
                    names.update(f"{node.module}:{alias.name}" for alias in node.names)
    return sorted(names)


def _import_alone(
    cwd: Path, own: Sequence[str], preload: list[str], modules: list[str]
) -> dict[str, str]:
    """tests/support/import_alone.py run from ``cwd``: each failed module's traceback."""
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tests" / "support" / "import_alone.py"),
            *("--own", *own),
            *("--preload", *preload),
            *("--modules", *modules),
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    failed: dict[str, str] = json.loads(done.stdout)
    return failed


def test_every_module_imports_alone_in_a_fresh_interpreter() -> None:
    """Each module in a child of an interpreter that has loaded only third-party code
    (tests/support/import_alone.py): nothing of ours is imported before it."""
    graph = grimp.build_graph(*PACKAGES, include_external_packages=True, cache_dir=None)
    modules = sorted(m for m in graph.modules if m.split(".")[0] in PACKAGES)
    assert len(modules) > 100, modules
    failed = _import_alone(ROOT, PACKAGES, _third_party(graph, modules), modules)
    assert not failed, "\n\n".join(f"{m}:\n{err}" for m, err in failed.items())


def test_a_module_that_needs_another_imported_first_fails_alone(tmp_path: Path) -> None:
    """The check above can fail: a module using a sibling it never imports."""
    package = tmp_path / "app"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "first.py").write_text("VALUE = 1\n")
    (package / "second.py").write_text("import sys\nVALUE = sys.modules['app.first'].VALUE\n")
    failed = _import_alone(tmp_path, ("app",), ["json"], ["app.first", "app.second"])
    assert list(failed) == ["app.second"] and "KeyError: 'app.first'" in failed["app.second"]
