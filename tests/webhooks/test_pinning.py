"""Deliveries connect to an address that was checked: no DNS rebinding.

The resolver and the sockets the delivery transport uses are injected: :class:`Rebinding`
answers a public address the first time it is asked and 127.0.0.1 every time after, as an
attacker's DNS server would; :class:`Network` makes real connections to loopback (where the
real receiver listens) and records, then refuses as unreachable, any other address, so no
test sends anything off this machine. A sender that checked the name and then let the
connection resolve it again would reach the receiver; this one asks once and connects to
what it checked.
"""

from __future__ import annotations

import asyncio
import shutil
import ssl
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import httpcore
import httpx
import pytest

from app.runs.lifecycle.state import transition
from app.runs.lifecycle.status import RunStatus
from app.webhooks.delivery import deliver_due
from app.webhooks.targets import Refused, refusal, resolve
from app.webhooks.transport import WebhookTransport
from tests.support.runs import create_run
from tests.webhooks.receiver import Receiver
from tests.webhooks.test_delivery import NOW, deliveries

#: Public-looking (global) addresses; nothing is ever sent to them.
PUBLIC = "93.184.216.34"
PUBLIC_TOO = "93.184.216.35"
LOOPBACK = "127.0.0.1"


class Rebinding:
    """A resolver whose name ``name`` answers ``first`` once and ``then`` ever after; any
    other host (another test's leftover delivery) goes to the system resolver."""

    def __init__(self, name: str, first: Sequence[str], then: Sequence[str] = (LOOPBACK,)) -> None:
        self.name, self.first, self.then = name, list(first), list(then)
        self.asked: list[int] = []  # the ports ``name`` was asked for

    async def __call__(self, host: str, port: int) -> list[str]:
        if host != self.name:
            return await resolve(host, port)
        self.asked.append(port)
        return self.first if len(self.asked) == 1 else self.then


class Network(httpcore.AsyncNetworkBackend):
    """Real sockets to loopback; any other address recorded and refused as unreachable."""

    def __init__(self) -> None:
        self.connects: list[tuple[str, int]] = []
        self._real = httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        self.connects.append((host, port))
        if host != LOOPBACK:
            raise httpcore.ConnectError(f"{host} is unreachable from the tests")
        return await self._real.connect_tcp(host, port, timeout=timeout)

    async def sleep(self, seconds: float) -> None:
        await self._real.sleep(seconds)


@pytest.fixture
async def hook_on(
    private_client: Any, tenant: Any
) -> AsyncIterator[Callable[[Receiver, str, str], Awaitable[str]]]:
    """Makes a webhook on a URL (where private targets are allowed, so it is not resolved
    then); deleted afterwards, so its outbox rows do not reach other tests' senders."""
    made: list[str] = []

    async def make(receiver: Receiver, url: str, path: str) -> str:
        r = await private_client.post(
            "/webhooks", json={"url": url, "event_types": ["run.cancelled"]}, headers=tenant.headers
        )
        assert r.status_code == 201, r.text
        receiver.secrets[path] = r.json()["secret"]
        made.append(str(r.json()["id"]))
        return made[-1]

    yield make
    for webhook_id in made:
        await private_client.delete(f"/webhooks/{webhook_id}", headers=tenant.headers)


async def cancel_a_run(sessionmaker: Any, tenant: Any) -> None:
    run = await create_run(sessionmaker, project_id=tenant.project_id)
    async with sessionmaker() as s:
        await transition(s, run.id, RunStatus.CANCELLED)
        await s.commit()


def to(network: Network, port: int) -> list[str]:
    """The addresses ``network`` was asked to connect to on ``port`` (one test's receiver:
    other tests' leftover deliveries may be sent in the same pass)."""
    return [host for host, p in network.connects if p == port]


async def test_a_name_rebound_to_loopback_never_reaches_it(
    hook_on, private_client, private_settings, sessionmaker, tenant, receiver
) -> None:
    receiver.start()
    name = "rebind.example.test"
    webhook_id = await hook_on(receiver, f"http://{name}:{receiver.port}/rebind", "/rebind")
    await cancel_a_run(sessionmaker, tenant)
    strict = private_settings.model_copy(update={"webhooks_allow_private": False})
    resolver, network = Rebinding(name, [PUBLIC]), Network()

    await deliver_due(sessionmaker, strict, backoff=NOW, resolve=resolver, network=network)
    # Asked once; the connection went to the public address that answer gave, not to a
    # second answer's 127.0.0.1, where the receiver is.
    assert resolver.asked == [receiver.port]
    assert to(network, receiver.port) == [PUBLIC]
    assert receiver.received == []
    [row] = await deliveries(private_client, tenant, webhook_id)
    assert row["state"] == "pending", row
    assert row["last_error"] == f"ConnectError: {PUBLIC} is unreachable from the tests"

    # The retry asks again, hears 127.0.0.1, and connects nowhere.
    await deliver_due(sessionmaker, strict, backoff=NOW, resolve=resolver, network=network)
    assert resolver.asked == [receiver.port] * 2
    assert to(network, receiver.port) == [PUBLIC]
    assert receiver.received == []
    [row] = await deliveries(private_client, tenant, webhook_id)
    assert row["last_error"] == (
        "not sent: the url resolves to a loopback, private or link-local address (127.0.0.1); "
        "such targets need the server setting webhooks_allow_private"
    )


async def test_an_allowed_name_arrives_with_its_host_header(
    hook_on, private_client, private_settings, sessionmaker, tenant, receiver
) -> None:
    # The same resolver and sockets as above do reach the receiver where private targets
    # are allowed: what kept it out there is the check, not the test's plumbing.
    receiver.start()
    name = "hooks.example.test"
    webhook_id = await hook_on(receiver, f"http://{name}:{receiver.port}/named", "/named")
    await cancel_a_run(sessionmaker, tenant)
    resolver, network = Rebinding(name, [LOOPBACK]), Network()

    await deliver_due(
        sessionmaker, private_settings, backoff=NOW, resolve=resolver, network=network
    )
    assert resolver.asked == [receiver.port]
    assert to(network, receiver.port) == [LOOPBACK]
    [got] = receiver.received
    assert (got.path, got.verified, got.answered) == ("/named", True, 204)
    assert got.host == f"{name}:{receiver.port}"
    [row] = await deliveries(private_client, tenant, webhook_id)
    assert (row["state"], row["attempts"]) == ("delivered", 1), row


async def post(transport: WebhookTransport, url: str) -> httpx.Response:
    async with httpx.AsyncClient(transport=transport, trust_env=False) as client:
        return await client.post(url, content=b"{}")


async def test_every_address_is_checked_before_any_connection() -> None:
    resolver, network = Rebinding("mixed.example.test", [PUBLIC, LOOPBACK]), Network()
    transport = WebhookTransport(allow_private=False, resolve=resolver, network=network)
    with pytest.raises(Refused, match=r"loopback, private or link-local address \(127\.0\.0\.1\)"):
        await post(transport, "http://mixed.example.test:8080/hook")
    assert resolver.asked == [8080]
    assert network.connects == []


async def test_the_checked_addresses_are_tried_in_order() -> None:
    resolver, network = Rebinding("two.example.test", [PUBLIC, PUBLIC_TOO]), Network()
    transport = WebhookTransport(allow_private=False, resolve=resolver, network=network)
    with pytest.raises(httpx.ConnectError, match=PUBLIC_TOO):  # the last one's failure
        await post(transport, "http://two.example.test/hook")
    assert resolver.asked == [80]
    assert network.connects == [(PUBLIC, 80), (PUBLIC_TOO, 80)]


@pytest.mark.parametrize(
    ("answer", "why"),
    [
        (["10.1.2.3"], "resolves to a loopback, private or link-local address (10.1.2.3)"),
        ([PUBLIC, "169.254.169.254"], "address (169.254.169.254)"),
        (["::ffff:127.0.0.1"], "address (::ffff:127.0.0.1)"),
        (["not-an-address"], "address (not-an-address)"),
        ([], "names a host that does not resolve (no address)"),
        ([PUBLIC], None),
    ],
)
async def test_the_creation_check_asks_the_same_resolver(
    answer: list[str], why: str | None
) -> None:
    resolver = Rebinding("x.example.test", answer)
    got = await refusal("https://x.example.test/h", allow_private=False, resolve=resolver)
    assert got == why if why is None else (got is not None and why in got), got
    assert resolver.asked == [443]


# --- https: SNI and the certificate are the name's, the socket the checked address's ---------


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A self-signed certificate for hooks.example.test (its own CA): (cert, key)."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a certificate")
    where = tmp_path_factory.mktemp("tls")
    cert, key = where / "cert.pem", where / "key.pem"
    name = "hooks.example.test"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-nodes", "-days", "1"),
            *("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1"),
            *("-keyout", str(key), "-out", str(cert)),
            *("-subj", f"/CN={name}", "-addext", f"subjectAltName=DNS:{name}"),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


async def test_https_keeps_the_name_for_sni_certificate_and_host(
    certificate: tuple[Path, Path],
) -> None:
    cert, key = certificate
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)
    sni: list[str | None] = []
    hosts: list[str] = []

    def record_sni(_sock: ssl.SSLObject, name: str | None, _ctx: ssl.SSLContext) -> None:
        sni.append(name)

    server_tls.sni_callback = record_sni

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        fields = dict(line.split(": ", 1) for line in head.split("\r\n")[1:] if ": " in line)
        hosts.append(next(v for k, v in fields.items() if k.lower() == "host"))
        writer.write(b"HTTP/1.1 204 No Content\r\ncontent-length: 0\r\n\r\n")
        await writer.drain()
        writer.close()

    async def loopback(host: str, port: int) -> list[str]:
        return [LOOPBACK]

    network = Network()
    trust = ssl.create_default_context(cafile=str(cert))

    def transport() -> WebhookTransport:
        return WebhookTransport(allow_private=True, resolve=loopback, network=network, verify=trust)

    async with await asyncio.start_server(answer, LOOPBACK, 0, ssl=server_tls) as server:
        port = server.sockets[0].getsockname()[1]
        r = await post(transport(), f"https://hooks.example.test:{port}/tls")
        assert r.status_code == 204
        assert network.connects == [(LOOPBACK, port)]
        assert sni == ["hooks.example.test"]
        assert hosts == [f"hooks.example.test:{port}"]

        # Another name on the same address: the certificate is checked against the URL's
        # name, so the handshake fails there.
        with pytest.raises(httpx.ConnectError, match="certificate verify failed"):
            await post(transport(), f"https://other.example.test:{port}/tls")
        assert sni[-1] == "other.example.test"
        assert len(hosts) == 1
