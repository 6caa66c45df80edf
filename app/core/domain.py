"""Errors of the domain: what a rule said no to, with no HTTP in them.

Services, repositories and the state machine raise these; workers catch them by kind
(:class:`Conflict` when a move lost, say). The API maps each kind to its problem+json answer
in one place, :func:`app.core.errors.install_error_handlers`, so a status code never lives
beside the rule that produced it.
"""

from __future__ import annotations

from typing import Any


class DomainError(Exception):
    """Base of every domain error. ``code`` names the kind of problem for programs (the
    problem's ``type`` URI ends with it); :meth:`details` are extra members of the answer."""

    code = "domain-error"
    #: A short summary of the kind of problem, for people (None: the generic one).
    title: str | None = None

    def __init__(self, detail: str) -> None:
        super().__init__(detail)
        self.detail = detail

    def details(self) -> dict[str, Any]:
        return {}


class NotFound(DomainError):
    """The thing does not exist, or belongs to another project (which is the same to the
    caller: another project's runs are simply not there)."""

    code = "not-found"

    def __init__(self, what: str, detail: str | None = None) -> None:
        super().__init__(detail or f"{what} not found.")
        self.what = what


class Conflict(DomainError):
    """The request is valid but the resource's state does not allow it now."""

    code = "conflict"


class LimitReached(DomainError):
    """A quota of the caller's is used up; ``retry_after`` seconds is when to try again
    (None: waiting alone will not help, the caller must free something)."""

    code = "limit-reached"

    def __init__(self, detail: str, *, retry_after: int | None = None, **details: Any) -> None:
        super().__init__(detail)
        self.retry_after = retry_after
        self._details = details

    def details(self) -> dict[str, Any]:
        return dict(self._details)


class InvalidInput(DomainError):
    """The request is well-formed but names something unusable (a dataset with no train
    rows, another project's id): the answer names ``field`` as validation errors do."""

    code = "invalid-input"

    def __init__(self, detail: str, *, field: str, error_type: str | None = None) -> None:
        super().__init__(detail)
        self.field = field
        self.error_type = error_type
