"""Episode tokens: ``tye_<episode id hex>_<secret>``. A token opens its episode's claim and
nothing else: only its hash is stored, on the episode, and a new claim replaces it."""

from __future__ import annotations

import hashlib
import secrets
import uuid

PREFIX = "tye_"


def new_secret() -> str:
    return secrets.token_urlsafe(24)


def token(episode_id: uuid.UUID, secret: str) -> str:
    return f"{PREFIX}{episode_id.hex}_{secret}"


def digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def parse(value: str) -> tuple[uuid.UUID, str] | None:
    """The episode a token names and the hash of its secret; None: not an episode token."""
    if not value.startswith(PREFIX):
        return None
    head, sep, secret = value[len(PREFIX) :].partition("_")
    if not sep or not secret:
        return None
    try:
        return uuid.UUID(hex=head), digest(secret)
    except ValueError:
        return None
