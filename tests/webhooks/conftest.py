"""Webhook tests: apps with the webhook routes (one that allows private targets, since the
receiver is on loopback, and one with the default settings), and a receiver per test."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from app.core.settings import Settings, get_settings
from tests.support.database import app_on, client_of
from tests.webhooks.receiver import Receiver


@pytest.fixture(scope="session")
def private_settings(service_urls: tuple[str, str]) -> Settings:
    return get_settings().model_copy(update={"webhooks_allow_private": True})


@pytest.fixture(scope="session")
async def private_api(private_settings: Settings) -> AsyncIterator[Any]:
    async with app_on(private_settings) as application:
        yield application


@pytest.fixture(scope="session")
async def public_api(service_urls: tuple[str, str]) -> AsyncIterator[Any]:
    async with app_on(get_settings()) as application:
        yield application


@pytest.fixture
async def private_client(private_api: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with client_of(private_api) as c:
        yield c


@pytest.fixture
async def public_client(public_api: Any) -> AsyncIterator[httpx.AsyncClient]:
    async with client_of(public_api) as c:
        yield c


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    r = Receiver()
    try:
        yield r
    finally:
        r.stop()
