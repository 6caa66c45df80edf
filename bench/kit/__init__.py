"""What the benchmarks in bench/ share; each benchmark file holds only its scenario.

- :mod:`kit.processes`: a service in its own process group (``Server``), started, waited
  for (HTTP or a log line) and stopped with its whole group, also on an error, Ctrl-C or
  SIGTERM (``stop_on_exit``); a one-shot command run the same way (``run_to_end``); the CPU
  and memory of a process tree; py-spy;
- :mod:`kit.machine`: machine facts for the report (CPU, RAM, kernel, git revision,
  versions, load), waiting for the machine to go quiet, other benchmarks and test runs;
- :mod:`kit.stores`: PostgreSQL (asyncpg) and Redis (redis-py), for the harness's own few
  queries;
- :mod:`kit.trainyard`: an installation of our own for one benchmark (its database, its
  broker key prefix, its home, an API key), its API and worker processes, the HTTP calls a
  harness makes on a run, the run bodies of the project's presets, their options;
- :mod:`kit.load`: the load generators: wrk, run as a child whose own CPU time is read
  back, ``RawHTTP``, a lean keep-alive HTTP/1.1 client, and ``ClientFleet``, load client
  processes;
- :mod:`kit.under_load`: a run under load (bench/pollers.py, bench/watchers.py):
  ``RunUnderLoad``, pinning (``Roles``, ``Pinner``), CPU per role (``snapshot``,
  ``cpu_usage``), the phases (``Phase``, ``idle_phase``, ``watch``), the step times per
  phase (``assign_steps``, ``compare_steps``), their options and tables;
- :mod:`kit.report`: the writer of a generated section of docs/benchmarks.md, the lines
  every section opens with, number formats and quantiles.

This module: the paths, ``BenchError`` and ``run``, every benchmark's entry point.

What a benchmark shares with the product it takes from the product (``app``, ``workers``,
``tests.support``): run statuses, the preset loader, the browser the UI tests drive, the
metric names the worker records.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "bench"
OUT = BENCH / "out"

# This checkout's app, workers and tests.support, whichever checkout the venv's editable
# install points at.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


class BenchError(Exception):
    """A problem the user can fix; printed without a traceback."""


def log(msg: str) -> None:
    """Progress on stderr: stdout is left to a benchmark's results (tables, JSON)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def run(main: Callable[[], int]) -> NoReturn:
    """A benchmark's entry point: exit with ``main()``'s status; a BenchError is printed
    without a traceback (1), an interruption (Ctrl-C, SIGTERM, SIGHUP: see
    ``kit.processes.stop_on_exit``) ends it with 130, after main's own cleanup either way."""
    try:
        code = main()
    except BenchError as e:
        print(f"\nbench failed: {e}", file=sys.stderr)
        code = 1
    except KeyboardInterrupt:
        print("\nbench interrupted; what it started is stopped", file=sys.stderr)
        code = 130
    sys.exit(code)
