"""The report: the writer of a generated section of docs/benchmarks.md, the lines every
section opens with, number formats, quantiles and a timer."""

from __future__ import annotations

import argparse
import datetime as dt
import math
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kit import REPO
from kit.machine import machine_description

BENCHMARKS_MD = REPO / "docs" / "benchmarks.md"


def markers(name: str) -> tuple[str, str]:
    """The comments around a generated section: ``<!-- name:start -->``, ``<!-- name:end -->``."""
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def write_section(path: Path, section: str, start_mark: str, end_mark: str) -> None:
    """Replace the text between the two markers in ``path`` (or append the section)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start, end = text.find(start_mark), text.find(end_mark)
    if start != -1 and end != -1 and end > start:
        after = text[end + len(end_mark) :].lstrip("\n")
        text = text[:start] + section + ("\n" + after if after else "")
    else:
        text = text.rstrip("\n") + "\n\n" + section
    path.write_text(text)


def add_output_arg(p: argparse.ArgumentParser, section: str) -> None:
    p.add_argument(
        "--output",
        type=Path,
        default=BENCHMARKS_MD,
        help=f"markdown file whose {section} section is replaced (trial runs: another file)",
    )


def written_by(script: str, more: str = "") -> str:
    """A section's first sentence: which script wrote it (``more``: what follows it)."""
    return (
        f"Written by `bench/{script}` (see `bench/README.md`); rerun it rather than editing"
        f" this section.{more}"
    )


def report_head(
    script: str, *, started: str, versions: dict[str, str] | str, secret: str | None = None
) -> list[str]:
    """The list every section starts with: the command, the date, the machine, the versions
    (``secret`` shown as ``<key>`` in the command)."""
    if isinstance(versions, dict):
        versions = ", ".join(f"{k} {v}" for k, v in versions.items())
    return [
        f"- Command: `{command_line(script, secret)}`",
        f"- Date: {started}",
        f"- Machine: {machine_description()}",
        f"- Versions: {versions}",
    ]


def command_line(script: str, secret: str | None = None) -> str:
    """How this benchmark was invoked, for the report (``secret`` shown as ``<key>``)."""
    command = shlex.join([".venv/bin/python", f"bench/{script}", *sys.argv[1:]])
    return command.replace(secret, "<key>") if secret else command


def utc_now() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")


def fmt_ms(ms: float, digits: int = 1) -> str:
    """Milliseconds for a table: ``digits`` decimals below 100 ms, seconds from 10 s."""
    if math.isnan(ms):
        return "n/a"
    if ms >= 10_000:
        return f"{ms / 1000:.1f} s"
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.{digits}f} ms"


def fmt_pct(v: float) -> str:
    return "n/a" if math.isnan(v) else f"{v:.0f}%"


def verdict(ok: bool) -> str:
    return "pass" if ok else "**fail**"


def quantile(values: list[float], q: float) -> float:
    """The q-quantile by the nearest-rank method (what a latency SLO means by p99)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]


def floor_quantile(values: list[float], q: float) -> float:
    """The sorted values' entry at index ⌊q·n⌋: one rank above :func:`quantile` when q·n is
    whole (how bench/metrics_scrape.py and bench/tool_calls.py have always read their p90)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def timed_ms(fn: Callable[[], Any], n: int, *, warmup: int = 0) -> list[float]:
    """Milliseconds of each of ``n`` calls of ``fn``, after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        started = time.perf_counter()
        fn()
        out.append((time.perf_counter() - started) * 1e3)
    return out
