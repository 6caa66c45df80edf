"""The options of the one export command family, declared once: ``trajectories export``
(over HTTP, ``GET /trajectories/export``) and ``data export`` (straight from the database,
:func:`app.training_data.export_jsonl`) both take every field of :class:`ExportOptions`, in
its order, through :func:`export_options`. A filter added here is an option of both; each
field names what the API's query and the library call it, so neither can drop it silently.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Annotated, Any, TypeVar, get_type_hints

import typer

from app.cli.common import CliError

T = TypeVar("T")


def _names(query: str, library: str) -> dict[str, str]:
    """A field's names in the API's query and in the library's call."""
    return {"query": query, "library": library}


@dataclass(frozen=True)
class ExportOptions:
    """What is exported: the trajectories matching every filter given, at most ``limit``,
    with or without their messages. Dates stay as typed here: the API parses its own, and
    :meth:`library` parses them for the database."""

    run_id: Annotated[list[str] | None, typer.Option(help="Repeatable.")] = field(
        default=None, metadata=_names("run_id", "run_ids")
    )
    learning_key: Annotated[list[str] | None, typer.Option(help="Repeatable.")] = field(
        default=None, metadata=_names("learning_key", "learning_key")
    )
    status: Annotated[list[str] | None, typer.Option(help="The run's status; repeatable.")] = field(
        default=None, metadata=_names("status", "statuses")
    )
    step: Annotated[list[int] | None, typer.Option(help="Repeatable.")] = field(
        default=None, metadata=_names("step", "steps")
    )
    min_reward: Annotated[float | None, typer.Option(help="Inclusive.")] = field(
        default=None, metadata=_names("min_reward", "min_reward")
    )
    max_reward: Annotated[float | None, typer.Option(help="Inclusive.")] = field(
        default=None, metadata=_names("max_reward", "max_reward")
    )
    min_tool_calls: Annotated[
        int | None, typer.Option(min=0, help="Agent episodes with at least this many tool calls.")
    ] = field(default=None, metadata=_names("min_tool_calls", "min_tool_calls"))
    since: Annotated[
        str | None, typer.Option(help="ISO date, or date and time (no zone: UTC).")
    ] = field(default=None, metadata=_names("start_date", "start_date"))
    until: Annotated[
        str | None, typer.Option(help="ISO date, or date and time (no zone: UTC); inclusive.")
    ] = field(default=None, metadata=_names("end_date", "end_date"))
    limit: Annotated[int | None, typer.Option(min=1)] = field(
        default=None, metadata=_names("limit", "limit")
    )
    messages: Annotated[bool, typer.Option(help="Include the messages.")] = field(
        default=True, metadata=_names("include_messages", "include_messages")
    )

    def query(self) -> dict[str, Any]:
        """The options given, as ``GET /trajectories/export``'s query."""
        named = {f.metadata["query"]: getattr(self, f.name) for f in fields(self)}
        named["include_messages"] = "true" if self.messages else "false"
        return {name: value for name, value in named.items() if value is not None}

    def library(self) -> dict[str, Any]:
        """The options as :func:`app.training_data.export_jsonl`'s keyword arguments; a date
        that does not parse is a usage error (exit status 2) naming its option."""
        named = {f.metadata["library"]: getattr(self, f.name) for f in fields(self)}
        named["start_date"] = _instant("since", self.since)
        named["end_date"] = _instant("until", self.until)
        return named


def _instant(option: str, value: str | None) -> Any:
    from app.core.time import parse_day_or_instant

    if value is None:
        return None
    try:
        return parse_day_or_instant(value)
    except ValueError as exc:
        raise CliError(f"--{option} {value!r}: {exc}", code=2) from exc


def export_options(command: Callable[..., T]) -> Callable[..., T]:
    """``command`` with its parameter annotated :class:`ExportOptions` spelled out for Typer
    as one option per field, in its place; the command gets them back as one value."""
    signature = inspect.signature(command, eval_str=True)
    (name,) = (p.name for p in signature.parameters.values() if p.annotation is ExportOptions)
    hints = get_type_hints(ExportOptions, include_extras=True)
    spelled = [
        inspect.Parameter(
            f.name, inspect.Parameter.KEYWORD_ONLY, default=f.default, annotation=hints[f.name]
        )
        for f in fields(ExportOptions)
    ]
    parameters: list[inspect.Parameter] = []
    for parameter in signature.parameters.values():
        parameters += spelled if parameter.name == name else [parameter]
    # Keyword-only after the others, in that order: Typer calls a command by keyword.
    parameters = [p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in parameters]

    @functools.wraps(command)
    def typed(**given: Any) -> T:
        options = ExportOptions(**{f.name: given.pop(f.name) for f in fields(ExportOptions)})
        return command(**given, **{name: options})

    typed.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    typed.__annotations__ = {p.name: p.annotation for p in parameters}
    return typed
