"""The dashboard in real headless Chromium (Debian's ``chromium``, driven by Playwright for
Python through ``executable_path``; no browser download), against a real API process
(``trainyard api``) and real workers on the module's own database.

``TRAINYARD_SCREENSHOTS=<dir>`` makes the tests save PNGs of what they looked at there.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.api_process import ApiProcess, api_process
from tests.support.browser import CHROMIUM, launch
from tests.support.database import (
    OwnDatabase,
    Tenant,
    module_database,  # noqa: F401  (fixture)
    new_tenant,
    sessions_on,
)
from tests.support.llm import ScriptedLLM, serve
from tests.support.workers import FAST, Worker, spawn_worker, tiny_model  # noqa: F401


@pytest.fixture(scope="module")
def ui_logs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("ui")


@pytest.fixture(scope="module")
def api_server(module_database: OwnDatabase, ui_logs: Path) -> Iterator[ApiProcess]:  # noqa: F811
    env = {**module_database.env(), "TRAINYARD_MAX_ACTIVE_RUNS_PER_PROJECT": "0"}
    with api_process(ui_logs / "api.log", env) as server:
        yield server


@pytest.fixture(scope="module")
def judge() -> Iterator[ScriptedLLM]:
    """An OpenAI-compatible judge: a real HTTP server (tests/support/llm.py) the workers
    reach over 127.0.0.1."""
    yield from serve(ScriptedLLM())


class Workers:
    """The module's one real ``trainyard worker`` running the real pipeline on the tiny
    model; :meth:`restart` SIGKILLs it and starts another on the same home (a run it held
    resumes from its last checkpoint there)."""

    def __init__(self, env: dict[str, str], logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.started = 0
        self.worker = self._spawn()

    def _spawn(self) -> Worker:
        self.started += 1
        return spawn_worker(self.logs / f"worker-{self.started}.log", self.env)

    def kill(self) -> None:
        self.worker.kill(signal.SIGKILL)

    def start(self) -> None:
        self.worker = self._spawn()

    def restart(self) -> None:
        self.kill()
        self.start()

    def stop(self) -> None:
        if self.worker.proc.poll() is None:
            self.worker.kill(signal.SIGKILL)


@pytest.fixture(scope="module")
def workers(
    module_database: OwnDatabase,  # noqa: F811
    ui_logs: Path,
    tiny_model: Path,  # noqa: F811
) -> Iterator[Workers]:
    env = {
        **module_database.env(),
        **FAST,
        "TRAINYARD_PIPELINE": "workers.pipeline:run_pipeline",
        "TRAINYARD_HOME": str(ui_logs / "home"),
    }
    running = Workers(env, ui_logs)
    try:
        yield running
    finally:
        running.stop()


@pytest.fixture(scope="module")
async def maker(module_database: OwnDatabase) -> AsyncIterator[Any]:  # noqa: F811
    async with sessions_on(module_database.url, pool_size=3) as m:
        yield m


@pytest.fixture(scope="module")
async def tenant(maker: Any) -> Tenant:
    return await new_tenant(maker)


@pytest.fixture(scope="module")
async def other_tenant(maker: Any) -> Tenant:
    return await new_tenant(maker)


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Any]:
    if not CHROMIUM.exists():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install chromium (never `playwright install`)")
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        b = await launch(p)
        try:
            yield b
        finally:
            await b.close()


class Page:
    """A browser tab on the API's dashboard that fails the test on any script error."""

    def __init__(self, page: Any, base: str) -> None:
        self.page = page
        self.base = base
        self.errors: list[str] = []
        page.on("pageerror", lambda exc: self.errors.append(f"pageerror: {exc}"))
        page.on(
            "console",
            lambda msg: (
                self.errors.append(f"console.{msg.type}: {msg.text}")
                if msg.type == "error"
                else None
            ),
        )

    async def sign_in(self, key: str, path: str = "/ui") -> None:
        await self.page.goto(self.base + path)
        await self.page.fill("#key", key)
        await self.page.click("#signin button[type=submit]")
        await self.until("() => window.trainyard && window.trainyard.settled === true")

    async def until(self, predicate: str, within: float = 30) -> Any:
        """Polls the function ``predicate`` in the page until it returns something truthy.
        (Playwright's wait_for_function evaluates strings with eval, which the page's CSP
        forbids, as it should.)"""
        deadline = time.monotonic() + within
        while True:
            value = await self.page.evaluate(predicate)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {within} s waiting for {predicate}")
            await asyncio.sleep(0.1)

    async def screenshot(self, name: str) -> None:
        folder = os.environ.get("TRAINYARD_SCREENSHOTS")
        if not folder:
            return
        Path(folder).mkdir(parents=True, exist_ok=True)
        await self.page.screenshot(path=str(Path(folder) / f"{name}.png"), full_page=True)


@pytest.fixture
async def page(browser: Any, api_server: ApiProcess) -> AsyncIterator[Page]:
    context = await browser.new_context(viewport={"width": 1440, "height": 1000})
    tab = Page(await context.new_page(), api_server.url)
    try:
        yield tab
    finally:
        await context.close()
    # 401/404 answers are logged by Chromium as failed resource loads; those are expected
    # where a test asks for them, so only script errors fail a test.
    real = [e for e in tab.errors if "Failed to load resource" not in e]
    assert not real, real
