"""Debian's headless Chromium as this project drives it, through Playwright for Python with
``executable_path`` (never a downloaded browser): the dashboard tests (tests/ui) and the
dashboard benchmark (bench/dashboard.py) launch the same browser with the same flags."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

CHROMIUM = Path(os.environ.get("TRAINYARD_CHROMIUM", "/usr/bin/chromium"))
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


async def launch(playwright: Any) -> Any:
    """The browser, from ``async_playwright()``'s object."""
    return await playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
