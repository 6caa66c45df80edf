"""Which URLs a webhook may target: http(s) on a public address.

A webhook makes the service send requests wherever a project says, so a URL that resolves
to loopback, a private network, link-local (the cloud metadata service at 169.254.169.254)
or any other non-global address is refused unless ``webhooks_allow_private`` is set: a
project must not reach the service's own network. The check runs when a webhook is created
and again before every attempt, since what a name resolves to can change; redirects are
never followed (app/webhooks/delivery.py), so a public target cannot bounce a delivery
inward either.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket

import httpx

#: How long resolving a webhook's host may take.
RESOLVE_TIMEOUT_SECONDS = 5.0


def _private(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 zone id is not an address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_global or ip.is_multicast


async def refusal(url: str, *, allow_private: bool) -> str | None:
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
        infos = await asyncio.wait_for(
            asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM),
            RESOLVE_TIMEOUT_SECONDS,
        )
    except (OSError, TimeoutError, ValueError) as exc:
        return f"names a host that does not resolve ({exc or 'timed out'})"
    addresses = {str(info[4][0]) for info in infos}
    private = sorted(a for a in addresses if _private(a))
    if private:
        return (
            f"resolves to a loopback, private or link-local address ({', '.join(private)}); "
            "such targets need the server setting webhooks_allow_private"
        )
    return None
