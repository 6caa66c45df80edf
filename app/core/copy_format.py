"""PostgreSQL ``COPY … FROM STDIN`` text format, for the bulk loads (datasets, trajectory
imports, benchmarks)."""

from __future__ import annotations


def copy_field(value: str) -> str:
    """``value`` as a field of COPY's text format (most need no escaping)."""
    if "\\" in value:
        value = value.replace("\\", "\\\\")
    if "\n" in value:
        value = value.replace("\n", "\\n")
    if "\r" in value:
        value = value.replace("\r", "\\r")
    if "\t" in value:
        value = value.replace("\t", "\\t")
    return value


NULL = "\\N"
