"""Hand-written SQL for asyncpg: ``WHERE`` clauses built one filter at a time."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class Where:
    """``WHERE`` clauses with ``$n`` parameters, built up one filter at a time."""

    def __init__(self, params: Sequence[Any] = ()) -> None:
        self.clauses: list[str] = []
        self.params: list[Any] = list(params)

    def param(self, value: Any) -> str:
        self.params.append(value)
        return f"${len(self.params)}"

    def add(self, clause: str) -> None:
        self.clauses.append(clause)

    def among(self, column: str, values: Sequence[Any], sql_type: str) -> None:
        """``column`` is one of ``values``: ``=`` for one value, so the planner can walk an
        index in order (``= ANY`` over several cannot)."""
        if len(values) == 1:
            self.add(f"{column} = {self.param(values[0])}")
        else:
            self.add(f"{column} = ANY({self.param(list(values))}::{sql_type}[])")

    def sql(self) -> str:
        return " AND ".join(self.clauses) if self.clauses else "true"
