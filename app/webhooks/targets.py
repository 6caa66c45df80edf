"""Which URLs a webhook may target: http(s) on a public address.

A webhook makes the service send requests wherever a project says, so a URL that resolves
to loopback, a private network, link-local (the cloud metadata service at 169.254.169.254)
or any other non-global address is refused unless ``webhooks_allow_private`` is set: a
project must not reach the service's own network. The check runs when a webhook is created
(:func:`refusal`) and again for every connection a delivery opens
(:mod:`app.webhooks.transport`), where the host is resolved once, every address it resolves
to is checked, and the connection goes to one of those checked addresses: a name that
answers one address to a check and another to the connect (DNS rebinding) gets no second
question. Redirects are never followed (app/webhooks/delivery.py), so a public target cannot
bounce a delivery inward either.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence

import httpx

#: How long resolving a webhook's host may take.
RESOLVE_TIMEOUT_SECONDS = 5.0

#: How a host is resolved: ``(host, port)`` to its addresses, as strings, in the order to
#: try them. Injectable so that tests can play a resolver whose answers change.
Resolve = Callable[[str, int], Awaitable[Sequence[str]]]


class Refused(Exception):
    """A target that is not to be sent to now; the message says why ("resolves to …")."""


async def resolve(host: str, port: int) -> list[str]:
    """The system resolver's addresses for ``host``, each once, in its order."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def _private(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone id is not an address
    except ValueError:
        return True  # not an address at all: nothing to connect to safely
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_global or ip.is_multicast


async def addresses(
    host: str, port: int, *, allow_private: bool, resolve: Resolve = resolve
) -> list[str]:
    """Resolve ``host`` once and return its addresses, every one of them checked public
    unless ``allow_private``; raises :class:`Refused` otherwise or if it does not resolve.

    A connection made to one of these (not to the name) reaches an address that was checked.
    """
    try:
        found = list(await asyncio.wait_for(resolve(host, port), RESOLVE_TIMEOUT_SECONDS))
    except (OSError, TimeoutError, ValueError) as exc:  # ValueError: IDNA's UnicodeError too
        raise Refused(f"names a host that does not resolve ({str(exc) or 'timed out'})") from exc
    if not found:
        raise Refused("names a host that does not resolve (no address)")
    if not allow_private:
        private = sorted({a for a in found if _private(a)})
        if private:
            raise Refused(
                f"resolves to a loopback, private or link-local address ({', '.join(private)}); "
                "such targets need the server setting webhooks_allow_private"
            )
    return found


async def refusal(url: str, *, allow_private: bool, resolve: Resolve = resolve) -> str | None:
    """Why ``url`` may not be a webhook target now, or None."""
    try:
        # The parse httpx makes when it sends: what is checked is what it connects to.
        parsed = httpx.URL(url)
        host = parsed.host
        host.encode("idna")  # what the resolver is given: labels of 1 to 63 characters
    except (httpx.InvalidURL, ValueError) as exc:  # ValueError: IDNA's UnicodeError too
        return f"is not a valid URL: {exc}"
    if parsed.scheme not in ("http", "https"):
        return "must be an http or https URL"
    if not host:
        return "must name a host"
    if parsed.port is not None and not 0 < parsed.port < 65536:
        return "must name a port from 1 to 65535"
    if allow_private:
        return None
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    try:
        await addresses(host, port, allow_private=False, resolve=resolve)
    except Refused as exc:
        return str(exc)
    return None
