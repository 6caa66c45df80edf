"""What every command shares: :class:`CliError` (an error the user can act on) and the
group class that prints every error as one line with an exit status; the stderr console,
the ``--json`` option, JSON and plain tables on stdout; the settings, read when a command
needs them."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.console import Console
from typer.core import TyperGroup

if TYPE_CHECKING:  # pydantic-settings loads when a command reads the settings
    from app.core.settings import Settings


class CliError(Exception):
    """An error the user can act on: printed as one line, exit status ``code``."""

    def __init__(self, message: str, code: int = 1) -> None:
        super().__init__(message)
        self.code = code


class OneLineErrors(TyperGroup):
    """Turns every error of every subcommand into one line and an exit status; a
    traceback only with ``TRAINYARD_DEBUG=1``."""

    def invoke(self, ctx: Any) -> Any:  # typer's vendored click.Context
        try:
            return super().invoke(ctx)
        except (typer.Exit, typer.Abort):
            raise
        except CliError as exc:
            fail(str(exc), exc.code)
        except Exception as exc:
            from app.cli.installation import NoInstallation

            if isinstance(exc, NoInstallation):
                fail(str(exc), 1)
            # Usage errors (typer's vendored click.ClickException) print themselves.
            if hasattr(exc, "exit_code") and hasattr(exc, "show"):
                raise
            if os.environ.get("TRAINYARD_DEBUG"):
                raise
            fail(f"{type(exc).__name__}: {exc} (TRAINYARD_DEBUG=1 shows the traceback)", 1)


def fail(message: str, code: int) -> NoReturn:
    # print, not rich: rich wraps at 80 columns without a terminal, and reads [..] as markup.
    print(f"error: {' '.join(message.split())}", file=sys.stderr, flush=True)
    raise typer.Exit(code)


err = Console(stderr=True, soft_wrap=True)

Json = Annotated[bool, typer.Option("--json", help="Print the data as JSON on stdout.")]


def print_json(data: Any) -> None:
    print(json.dumps(data, indent=2), flush=True)


def settings() -> Settings:
    from app.core.settings import get_settings

    return get_settings()


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """Plain columns, nothing cut: ids must stay whole to be pasted."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    lines = [headers, *rows]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(line, widths, strict=True)).rstrip()
        for line in lines
    )


def shown(value: Any, limit: int = 40) -> str:
    """A value in one line of at most ``limit`` characters, for a table cell."""
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
