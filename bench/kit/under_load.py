"""A run under load (bench/pollers.py, bench/watchers.py): a long run trains while the API
is loaded; phases without, with and without the load again; the worker and its PostgreSQL
backends pinned to one CPU, the rest to the others; CPU per role; each step assigned to the
phase it ran in."""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import itertools
import json
import os
import re
import shutil
import statistics
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import httpx
import psutil

from app.runs.lifecycle.status import TERMINAL
from kit import BenchError, log
from kit.machine import busy_seconds, loadavg, other_load, torch_thread_env, wait_for_other_load
from kit.processes import Server, cpu_seconds, tree
from kit.report import fmt_ms, fmt_pct, quantile
from kit.stores import bench_query, clear_redis_prefix, drop_database
from kit.trainyard import LETTERS, Trainyard, add_model_arg, preset_run

STEP_METRIC = "step_seconds"  # workers/pipeline/callback.py: on_step_begin → the step's log
BACKEND = re.compile(r"^postgres: .*? (\S+) (?:\d[\d.]*|\[[0-9a-f:]+\]|[0-9a-f:]+)\((\d+)\)")


class BackendScanner:
    """PostgreSQL backends connected to one database over TCP: pid -> the client's port,
    from the process title (``postgres: 15/main: USER DB HOST(PORT) STATE``). A backend's
    database and client never change, so each process is read once; titles that may still
    change (a just-forked backend, PostgreSQL's own processes) are read again every time."""

    def __init__(self, db_name: str) -> None:
        self.db_name = db_name
        self.known: dict[int, int | None] = {}

    def scan(self) -> dict[int, int]:
        pids = set(psutil.pids())
        self.known = {pid: v for pid, v in self.known.items() if pid in pids}
        for pid in pids - self.known.keys():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            except OSError:
                continue
            m = BACKEND.match(title)
            if m:
                self.known[pid] = int(m.group(2)) if m.group(1) == self.db_name else None
            elif "postgres" not in title:
                self.known[pid] = None
        return {pid: port for pid, port in self.known.items() if port is not None}


def client_ports(pids: Iterable[int], pg_port: int) -> set[int]:
    """Local ports of these processes' TCP connections to PostgreSQL."""
    ports: set[int] = set()
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            for c in psutil.Process(pid).net_connections(kind="tcp"):
                if c.raddr and c.raddr.port == pg_port and c.laddr:
                    ports.add(c.laddr.port)
    return ports


class Roles:
    """The processes this script started, by role, and the database backends serving them."""

    def __init__(self, db_name: str, pg_port: int) -> None:
        self.db_name = db_name
        self.pg_port = pg_port
        self.roots: dict[str, list[int]] = {"worker": [], "api": [], "clients": []}
        self.lock = threading.Lock()
        self.scanner = BackendScanner(db_name)
        self.scan_lock = threading.Lock()

    def pids(self, role: str) -> list[int]:
        with self.lock:
            roots = list(self.roots[role])
        return [p.pid for r in roots for p in tree(r)]

    def backends(self) -> dict[int, str]:
        """Backends of the bench database -> ``worker`` or ``api`` (anything not the
        worker's: the API's pools and this script's own short queries)."""
        worker_ports = client_ports(self.pids("worker"), self.pg_port)
        with self.scan_lock:
            found = self.scanner.scan()
        return {pid: "worker" if port in worker_ports else "api" for pid, port in found.items()}


class Pinner(threading.Thread):
    """Every ``every`` s, puts each thread of our processes on its CPUs: the worker and its
    backends on ``worker_cpus``, the API, its backends, the load's clients and this script on
    ``api_cpus``. ``unpin()`` gives them all CPUs back. PostgreSQL's shared processes
    (postmaster, WAL writer, checkpointer, autovacuum), Redis and other people's processes
    are left alone."""

    def __init__(
        self, roles: Roles, worker_cpus: set[int], api_cpus: set[int], every: float = 0.5
    ) -> None:
        super().__init__(name="pinner", daemon=True)
        self.roles = roles
        self.all_cpus = set(os.sched_getaffinity(0))
        self.worker_cpus = worker_cpus
        self.api_cpus = api_cpus
        self.every = every
        self.active = False
        self.stopping = threading.Event()

    @staticmethod
    def _set(pid: int, cpus: set[int]) -> None:
        with contextlib.suppress(OSError):
            for name in os.listdir(f"/proc/{pid}/task"):
                with contextlib.suppress(OSError):
                    if os.sched_getaffinity(int(name)) != cpus:
                        os.sched_setaffinity(int(name), cpus)

    def apply(self) -> None:
        worker = self.worker_cpus if self.active else self.all_cpus
        api = self.api_cpus if self.active else self.all_cpus
        for pid in self.roles.pids("worker"):
            self._set(pid, worker)
        for pid in [*self.roles.pids("api"), *self.roles.pids("clients"), os.getpid()]:
            self._set(pid, api)
        for pid, role in self.roles.backends().items():
            self._set(pid, worker if role == "worker" else api)

    def pin(self) -> None:
        self.active = True
        self.apply()

    def unpin(self) -> None:
        self.active = False
        self.apply()

    def run(self) -> None:
        while not self.stopping.wait(self.every):
            with contextlib.suppress(Exception):  # a process that just exited, etc.
                self.apply()

    def stop(self) -> None:
        self.stopping.set()
        if self.is_alive():
            self.join(timeout=5)
        with contextlib.suppress(Exception):
            self.unpin()


@dataclasses.dataclass
class CpuSnapshot:
    t: float
    machine: Any
    per_cpu: list[Any]
    procs: dict[str, float]
    backends: dict[int, tuple[str, float]]


def snapshot(roles: Roles) -> CpuSnapshot:
    backends: dict[int, tuple[str, float]] = {}
    for pid, role in roles.backends().items():
        with contextlib.suppress(psutil.Error):
            t = psutil.Process(pid).cpu_times()
            backends[pid] = (role, t.user + t.system)
    me = psutil.Process().cpu_times()
    return CpuSnapshot(
        t=time.monotonic(),
        machine=psutil.cpu_times(),
        per_cpu=psutil.cpu_times(percpu=True),
        procs={
            "worker": cpu_seconds(*roles.roots["worker"]),
            "api": cpu_seconds(*roles.roots["api"]),
            "harness": me.user + me.system,
        },
        backends=backends,
    )


def cpu_usage(a: CpuSnapshot, b: CpuSnapshot, clients_cpu: float = 0.0) -> dict[str, float]:
    """% of one core per consumer between two snapshots, plus each CPU's busy %;
    ``clients_cpu``: the load's client processes' own CPU seconds, which they measure."""
    wall = max(b.t - a.t, 1e-9)
    out = {k: 100 * (b.procs[k] - a.procs[k]) / wall for k in b.procs}
    for role in ("worker", "api"):
        used = sum(
            cpu - (a.backends[pid][1] if pid in a.backends else 0.0)
            for pid, (r, cpu) in b.backends.items()
            if r == role
        )
        out[f"pg_{role}"] = 100 * used / wall
    out["clients"] = 100 * clients_cpu / wall
    busy, total = busy_seconds(a.machine, b.machine)
    ours = sum(out.values()) / 100 * wall
    out["other"] = max(0.0, 100 * (busy - ours) / wall)
    for i, (x, y) in enumerate(zip(a.per_cpu, b.per_cpu, strict=False)):
        cb, ct = busy_seconds(x, y)
        out[f"cpu{i}_busy"] = 100 * cb / ct if ct > 0 else float("nan")
    out["machine_busy"] = 100 * busy / total if total > 0 else float("nan")
    return out


class RunUnderLoad(Trainyard):
    """A fresh bench database, the API, one worker, an API key, the roles of their processes
    and, with ``--pin``, their pinning; and what the phases of a benchmark that loads the API
    while a run trains ask of them. ``args`` has the options of
    :func:`add_run_under_load_args`; :meth:`close` undoes it all however the benchmark
    ends."""

    def __init__(
        self,
        args: argparse.Namespace,
        servers: list[Server],
        home: Path,
        *,
        name: str,
        db_name: str,
    ) -> None:
        super().__init__(
            args,
            name=name,
            db_name=db_name,
            servers=servers,
            home=home,
            env={
                # Measure the API under load, not its limits: one key makes every request.
                "TRAINYARD_RATE_LIMIT_PER_SECOND": "0",
                "TRAINYARD_MAX_ACTIVE_RUNS_PER_PROJECT": "0",
                **torch_thread_env(args.torch_threads),
                **dict(item.partition("=")[::2] for item in args.api_env),
            },
        )
        self.args = args
        self.roles = Roles(db_name, urllib.parse.urlsplit(args.pg_url).port or 5432)
        self.cpus = pin_cpus(args)
        self.pinner: Pinner | None = None
        self.created = False  # the database exists: dropped by close() unless --keep

    def prepare(self, project: str = "bench") -> None:
        self.created = True
        super().prepare(project)

    def start(
        self, *, project: str = "bench", api_workers: int | None = None, timeout: float = 120.0
    ) -> None:
        """The services, their processes' roles, and with ``--pin`` the pinning."""
        super().start(project=project, api_workers=api_workers, timeout=timeout)
        assert self.api is not None and self.worker is not None
        self.roles.roots["api"] = [self.api.proc.pid]
        self.roles.roots["worker"] = [self.worker.proc.pid]
        if self.cpus:
            self.pinner = Pinner(self.roles, *self.cpus)
            self.pinner.pin()
            self.pinner.start()

    def close(self) -> None:
        """Every CPU given back, the broker keys deleted, the database and the home removed
        (``--keep`` keeps both)."""
        if self.pinner is not None:
            self.pinner.stop()
        with contextlib.suppress(BenchError):
            clear_redis_prefix(self.redis_url, self.broker_prefix)
        if self.args.keep:
            log(f"kept database {self.db_name} and {self.home}")
            return
        if self.created:
            with contextlib.suppress(BenchError):
                log(f"dropping database {self.db_name}")
                drop_database(self.pg_url, self.db_name)
        if self.home is not None:
            shutil.rmtree(self.home, ignore_errors=True)

    def settings(self) -> dict[str, str]:
        """The settings the report names: the limits turned off, and ``--api-env``."""
        return {
            "TRAINYARD_RATE_LIMIT_PER_SECOND": self.env["TRAINYARD_RATE_LIMIT_PER_SECOND"],
            "TRAINYARD_MAX_ACTIVE_RUNS_PER_PROJECT": self.env[
                "TRAINYARD_MAX_ACTIVE_RUNS_PER_PROJECT"
            ],
            **{k: v for k, _, v in (e.partition("=") for e in self.args.api_env)},
        }

    def fresh_run(self, config: str, model: Path) -> str:
        """A new run of configs/runs/letters.yaml, long enough to outlast the measurement (it
        is cancelled at the end), without checkpoints or evaluation, trained past its second
        step and ``--warmup`` s more; then, with ``--vacuum-analyze``, what autovacuum would
        have done by now (it is off on CI's server). Its id."""
        steps = self.args.max_steps
        body = preset_run(
            LETTERS, model, steps=steps, save_steps=steps + 1, name=f"bench-{self.name}"
        )
        run_id = str(self.create_run(body)["id"])
        log(f"{config}: run {run_id}, waiting for its second step")
        self.wait_for_step(run_id, 2, self.args.start_timeout)
        log(f"{config}: warm-up, {self.args.warmup:g} s of training")
        watch(time.time() + self.args.warmup, self, run_id)
        if self.args.vacuum_analyze:
            log(f"{config}: VACUUM (ANALYZE) of {self.db_name}")
            bench_query(self.db_url, "VACUUM (ANALYZE)")
        return run_id

    def measure(
        self, config: str, model: Path, phases_of: Callable[[str], list[Phase]]
    ) -> tuple[str, list[Phase]]:
        """``phases_of(run_id)`` on a :meth:`fresh_run`, pinned or not as ``config`` says;
        once other benchmarks are done (``--wait-others``), and again on another fresh run
        when they showed up meanwhile (``--retries``). The run (still training) and the
        phases."""
        retries = self.args.retries
        for attempt in range(retries + 1):
            wait_for_other_load(self.args.wait_others, config)
            if self.pinner is not None:
                (self.pinner.pin if config == "pinned" else self.pinner.unpin)()
            run_id = self.fresh_run(config, model)
            phases = phases_of(run_id)
            overlap = sorted(set().union(*(p.overlap for p in phases)))
            if not overlap or attempt == retries:
                break
            log(
                f"{config}: {', '.join(overlap)} ran during the measurement; measuring"
                f" again ({attempt + 1} of {retries} retries)"
            )
            self.cancel_and_wait(run_id)
        return run_id, phases

    def run_state(self, run_id: str) -> tuple[str, int, str | None]:
        row = bench_query(
            self.db_url,
            "SELECT json_build_object('status', status, 'step', step, 'error', error)::text"
            f" FROM runs WHERE id = '{run_id}'",
        )
        if not row or row[0] is None:
            raise BenchError(f"run {run_id} not found in {self.db_name}")
        state = json.loads(row[0])
        return str(state["status"]), int(state["step"] or 0), state.get("error")

    def check(self, run_id: str) -> int:
        """The run's step; raises if the worker died or the run ended."""
        assert self.worker is not None
        self.worker.check_alive()
        status, step, error = self.run_state(run_id)
        if status in TERMINAL:
            raise BenchError(
                f"run {run_id} ended {status} at step {step} during the measurement"
                f" ({error or 'raise --max-steps'}); worker log: {self.worker.log_path}"
            )
        return step

    def wait_for_step(self, run_id: str, step: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.check(run_id) < step:
            if time.monotonic() > deadline:
                raise BenchError(
                    f"run {run_id} did not reach step {step} within {timeout:.0f} s; worker"
                    f" log {self.worker.log_path if self.worker else '?'}"
                )
            time.sleep(0.5)

    def cancel_and_wait(self, run_id: str, timeout: float = 60.0) -> str:
        """Cancel the run; its status once it ended (or after ``timeout`` s)."""
        self.cancel(run_id)
        deadline = time.monotonic() + timeout
        status = self.run_state(run_id)[0]
        while status not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.5)
            status = self.run_state(run_id)[0]
        return status

    def step_seconds(self, run_id: str) -> dict[int, float]:
        """The run's own per-step time (GET /runs/{id}/metrics, the worker's clock)."""
        return dict(self.metrics(run_id, STEP_METRIC).get(STEP_METRIC, []))

    def step_events(self, run_id: str) -> dict[int, float]:
        """When each step's `step` event was written (epoch s, the database clock)."""
        row = bench_query(
            self.db_url,
            "SELECT coalesce(json_object_agg((data->>'step'), extract(epoch FROM created_at)),"
            f" '{{}}')::text FROM run_events WHERE run_id = '{run_id}' AND type = 'step'",
        )
        raw = json.loads(row[0] or "{}") if row else {}
        return {int(k): float(v) for k, v in raw.items()}


@dataclasses.dataclass
class Phase:
    config: str  # "pinned" / "unpinned"
    name: str  # "before" / the loaded phase ("with pollers", …) / "after"
    start: float  # epoch s
    end: float
    cpu: dict[str, float]
    loadavg: tuple[float, float, float]
    clients: list[Any] = dataclasses.field(default_factory=list)  # what the load's clients saw
    steps: dict[str, float] = dataclasses.field(default_factory=dict)
    db: dict[str, float] = dataclasses.field(default_factory=dict)
    overlap: set[str] = dataclasses.field(default_factory=set)  # other load seen meanwhile


def idle_phase(
    config: str, name: str, seconds: float, services: RunUnderLoad, run_id: str
) -> Phase:
    """``seconds`` of training without the load: CPU per role, other load seen."""
    log(f"{config}: {name}, {seconds:g} s without the load")
    a = snapshot(services.roles)
    start = time.time()
    seen = watch(start + seconds, services, run_id)
    b = snapshot(services.roles)
    return Phase(
        config,
        name,
        start,
        time.time(),
        cpu_usage(a, b),
        loadavg(),
        overlap=seen,
    )


def watch(until: float, services: RunUnderLoad, run_id: str) -> set[str]:
    """Sleep until ``until`` (epoch s), checking the run and noting other load every 2 s."""
    seen: set[str] = set()
    while (now := time.time()) < until:
        time.sleep(min(2.0, until - now))
        services.check(run_id)
        seen |= other_load()
    return seen


def one_at_a_time(
    roles: Roles, n: int, request: Callable[[], httpx.Response]
) -> tuple[dict[str, float], collections.Counter[int]]:
    """``request`` ``n`` times, one at a time (warm up first): the p50 and p99 latency, and
    the CPU one request costs the API and its PostgreSQL backends (their CPU time over the n
    requests / n); and the statuses answered."""
    statuses: collections.Counter[int] = collections.Counter()
    times = []
    a = snapshot(roles)
    for _ in range(n):
        t0 = time.perf_counter()
        r = request()
        times.append((time.perf_counter() - t0) * 1e3)
        statuses[r.status_code] += 1
    b = snapshot(roles)
    wall = b.t - a.t
    use = cpu_usage(a, b)
    cost = {
        "p50_ms": quantile(times, 0.5),
        "p99_ms": quantile(times, 0.99),
        "api_cpu_ms": use["api"] / 100 * wall / n * 1e3,
        "pg_cpu_ms": use["pg_api"] / 100 * wall / n * 1e3,
        "bytes": float(len(r.content)),
    }
    return cost, statuses


def assign_steps(phases: list[Phase], seconds: dict[int, float], ends: dict[int, float]) -> None:
    """Each step whose whole span (its `step` event minus its step_seconds → the event)
    falls inside a phase belongs to it; steps across a boundary belong to none."""
    for ph in phases:
        inside = sorted(
            s for s, t in ends.items() if s in seconds and t - seconds[s] >= ph.start and t < ph.end
        )
        values = [seconds[s] for s in inside]
        gaps = [ends[b] - ends[a] for a, b in itertools.pairwise(inside) if b == a + 1]
        ph.steps = {
            "count": len(values),
            "first": inside[0] if inside else 0,
            "last": inside[-1] if inside else 0,
            "median": statistics.median(values) if values else float("nan"),
            "mean": statistics.fmean(values) if values else float("nan"),
            "p90": quantile(values, 0.90),
            "interval_median": statistics.median(gaps) if gaps else float("nan"),
            "steps_per_s": len(values) / max(ph.end - ph.start, 1e-9),
        }


def comparison(phases: list[Phase]) -> dict[str, float]:
    """The median step of the loaded phase against the mean of the outer two (before and
    after); ``drift``: after against before, the noise."""
    by = {p.name: p for p in phases}
    during = next(p for p in phases if p.name not in ("before", "after"))
    return compare_steps(by["before"], during, by["after"])


def compare_steps(before_phase: Phase, during_phase: Phase, after_phase: Phase) -> dict[str, float]:
    """``during``'s median step against the mean of the medians of the phases around it."""
    before, during, after = (p.steps["median"] for p in (before_phase, during_phase, after_phase))
    base = statistics.fmean([before, after])
    return {
        "baseline_median_s": base,
        "with_median_s": during,
        "slowdown": during / base - 1 if base else float("nan"),
        "drift": after / before - 1 if before else float("nan"),
    }


def render_steps(phases: list[Phase]) -> str:
    rows = [
        "| phase | window | steps | median step | p90 step | median step-to-step | steps/s |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for p in phases:
        s = p.steps
        rows.append(
            f"| {p.name} | {p.end - p.start:.0f} s | {s['count']:.0f} ({s['first']:.0f}–"
            f"{s['last']:.0f}) | {fmt_ms(s['median'] * 1e3)} | {fmt_ms(s['p90'] * 1e3)} |"
            f" {fmt_ms(s['interval_median'] * 1e3)} | {s['steps_per_s']:.2f} |"
        )
    return "\n".join(rows)


def render_cpu(phases: list[Phase], n_cpus: int, clients: str) -> str:
    """CPU per role and per CPU, a row per phase; ``clients`` names the load's clients."""
    cols = [
        ("worker", "worker"),
        ("pg_worker", "its PG backends"),
        ("api", "API"),
        ("pg_api", "API's PG backends"),
        ("clients", clients),
        ("harness", "harness"),
        ("other", "everything else"),
    ]
    head = " | ".join(c for _, c in cols)
    cpu_cols = " | ".join(f"CPU {i} busy" for i in range(n_cpus))
    rows = [
        f"| phase | {head} | {cpu_cols} | loadavg 1 min |",
        "|---|" + "---:|" * (len(cols) + n_cpus + 1),
    ]
    for p in phases:
        vals = " | ".join(fmt_pct(p.cpu.get(k, float("nan"))) for k, _ in cols)
        busy = " | ".join(fmt_pct(p.cpu.get(f"cpu{i}_busy", float("nan"))) for i in range(n_cpus))
        rows.append(f"| {p.name} | {vals} | {busy} | {p.loadavg[0]:.2f} |")
    return "\n".join(rows)


def phases_json(phases: list[Phase]) -> list[dict[str, Any]]:
    """The phases as the JSON summary has them."""
    return [
        {
            "name": p.name,
            "seconds": p.end - p.start,
            "steps": p.steps,
            "cpu_pct": p.cpu,
            "loadavg": p.loadavg,
        }
        for p in phases
    ]


def args_json(args: argparse.Namespace) -> dict[str, Any]:
    """The options as the JSON summary has them (numbers, flags and lists as they are)."""
    return {
        k: v if isinstance(v, int | float | bool | list) else str(v) for k, v in vars(args).items()
    }


def cpus_json(cpus: tuple[set[int], set[int]] | None) -> dict[str, list[int]] | None:
    return {"worker": sorted(cpus[0]), "rest": sorted(cpus[1])} if cpus else None


# ------------------------------------------------------------------------------ options


def add_run_under_load_args(p: argparse.ArgumentParser, *, load: str, baseline: float) -> None:
    """The options of a benchmark that loads the API while a run trains (``load`` names
    the load in the help: "pollers", "watchers"); :func:`resolve_pin` after parsing."""
    p.add_argument(
        "--baseline",
        type=float,
        default=baseline,
        help=f"seconds without {load} before and after the phase with them",
    )
    p.add_argument(
        "--warmup", type=float, default=20.0, help="seconds of training before the first phase"
    )
    p.add_argument(
        "--api-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the API and worker (e.g. TRAINYARD_DB_POOL_SIZE=20)",
    )
    p.add_argument(
        "--pin",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the worker on the first CPU, the rest on the others (default: on with ≤ 4 CPUs)",
    )
    p.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="OMP_NUM_THREADS for the worker (0: torch's default, one per core)",
    )
    p.add_argument(
        "--max-steps",
        type=int,
        default=30_000,
        help="the run's max_steps; it is cancelled once measured",
    )
    add_model_arg(p)
    p.add_argument(
        "--wait-others",
        type=float,
        default=900.0,
        help="before each configuration, wait up to this long for other benchmarks, pytest"
        " and wrk to finish",
    )
    p.add_argument(
        "--retries",
        type=int,
        default=2,
        help="measure a configuration again (fresh run) when other load showed up during it",
    )
    p.add_argument(
        "--vacuum-analyze",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="VACUUM (ANALYZE) the bench database after each warm-up, as autovacuum would"
        " have (the planner otherwise plans for the empty tables of a fresh database)",
    )
    p.add_argument("--keep", action="store_true", help="keep the database and the temp home")


def resolve_pin(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--pin``'s default: on with 2 to 4 CPUs (where the worker would share the API's)."""
    n_cpus = len(os.sched_getaffinity(0))
    if args.pin is None:
        args.pin = 2 <= n_cpus <= 4
    if args.pin and n_cpus < 2:
        p.error("--pin needs at least 2 CPUs")


def pin_cpus(args: argparse.Namespace) -> tuple[set[int], set[int]] | None:
    """With ``--pin``: (the worker's CPU, everyone else's CPUs)."""
    all_cpus = sorted(os.sched_getaffinity(0))
    return ({all_cpus[0]}, set(all_cpus[1:])) if args.pin else None
