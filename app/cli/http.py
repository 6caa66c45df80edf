"""The API as the commands that talk to it over HTTP see it: :class:`Api` (where it is and
the key, found as the package's docstring says), the ``--api-url`` / ``--api-key`` options,
and :func:`problem_line`, every error answer said in one line."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Any

import typer

from app.cli.common import CliError, settings

if TYPE_CHECKING:  # the CLI starts without httpx until a command talks to the API
    import httpx

DEFAULT_API_URL = "http://127.0.0.1:8000"

ApiUrl = Annotated[
    str | None,
    typer.Option(
        envvar="TRAINYARD_API_URL",
        help=f"API base URL. Default: the running `trainyard up`'s, else {DEFAULT_API_URL}.",
    ),
]
ApiKey = Annotated[
    str | None,
    typer.Option(
        envvar="TRAINYARD_API_KEY",
        help="API key. Default: the key the running `trainyard up` made.",
    ),
]
After = Annotated[str | None, typer.Option(help="The next_cursor of a previous page.")]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


# What to do about an error status, beyond what the problem says.
_HINTS = {
    401: "check --api-key / TRAINYARD_API_KEY (`trainyard keys create --project NAME` makes a key)",
}


def problem_line(response: httpx.Response) -> str:
    """One line for an error answer: status, title, detail and each field's error."""
    try:
        body = response.json()
    except ValueError:
        body = None
    fields: list[str] = []
    if isinstance(body, dict):
        title = str(body.get("title") or response.reason_phrase)
        detail = body.get("detail")
        for error in body.get("errors") or []:
            if isinstance(error, dict):
                one = f"{error.get('field')}: {error.get('message')}"
                fields.append(one)
                if detail in (one, error.get("message")):
                    detail = None  # said once, with its field
    else:
        title, detail = response.reason_phrase, response.text.strip()[:300] or None
    said = [f"{response.status_code} {title}"]
    if detail and detail != title:
        said.append(str(detail).rstrip("."))
    said.extend(fields)
    line = ": ".join(said[:2]) + "".join(f"; {f}" for f in said[2:])
    if response.status_code == 429 and response.headers.get("Retry-After"):
        line += f"; retry after {response.headers['Retry-After']} s"
    if hint := _HINTS.get(response.status_code):
        line += f"; {hint}"
    return " ".join(line.split())


class Api:
    """The API a command talks to: ``--api-url`` / ``TRAINYARD_API_URL``, else the running
    ``trainyard up``'s, else :data:`DEFAULT_API_URL`; and a key for it."""

    def __init__(self, api_url: str | None, api_key: str | None) -> None:
        from app.cli.installation import find_installation

        found = find_installation(settings()) if not (api_url and api_key) else None
        self.url = (api_url or (found.api_url if found else DEFAULT_API_URL)).rstrip("/")
        key = api_key
        # The up's key goes only to the up's API, never to a URL someone else typed.
        if not key and found is not None and found.api_url.rstrip("/") == self.url:
            key = found.api_key
        if not key:
            raise CliError(
                "no API key: pass --api-key or set TRAINYARD_API_KEY (`trainyard keys create "
                "--project NAME` makes one; a running `trainyard up` provides its own)"
            )
        self.key = key

    def call(self, method: str, path: str, **kwargs: Any) -> Any:
        """The JSON answer; a :class:`CliError` for an error answer or no answer."""
        import httpx

        try:
            with httpx.Client(base_url=self.url, headers=auth(self.key), timeout=30) as c:
                response = c.request(method, path, **kwargs)
        except httpx.ConnectError as exc:
            raise CliError(
                f"cannot reach the API at {self.url} ({exc}): is `trainyard up` running? "
                "(or pass --api-url / set TRAINYARD_API_URL)"
            ) from exc
        except httpx.TimeoutException as exc:
            raise CliError(f"the API at {self.url} did not answer within 30 s") from exc
        except (httpx.HTTPError, httpx.InvalidURL) as exc:
            raise CliError(f"talking to the API at {self.url} failed: {exc}") from exc
        if response.status_code >= 400:
            raise CliError(problem_line(response))
        return response.json()

    def client(self) -> httpx.Client:
        """A client of the caller's own, for a stream."""
        import httpx

        return httpx.Client(base_url=self.url, headers=auth(self.key), timeout=30)

    @contextlib.contextmanager
    def problems(self) -> Iterator[None]:
        """An error answer or a lost API, met mid-way through a command that holds a client
        of its own (a stream), said in one line as :meth:`call` says it."""
        import httpx

        try:
            yield
        except httpx.HTTPStatusError as exc:
            raise CliError(problem_line(exc.response)) from exc
        except httpx.TransportError as exc:
            raise CliError(f"talking to the API at {self.url} failed: {exc}") from exc
