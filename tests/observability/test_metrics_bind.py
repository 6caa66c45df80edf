"""The metrics ports (``metrics_port``, ``worker_metrics_port``) listen on loopback unless
``metrics_host`` says otherwise: a port of its own is not exposed to the network by default."""

from __future__ import annotations

import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from wsgiref.simple_server import WSGIServer

import psutil
import pytest

from app.core.settings import Settings
from app.observability import prometheus


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def other_addresses() -> list[str]:
    """This machine's IPv4 addresses that are not loopback."""
    return [
        a.address
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family == socket.AF_INET and not a.address.startswith("127.")
    ]


def reachable(address: str, port: int) -> bool:
    try:
        socket.create_connection((address, port), timeout=2).close()
    except OSError:
        return False
    return True


@pytest.fixture
def servers() -> Iterator[list[WSGIServer]]:
    started: list[WSGIServer] = []
    yield started
    for server in started:
        server.shutdown()
        server.server_close()


def test_the_setting_defaults_to_loopback(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings.model_fields["metrics_host"].default == "127.0.0.1"
    monkeypatch.setenv("TRAINYARD_METRICS_HOST", "0.0.0.0")
    assert Settings().metrics_host == "0.0.0.0"


def test_serve_binds_loopback_only_by_default(servers: list[WSGIServer]) -> None:
    port = free_port()
    server = prometheus.serve(port, "s3cret")
    assert server is not None
    servers.append(server)
    assert server.socket.family == socket.AF_INET
    assert server.socket.getsockname() == ("127.0.0.1", port)
    # Served there, behind the token.
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/metrics", headers={"authorization": "Bearer s3cret"}
    )
    with urllib.request.urlopen(request, timeout=5) as r:
        assert r.status == 200
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)
    assert refused.value.code == 401
    # Not on this machine's other addresses (where it has any).
    for address in other_addresses():
        assert not reachable(address, port), address


def test_serve_binds_the_host_it_is_given(servers: list[WSGIServer]) -> None:
    port = free_port()
    server = prometheus.serve(port, None, "0.0.0.0")
    assert server is not None
    servers.append(server)
    assert server.socket.getsockname() == ("0.0.0.0", port)
    for address in ["127.0.0.1", *other_addresses()]:
        assert reachable(address, port), address


def test_worker_metrics_bind_loopback_unless_told(servers: list[WSGIServer]) -> None:
    assert prometheus.start_worker_metrics(None) is None
    default, given = free_port(), free_port()
    for server in (
        prometheus.start_worker_metrics(default),
        prometheus.start_worker_metrics(given, None, "0.0.0.0"),
    ):
        assert server is not None
        servers.append(server)
    assert [s.socket.getsockname() for s in servers] == [
        ("127.0.0.1", default),
        ("0.0.0.0", given),
    ]
