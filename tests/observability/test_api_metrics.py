"""``GET /metrics`` on the in-process app: the request counter, route templates as labels,
the token, and the setting that turns it off or moves it to a port of its own."""

from __future__ import annotations

import uuid

import httpx
import pytest

from app.core.settings import get_settings
from app.observability import prometheus
from tests.support.cli import free_port
from tests.support.database import Tenant, app_on, client_of
from tests.support.prometheus import samples, value

REQUESTS = "trainyard_http_requests_total"


async def scrape(client: httpx.AsyncClient, **headers: str) -> str:
    answer = await client.get("/metrics", headers=headers)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/plain")
    return answer.text


async def test_request_counter_moves_by_route_template_and_status(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    before = await scrape(client)
    for _ in range(3):
        assert (await client.get("/healthz")).status_code == 200
    missing = [uuid.uuid4() for _ in range(2)]
    for run_id in missing:
        answer = await client.get(f"/runs/{run_id}", headers=tenant.headers)
        assert answer.status_code == 404
    after = await scrape(client)

    def moved(**labels: str) -> float:
        return value(after, REQUESTS, **labels) - value(before, REQUESTS, **labels)

    assert moved(method="GET", route="/healthz", status="200") == 3
    # Two different ids, one series: the label is the template, never the path.
    assert moved(method="GET", route="/runs/{run_id}", status="404") == 2
    assert not any(str(run_id) in after for run_id in missing)
    # The histogram counted the same requests, the in-flight gauge holds this scrape only.
    timed = "trainyard_http_request_duration_seconds_count"
    assert value(after, timed, route="/healthz") - value(before, timed, route="/healthz") == 3
    assert value(after, "trainyard_http_requests_in_flight") == 1


async def test_unknown_paths_and_methods_share_one_label(client: httpx.AsyncClient) -> None:
    before = await scrape(client)
    for path in ("/nope", "/nope/deeper", f"/{uuid.uuid4()}"):
        assert (await client.get(path)).status_code == 404
    assert (await client.request("BREW", "/healthz")).status_code == 405
    after = await scrape(client)
    unmatched = {"route": prometheus.UNMATCHED, "status": "404"}
    assert value(after, REQUESTS, **unmatched) - value(before, REQUESTS, **unmatched) == 3
    routes = {dict(labels).get("route") for (name, labels) in samples(after) if name == REQUESTS}
    assert not {r for r in routes if r and r.startswith("/nope")}
    other = {"method": "OTHER", "status": "405"}
    assert value(after, REQUESTS, **other) - value(before, REQUESTS, **other) == 1
    assert 'method="BREW"' not in after


async def test_token_is_required_when_set(service_urls: tuple[str, str]) -> None:
    settings = get_settings().model_copy(update={"metrics_token": "s3cret"})
    async with app_on(settings) as application, client_of(application) as client:
        bare = await client.get("/metrics")
        assert bare.status_code == 401
        assert bare.headers["content-type"] == "application/problem+json"
        assert bare.headers["www-authenticate"] == "Bearer"
        wrong = await client.get("/metrics", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401
        text = await scrape(client, Authorization="Bearer s3cret")
        assert REQUESTS in text


async def test_disabled_means_no_route(service_urls: tuple[str, str]) -> None:
    settings = get_settings().model_copy(update={"metrics_enabled": False})
    async with app_on(settings) as application, client_of(application) as client:
        assert (await client.get("/metrics")).status_code == 404


@pytest.mark.parametrize("token", [None, "s3cret"])
async def test_metrics_port_serves_them_apart_from_the_api(
    service_urls: tuple[str, str], token: str | None
) -> None:
    port = free_port()
    settings = get_settings().model_copy(update={"metrics_port": port, "metrics_token": token})
    async with app_on(settings) as application, client_of(application) as client:
        assert (await client.get("/healthz")).status_code == 200
        assert (await client.get("/metrics")).status_code == 404  # not on the API's port
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as own:
            headers = {"Authorization": f"Bearer {token}"} if token else {}
            if token:
                assert (await own.get("/metrics")).status_code == 401
            answer = await own.get("/metrics", headers=headers)
            assert answer.status_code == 200
            assert value(answer.text, REQUESTS, route="/healthz", status="200") >= 1
    # The lifespan's end closed the port.
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as own:
        with pytest.raises(httpx.ConnectError):
            await own.get("/metrics")
