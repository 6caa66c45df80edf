"""The machine: facts for the report (CPU, RAM, kernel, git revision, versions, load), and
what else runs on it (waiting for it to go quiet; other benchmarks and test runs)."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import psutil

from kit import REPO, log


def machine_description() -> str:
    model = "unknown CPU"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gib = psutil.virtual_memory().total / 2**30
    return (
        f"{os.cpu_count()} CPUs (nproc {len(os.sched_getaffinity(0))}), {model},"
        f" {mem_gib:.1f} GiB RAM, {platform.system()} {platform.release()}"
    )


def trainyard_version() -> str:
    """pyproject's version and the git revision, marked when the tree has changes."""
    version = "unknown"
    with contextlib.suppress(OSError, KeyError, tomllib.TOMLDecodeError):
        version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    git = subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    )
    if git.returncode == 0:
        dirty = subprocess.run(
            ["git", "-C", str(REPO), "status", "--porcelain"], capture_output=True, text=True
        ).stdout.strip()
        version += f" (git {git.stdout.strip()}{', uncommitted changes' if dirty else ''})"
    return version


def package_versions(*names: str) -> dict[str, str]:
    """Installed versions of these distributions in this interpreter (missing ones left out)."""
    out = {}
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[name] = importlib.metadata.version(name)
    return out


def torch_thread_env(threads: int) -> dict[str, str]:
    """torch's intra-op threads for a child process (0: torch's default, one per core)."""
    if not threads:
        return {}
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def versions_of(*packages: str) -> dict[str, str]:
    """Trainyard's version and Python's, then these distributions' (missing ones left out)."""
    return {
        "Trainyard": trainyard_version(),
        "Python": platform.python_version(),
        **package_versions(*packages),
    }


def loadavg() -> tuple[float, float, float]:
    one, five, fifteen = os.getloadavg()
    return (round(one, 2), round(five, 2), round(fifteen, 2))


def busy_seconds(before: Any, after: Any) -> tuple[float, float]:
    """(busy, total) CPU seconds between two psutil.cpu_times() readings."""
    total = sum(getattr(after, k) - getattr(before, k) for k in before._fields)
    idle = (after.idle - before.idle) + (getattr(after, "iowait", 0) - getattr(before, "iowait", 0))
    return total - idle, total


def machine_busy(before: Any, after: Any) -> float:
    """% of the machine's CPU time that was busy between two ``psutil.cpu_times()``."""
    busy, total = busy_seconds(before, after)
    return 100.0 * busy / total if total > 0 else float("nan")


def wait_for_quiet(max_wait: float, threshold: float = 30.0) -> float:
    """Wait until the machine's CPU is below ``threshold`` % for two seconds in a row.

    Servers keep busy for a while after they answer (MLflow starts job consumers that
    import for several seconds), and anything else running here skews the numbers.
    Returns the last reading; warns, naming the busiest processes, after ``max_wait`` s.
    """
    deadline = time.monotonic() + max_wait
    calm = 0
    reading = psutil.cpu_percent(interval=1.0)
    while time.monotonic() < deadline:
        calm = calm + 1 if reading < threshold else 0
        if calm >= 2:
            return reading
        reading = psutil.cpu_percent(interval=1.0)
    procs = list(psutil.process_iter(["pid", "name"]))
    for proc in procs:  # the first cpu_percent() of a process only starts its clock
        with contextlib.suppress(psutil.Error):
            proc.cpu_percent()
    time.sleep(1.0)
    usage = []
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            usage.append((proc.cpu_percent(), proc))
    busiest = [proc for _, proc in sorted(usage, key=lambda u: u[0], reverse=True)[:4]]
    names = ", ".join(f"{p.info['name']}({p.info['pid']})" for p in busiest)
    log(
        f"WARNING: machine still {reading:.0f}% busy after {max_wait:.0f} s (top: {names});"
        " measuring anyway, numbers will be low"
    )
    return reading


# Other load that would pollute the numbers on a small machine: other benchmarks, test runs,
# load generators. Waited for before each configuration, watched during it.
OTHER_LOAD = re.compile(r"bench/\w+\.py|\bpytest\b|(?:^|/)wrk\b")


def other_load() -> set[str]:
    """What else runs here that loads the machine: other benchmarks (another run of this one
    too, but not this process or a wrapper of it), pytest, wrk."""
    me = f"bench/{Path(sys.argv[0]).name}"
    found = set()
    for p in psutil.process_iter(["pid", "name", "cmdline"]):
        if p.info["pid"] == os.getpid() or p.info.get("name") == "timeout":
            continue
        for m in OTHER_LOAD.finditer(" ".join(p.info.get("cmdline") or [])):
            if m.group(0) != me:
                found.add(m.group(0).lstrip("/"))
    return found


def wait_for_other_load(max_wait: float, what: str) -> None:
    """Wait (polling every 10 s) until no other benchmark, test run or wrk is running."""
    busy = other_load()
    if not busy:
        return
    log(f"{what}: waiting up to {max_wait:.0f} s for {', '.join(sorted(busy))} to finish")
    deadline = time.monotonic() + max_wait
    while busy and time.monotonic() < deadline:
        time.sleep(10.0)
        busy = other_load()
    if busy:
        log(f"WARNING: still running: {', '.join(sorted(busy))}; measuring anyway")
