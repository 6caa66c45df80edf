"""The HTTP transport deliveries go through: every connection to a checked address.

httpx resolves a URL's host itself when it connects, so a check made before the request
(:func:`app.webhooks.targets.refusal`) and the connection would ask the resolver twice, and
a name answering a public address to the first and 127.0.0.1 to the second (DNS rebinding)
would reach the service's own network. Here the connection step is replaced instead: an
httpcore network backend whose ``connect_tcp`` resolves the host once, checks every address
(:func:`app.webhooks.targets.addresses`) and connects to those addresses, in order, until one
answers. Nothing else changes: the request still carries the URL's host, so the ``Host``
header, the TLS SNI and the certificate's hostname check are all the name's, and connections
are pooled by name as usual, each one checked when it was opened.
"""

from __future__ import annotations

import ssl
from collections.abc import Iterable
from typing import Any

import httpcore
import httpx

from app.webhooks.targets import Refused, Resolve, addresses, resolve


class CheckedBackend(httpcore.AsyncNetworkBackend):
    """Connects to an address of the host that :func:`~app.webhooks.targets.addresses`
    returned (checked public unless ``allow_private``), never to the name.

    A target refused raises :class:`~app.webhooks.targets.Refused` (httpx passes it through
    untouched); a failed connection raises the inner backend's error for the last address.
    """

    def __init__(
        self,
        *,
        allow_private: bool,
        resolve: Resolve = resolve,
        network: httpcore.AsyncNetworkBackend | None = None,
    ) -> None:
        self._allow_private = allow_private
        self._resolve = resolve
        self._network = network or httpcore.AnyIOBackend()

    async def connect_tcp(
        self,
        host: str,
        port: int,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
        local_address: str | None = None,
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        checked = await addresses(
            host, port, allow_private=self._allow_private, resolve=self._resolve
        )
        failure: Exception | None = None
        for address in checked:
            try:
                return await self._network.connect_tcp(
                    address,
                    port,
                    timeout=timeout,
                    local_address=local_address,
                    socket_options=socket_options,
                )
            except (httpcore.ConnectError, httpcore.ConnectTimeout) as exc:
                failure = exc
        assert failure is not None  # addresses() returns at least one
        raise failure

    async def connect_unix_socket(
        self,
        path: str,
        timeout: float | None = None,  # noqa: ASYNC109 (httpcore's signature)
        socket_options: Iterable[Any] | None = None,
    ) -> httpcore.AsyncNetworkStream:
        raise Refused("is a unix socket, which webhooks never use")

    async def sleep(self, seconds: float) -> None:
        await self._network.sleep(seconds)


class WebhookTransport(httpx.AsyncHTTPTransport):
    """httpx's transport with its connections made by :class:`CheckedBackend`; no proxy,
    certificates verified against the URL's host (``verify``: a context for tests)."""

    def __init__(
        self,
        *,
        allow_private: bool,
        resolve: Resolve = resolve,
        network: httpcore.AsyncNetworkBackend | None = None,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        super().__init__(verify=verify, trust_env=False)
        limits = httpx.Limits(max_connections=100, max_keepalive_connections=20)  # httpx's own
        # httpx 0.28 (pinned) takes no network backend, so its pool (what the transport sends
        # through) is rebuilt with ours. tests/webhooks/test_pinning.py fails if a later httpx
        # stops using it: the resolver would not be asked.
        self._pool = httpcore.AsyncConnectionPool(
            ssl_context=httpx.create_ssl_context(verify=verify, trust_env=False),
            max_connections=limits.max_connections,
            max_keepalive_connections=limits.max_keepalive_connections,
            keepalive_expiry=limits.keepalive_expiry,
            network_backend=CheckedBackend(
                allow_private=allow_private, resolve=resolve, network=network
            ),
        )
