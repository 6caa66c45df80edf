#!/usr/bin/env python3
"""API throughput: Trainyard vs MLflow's tracking server, create and get, measured with wrk.

Both servers run on this machine one after the other (never at the same time), each with
the same number of workers, against the same local PostgreSQL, under the same wrk load.
The results replace the section between the api-throughput markers in docs/benchmarks.md
and are printed as a table. See bench/README.md.

    .venv/bin/python bench/api_vs_mlflow.py                  # both, 15 s per measurement
    .venv/bin/python bench/api_vs_mlflow.py --duration 5     # a quick look
    .venv/bin/python bench/api_vs_mlflow.py --only mlflow
    .venv/bin/python bench/api_vs_mlflow.py --trainyard-url http://127.0.0.1:8000 \\
        --trainyard-key ty_... --output bench/out/benchmarks.md

Needs: wrk on PATH, PostgreSQL (trust or password auth) and, for a Trainyard server that
the script starts itself, Redis. Uses only the standard library, httpx and psutil.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shlex
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import tomllib
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
OUT = BENCH / "out"
WRK_SCRIPTS = BENCH / "wrk"
MLFLOW_VENV = BENCH / ".venv-mlflow"
# 3.18.0 is listed on PyPI but its mlflow-skinny==3.18.0 was not installable when this was
# written, so the newest MLflow 3 that installs is 3.17.x. Override with --mlflow-spec.
MLFLOW_SPEC = "mlflow==3.17.*"
MARK_START = "<!-- api-throughput:start -->"
MARK_END = "<!-- api-throughput:end -->"

TRAINYARD_CREATE_BODY = {
    "model_name": "tiny",
    "task_description": "benchmark run",
    "inputs": [{"input_text": "hello"}],
}


EXPECTED_STATUS = {
    ("Trainyard", "create"): 202,
    ("Trainyard", "get"): 200,
    ("MLflow", "create"): 200,
    ("MLflow", "get"): 200,
}


class BenchError(Exception):
    """A problem the user can fix; printed without a traceback."""


def log(msg: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# --------------------------------------------------------------------------- processes


@dataclasses.dataclass
class Server:
    """A server process started in its own session, so the whole group can be stopped."""

    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    base_url: str
    known: dict[int, psutil.Process] = dataclasses.field(default_factory=dict)

    @property
    def pgid(self) -> int:
        return self.proc.pid  # start_new_session=True makes it the group leader

    def remember_children(self) -> None:
        """Note descendants, in case one of them leaves our process group."""
        with contextlib.suppress(psutil.Error):
            for child in psutil.Process(self.proc.pid).children(recursive=True):
                self.known.setdefault(child.pid, child)

    def tree_cpu_seconds(self) -> float:
        return tree_cpu_seconds(self.proc.pid)

    def tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, grace: float = 10.0) -> None:
        self.remember_children()
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace
        while time.monotonic() < deadline and self._group_alive():
            time.sleep(0.2)
        if self._group_alive():
            log(f"{self.name}: still running after {grace:.0f} s, sending SIGKILL")
            self._signal_group(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=5)
        # Anything that escaped the group (a double fork into a new session). psutil
        # refuses to signal a pid that has since been reused by an unrelated process.
        for child in self.known.values():
            with contextlib.suppress(psutil.Error):
                if child.is_running() and child.status() != psutil.STATUS_ZOMBIE:
                    child.kill()

    def _signal_group(self, sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, sig)

    def _group_alive(self) -> bool:
        self.proc.poll()  # reap the leader so it does not linger as a zombie
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        # Only zombies left (reparented children waiting to be reaped) count as gone.
        for p in psutil.process_iter(["pid"]):
            with contextlib.suppress(psutil.Error):
                if os.getpgid(p.pid) == self.pgid and p.status() != psutil.STATUS_ZOMBIE:
                    return True
        return False


def tree_cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of a process and its descendants, reaped ones included.

    Children that exited and were waited for show up in their parent's children_* times,
    which matters for PostgreSQL: a client that reconnects a lot (MLflow's pool overflow)
    runs many short-lived backends.
    """
    total = 0.0
    with contextlib.suppress(psutil.Error):
        root = psutil.Process(pid)
        for p in [root, *root.children(recursive=True)]:
            with contextlib.suppress(psutil.Error):
                t = p.cpu_times()
                total += t.user + t.system + t.children_user + t.children_system
    return total


def listening_pid(port: int) -> int | None:
    """The process listening on a local TCP port (PostgreSQL's postmaster), if visible."""
    try:
        conns = psutil.net_connections(kind="tcp")
    except psutil.Error:
        return None  # needs root on some systems; the column then reads n/a
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            return int(c.pid)
    return None


def start_server(
    name: str, cmd: list[str], *, env: dict[str, str], cwd: Path, base_url: str
) -> Server:
    log_path = OUT / f"{name}-server.log"
    log(f"starting {name}: {shlex.join(cmd)}  (log: {log_path.relative_to(REPO)})")
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            cmd,
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=cwd,
            start_new_session=True,
        )
    return Server(name, proc, log_path, base_url)


def wait_ready(server: Server, path: str, timeout: float = 120.0) -> None:
    """Wait until the server answers HTTP on `path` (any status below 500)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=server.base_url, timeout=2.0) as client:
        while time.monotonic() < deadline:
            if server.proc.poll() is not None:
                raise BenchError(
                    f"{server.name} exited with code {server.proc.returncode} while starting;"
                    f" last lines of {server.log_path}:\n{server.tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(path).status_code < 500:
                    server.remember_children()
                    return
            time.sleep(0.5)
    raise BenchError(
        f"{server.name} did not answer on {server.base_url}{path} within {timeout:.0f} s;"
        f" last lines of {server.log_path}:\n{server.tail()}"
    )


def run_checked(cmd: list[str], *, env: dict[str, str] | None = None, what: str) -> str:
    log(f"{what}: {shlex.join(cmd)}")
    res = subprocess.run(cmd, env=env, cwd=REPO, capture_output=True, text=True)
    if res.returncode != 0:
        raise BenchError(
            f"{what} failed (exit {res.returncode}):\n{res.stdout[-3000:]}{res.stderr[-3000:]}"
        )
    return res.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for_quiet(max_wait: float, threshold: float = 30.0) -> float:
    """Wait until the machine's CPU is below `threshold` % for two seconds in a row.

    Servers keep busy for a while after they answer (MLflow starts job consumers that
    import for several seconds), and anything else running here skews the numbers.
    Returns the last reading; warns and carries on after `max_wait` seconds.
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


# --------------------------------------------------------------- postgres and redis, tiny


def pg_query(url: str, sql: str) -> list[str | None]:
    """Run one statement with PostgreSQL's simple-query protocol; first column of each row.

    Just enough protocol for trust, cleartext and md5 auth, so the harness needs neither
    psql nor a driver. Statements run one per call (DROP DATABASE refuses to run inside
    the implicit transaction of a multi-statement query).
    """
    u = urllib.parse.urlsplit(url)
    user = urllib.parse.unquote(u.username or "postgres")
    password = urllib.parse.unquote(u.password or "")
    dbname = u.path.lstrip("/") or user
    try:
        sock = socket.create_connection((u.hostname or "127.0.0.1", u.port or 5432), timeout=30)
    except OSError as e:
        raise BenchError(f"cannot reach PostgreSQL at {u.hostname}:{u.port or 5432}: {e}") from e
    with sock:
        buf = b""

        def recv(n: int) -> bytes:
            nonlocal buf
            while len(buf) < n:
                chunk = sock.recv(65536)
                if not chunk:
                    raise BenchError("PostgreSQL closed the connection")
                buf += chunk
            out, buf = buf[:n], buf[n:]
            return out

        def message() -> tuple[bytes, bytes]:
            kind = recv(1)
            (length,) = struct.unpack("!i", recv(4))
            return kind, recv(length - 4)

        def send(kind: bytes, payload: bytes) -> None:
            sock.sendall(kind + struct.pack("!i", len(payload) + 4) + payload)

        def error_text(payload: bytes) -> str:
            fields = {f[:1]: f[1:].decode(errors="replace") for f in payload.split(b"\0") if f}
            return f"{fields.get(b'S', 'ERROR')}: {fields.get(b'M', '?')}"

        params = (
            b"".join(
                k + b"\0" + v.encode() + b"\0" for k, v in ((b"user", user), (b"database", dbname))
            )
            + b"\0"
        )
        sock.sendall(struct.pack("!ii", len(params) + 8, 196608) + params)
        while True:
            kind, payload = message()
            if kind == b"R":
                (code,) = struct.unpack("!i", payload[:4])
                if code == 3:
                    send(b"p", password.encode() + b"\0")
                elif code == 5:
                    inner = hashlib.md5((password + user).encode()).hexdigest()
                    outer = hashlib.md5(inner.encode() + payload[4:8]).hexdigest()
                    send(b"p", b"md5" + outer.encode() + b"\0")
                elif code != 0:
                    raise BenchError(
                        f"PostgreSQL asks for auth method {code} (e.g. SCRAM), which this"
                        " harness does not speak; use trust/md5 auth for the benchmark"
                    )
            elif kind == b"E":
                raise BenchError(f"PostgreSQL: {error_text(payload)}")
            elif kind == b"Z":
                break
        send(b"Q", sql.encode() + b"\0")
        rows: list[str | None] = []
        error = None
        while True:
            kind, payload = message()
            if kind == b"D":
                (ncols,) = struct.unpack("!h", payload[:2])
                if ncols:
                    (n,) = struct.unpack("!i", payload[2:6])
                    rows.append(None if n < 0 else payload[6 : 6 + n].decode())
            elif kind == b"E":
                error = error_text(payload)
            elif kind == b"Z":
                break
        send(b"X", b"")
    if error:
        raise BenchError(f"PostgreSQL: {error} (while running: {sql})")
    return rows


def pg_url_for(admin_url: str, dbname: str, scheme: str) -> str:
    u = urllib.parse.urlsplit(admin_url)
    return urllib.parse.urlunsplit((scheme, u.netloc, "/" + dbname, "", ""))


def recreate_database(admin_url: str, dbname: str) -> None:
    log(f"recreating PostgreSQL database {dbname}")
    pg_query(admin_url, f'DROP DATABASE IF EXISTS "{dbname}" WITH (FORCE)')
    pg_query(admin_url, f'CREATE DATABASE "{dbname}"')


def redis_command(url: str, *args: str) -> str:
    """Send one command (after SELECT of the URL's db) and return the reply line."""
    u = urllib.parse.urlsplit(url)
    db = u.path.lstrip("/") or "0"

    def encode(*parts: str) -> bytes:
        out = f"*{len(parts)}\r\n".encode()
        for p in parts:
            b = p.encode()
            out += f"${len(b)}\r\n".encode() + b + b"\r\n"
        return out

    try:
        with socket.create_connection((u.hostname or "127.0.0.1", u.port or 6379), timeout=10) as s:
            payload = b""
            if u.password:
                payload += encode("AUTH", urllib.parse.unquote(u.password))
            payload += encode("SELECT", db) + encode(*args)
            s.sendall(payload)
            replies = (2 if u.password else 1) + 1
            data = b""
            while data.count(b"\r\n") < replies:
                chunk = s.recv(4096)
                if not chunk:
                    break
                data += chunk
    except OSError as e:
        raise BenchError(f"cannot reach Redis at {u.hostname}:{u.port or 6379}: {e}") from e
    lines = data.split(b"\r\n")
    for line in lines[: replies - 1]:
        if line.startswith(b"-"):
            raise BenchError(f"Redis: {line[1:].decode(errors='replace')}")
    last = lines[replies - 1] if len(lines) >= replies else b"-no reply"
    if last.startswith(b"-"):
        raise BenchError(f"Redis: {last[1:].decode(errors='replace')}")
    return last[1:].decode(errors="replace")


# ------------------------------------------------------------------------------- wrk


@dataclasses.dataclass
class Measurement:
    server: str
    operation: str
    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int
    statuses: dict[str, int]
    wrk_cpu_pct: float
    server_cpu_pct: float | None
    postgres_cpu_pct: float | None
    machine_busy_pct: float
    duration_s: float


def parse_wrk_text(text: str) -> dict[str, Any]:
    """What wrk's own --latency report says (a fallback and a cross-check for WRK_JSON)."""
    units = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3}
    out: dict[str, Any] = {}
    if m := re.search(r"^Requests/sec:\s+([\d.]+)", text, re.M):
        out["rps"] = float(m.group(1))
    if m := re.search(r"^\s+(\d+) requests in", text, re.M):
        out["requests"] = int(m.group(1))
    for pct, value, unit in re.findall(r"^\s+(50|75|90|99)%\s+([\d.]+)(us|ms|s|m)\s*$", text, re.M):
        out[f"p{pct}_ms"] = float(value) * units[unit]
    m = re.search(r"Non-2xx or 3xx responses:\s+(\d+)", text)
    out["non2xx"] = int(m.group(1)) if m else 0
    m = re.search(r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", text)
    out["socket_errors"] = sum(int(x) for x in m.groups()) if m else 0
    return out


def run_wrk(
    args: argparse.Namespace,
    *,
    label: str,
    url: str,
    script: str,
    script_args: list[str],
    duration: float,
    server: Server | None,
    secret: str | None = None,
    server_name: str = "",
    operation: str = "",
) -> Measurement:
    cmd = [
        "wrk",
        f"-t{args.threads}",
        f"-c{args.connections}",
        f"-d{duration:g}s",
        f"--timeout={args.wrk_timeout:g}s",
        "--latency",
        "-s",
        str(WRK_SCRIPTS / script),
        url,
        "--",
        *script_args,
    ]
    shown = shlex.join(cmd)
    if secret:
        shown = shown.replace(secret, "<key>")
    out_path = OUT / f"{label}.wrk.txt"
    log(f"wrk {label} ({duration:g} s): {shown}")
    pg_pid = args.postgres_pid
    cpu_before = server.tree_cpu_seconds() if server else 0.0
    pg_before = tree_cpu_seconds(pg_pid) if pg_pid else 0.0
    machine_before = psutil.cpu_times()
    t0 = time.monotonic()
    with open(out_path, "w+") as f:
        f.write(f"$ {shown}\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=REPO)
        try:
            # wait4 gives this child's own rusage, not mixed with any other child's.
            _, status, rusage = os.wait4(proc.pid, 0)
        except BaseException:
            proc.kill()
            proc.wait()
            raise
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.monotonic() - t0
        cpu_after = server.tree_cpu_seconds() if server else 0.0
        pg_after = tree_cpu_seconds(pg_pid) if pg_pid else 0.0
        machine_after = psutil.cpu_times()
        f.seek(0)
        text = f.read()
    if proc.returncode != 0:
        raise BenchError(f"wrk exited with {proc.returncode}; output ({out_path}):\n{text[-3000:]}")

    text_stats = parse_wrk_text(text)
    m = re.search(r"^WRK_JSON (\{.*\})\s*$", text, re.M)
    if m:
        data = json.loads(m.group(1))
        lat = data["latency_us"]
        statuses = {str(k): int(v) for k, v in data["statuses"].items()}
        e = data["errors"]
        socket_errors = e["connect"] + e["read"] + e["write"] + e["timeout"]
        bad_status = sum(n for code, n in statuses.items() if not 200 <= int(code) < 300)
        requests = int(data["requests"])
        rps = text_stats.get("rps") or requests / (data["duration_us"] / 1e6)
        p50, p99 = lat["p50"] / 1e3, lat["p99"] / 1e3
        errors = bad_status + socket_errors
    else:  # the Lua done() did not run; wrk's text still has the essentials
        log(f"WARNING: no WRK_JSON line in {out_path}; using wrk's text report")
        statuses = {}
        requests = text_stats.get("requests", 0)
        rps = text_stats.get("rps", 0.0)
        p50, p99 = text_stats.get("p50_ms", float("nan")), text_stats.get("p99_ms", float("nan"))
        errors = text_stats["non2xx"] + text_stats["socket_errors"]

    cpu_total = sum(
        getattr(machine_after, k) - getattr(machine_before, k) for k in machine_before._fields
    )
    idle = (machine_after.idle - machine_before.idle) + (
        getattr(machine_after, "iowait", 0) - getattr(machine_before, "iowait", 0)
    )
    result = Measurement(
        server=server_name,
        operation=operation,
        rps=rps,
        p50_ms=p50,
        p99_ms=p99,
        requests=requests,
        errors=errors,
        statuses=statuses,
        wrk_cpu_pct=100.0 * (rusage.ru_utime + rusage.ru_stime) / wall,
        server_cpu_pct=100.0 * (cpu_after - cpu_before) / wall if server else None,
        postgres_cpu_pct=100.0 * (pg_after - pg_before) / wall if pg_pid else None,
        machine_busy_pct=100.0 * (1 - idle / cpu_total) if cpu_total > 0 else float("nan"),
        duration_s=wall,
    )
    log(
        f"  -> {result.rps:.1f} req/s, p50 {result.p50_ms:.1f} ms, p99 {result.p99_ms:.1f} ms,"
        f" {result.errors} errors, statuses {result.statuses}, wrk CPU {result.wrk_cpu_pct:.0f}%"
        + (f", server CPU {result.server_cpu_pct:.0f}%" if server else "")
        + (f", Postgres CPU {result.postgres_cpu_pct:.0f}%" if pg_pid else "")
    )
    return result


def precreate(
    base_url: str,
    path: str,
    body: dict[str, Any],
    headers: dict[str, str],
    count: int,
    expect: int,
    get_id: Callable[[Any], str],
) -> list[str]:
    """Create `count` resources to GET later (also warms the server up)."""
    with (
        httpx.Client(base_url=base_url, headers=headers, timeout=60.0) as client,
        concurrent.futures.ThreadPoolExecutor(8) as pool,
    ):

        def one(_: int) -> str:
            r = client.post(path, json=body)
            if r.status_code != expect:
                raise BenchError(
                    f"POST {base_url}{path} answered {r.status_code}, expected {expect}:"
                    f" {r.text[:500]}"
                )
            return get_id(r.json())

        return list(pool.map(one, range(count)))


def check_get(base_url: str, path: str, headers: dict[str, str]) -> None:
    r = httpx.get(base_url + path, headers=headers, timeout=30.0)
    if r.status_code != 200:
        raise BenchError(f"GET {base_url}{path} answered {r.status_code}: {r.text[:500]}")


def measure_pair(
    args: argparse.Namespace,
    *,
    name: str,
    base_url: str,
    server: Server | None,
    create_path: str,
    create_body: dict[str, Any],
    create_status: int,
    get_template: str,
    get_id: Callable[[Any], str],
    headers: dict[str, str],
    secret: str | None,
) -> list[Measurement]:
    slug = name.lower()
    header_args = [f"{k}: {v}" for k, v in headers.items()]
    body_file = OUT / f"{slug}_create_body.json"
    body_file.write_text(json.dumps(create_body))
    ids_file = OUT / f"{slug}_ids.txt"

    log(f"{name}: creating {args.get_ids} runs for the get measurement")
    ids = precreate(
        base_url, create_path, create_body, headers, args.get_ids, create_status, get_id
    )
    ids_file.write_text("\n".join(ids) + "\n")
    check_get(base_url, get_template.replace("{id}", ids[0]), headers)

    results = []
    for operation, label_url, script, script_args in (
        ("create", base_url + create_path, "post_json.lua", [str(body_file), *header_args]),
        ("get", base_url, "get_ids.lua", [str(ids_file), get_template, *header_args]),
    ):
        wait_for_quiet(args.settle_timeout)
        if args.warmup > 0:
            run_wrk(
                args,
                label=f"{slug}-{operation}-warmup",
                url=label_url,
                script=script,
                script_args=script_args,
                duration=args.warmup,
                server=server,
                secret=secret,
                server_name=name,
                operation=operation,
            )
        results.append(
            run_wrk(
                args,
                label=f"{slug}-{operation}",
                url=label_url,
                script=script,
                script_args=script_args,
                duration=args.duration,
                server=server,
                secret=secret,
                server_name=name,
                operation=operation,
            )
        )
    return results


# --------------------------------------------------------------------------- the servers


def ensure_mlflow_venv(spec: str) -> Path:
    """bench/.venv-mlflow with `spec` and psycopg2-binary; reused while the spec matches."""
    python = MLFLOW_VENV / "bin" / "python"
    marker = MLFLOW_VENV / ".bench-spec"
    wanted = f"{spec} psycopg2-binary"
    if (
        python.exists()
        and (MLFLOW_VENV / "bin" / "mlflow").exists()
        and (marker.exists() and marker.read_text().strip() == wanted)
    ):
        return MLFLOW_VENV
    if not python.exists():
        log(f"creating {MLFLOW_VENV.relative_to(REPO)}")
        subprocess.run([sys.executable, "-m", "venv", str(MLFLOW_VENV)], check=True)
    log(f"installing {wanted} into {MLFLOW_VENV.relative_to(REPO)} (a minute or two)")
    res = subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "--quiet",
            "--disable-pip-version-check",
            spec,
            "psycopg2-binary",
        ],
    )
    if res.returncode != 0:
        raise BenchError(f"pip could not install {wanted} (see above); try another --mlflow-spec")
    marker.write_text(wanted + "\n")
    return MLFLOW_VENV


def venv_package_version(python: Path, package: str) -> str:
    res = subprocess.run(
        [str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
        capture_output=True,
        text=True,
    )
    return res.stdout.strip() if res.returncode == 0 else "unknown"


def bench_mlflow(
    args: argparse.Namespace, servers: list[Server], venv: Path
) -> tuple[list[Measurement], str]:
    version = venv_package_version(venv / "bin" / "python", "mlflow")
    recreate_database(args.pg_url, "bench_mlflow")
    # Name the driver: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, not psycopg2.
    store = pg_url_for(args.pg_url, "bench_mlflow", "postgresql+psycopg2")
    port = free_port()
    workdir = OUT / "mlflow"  # MLflow's default ./mlartifacts lands here, not in the repo
    workdir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ)
    env.pop("MLFLOW_TRACKING_URI", None)
    server = start_server(
        "mlflow",
        [
            str(venv / "bin" / "mlflow"),
            "server",
            "--backend-store-uri",
            store,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            str(args.workers),
        ],
        env=env,
        cwd=workdir,
        base_url=f"http://127.0.0.1:{port}",
    )
    servers.append(server)
    wait_ready(server, "/health", timeout=args.start_timeout)
    r = httpx.post(
        server.base_url + "/api/2.0/mlflow/experiments/create", json={"name": "bench"}, timeout=30.0
    )
    if r.status_code != 200:
        raise BenchError(f"MLflow experiments/create answered {r.status_code}: {r.text[:500]}")
    experiment_id = r.json()["experiment_id"]
    results = measure_pair(
        args,
        name="MLflow",
        base_url=server.base_url,
        server=server,
        create_path="/api/2.0/mlflow/runs/create",
        create_body={"experiment_id": experiment_id},
        create_status=EXPECTED_STATUS["MLflow", "create"],
        get_template="/api/2.0/mlflow/runs/get?run_id={id}",
        get_id=lambda j: j["run"]["info"]["run_id"],
        headers={},
        secret=None,
    )
    return results, version


def bench_trainyard(
    args: argparse.Namespace, servers: list[Server]
) -> tuple[list[Measurement], str]:
    version = trainyard_version()
    server: Server | None = None
    if args.trainyard_url:
        base_url = args.trainyard_url.rstrip("/")
        key = args.trainyard_key
        log(f"using the Trainyard server already running at {base_url}")
        version += f"; external server at {base_url}"
    else:
        trainyard = args.trainyard_bin
        recreate_database(args.pg_url, "bench_trainyard")
        redis_command(args.redis_url, "FLUSHDB")
        env = dict(os.environ)
        env["TRAINYARD_DATABASE_URL"] = pg_url_for(
            args.pg_url, "bench_trainyard", "postgresql+asyncpg"
        )
        env["TRAINYARD_REDIS_URL"] = args.redis_url
        # Measure the API, not its limits: the create measurement alone makes thousands of
        # pending runs with one key. --trainyard-env turns them back on to measure their cost.
        env["TRAINYARD_RATE_LIMIT_PER_SECOND"] = "0"
        env["TRAINYARD_MAX_ACTIVE_RUNS_PER_PROJECT"] = "0"
        for item in args.trainyard_env:
            k, _, v = item.partition("=")
            env[k] = v
        run_checked([str(trainyard), "db", "upgrade"], env=env, what="migrating bench_trainyard")
        out = run_checked(
            [str(trainyard), "keys", "create", "--project", "bench"],
            env=env,
            what="creating an API key",
        )
        lines = [ln.strip() for ln in out.splitlines() if ln.strip()]
        if not lines:
            raise BenchError("`trainyard keys create` printed nothing; expected the key last")
        key = lines[-1]
        port = free_port()
        base_url = f"http://127.0.0.1:{port}"
        server = start_server(
            "trainyard",
            [
                str(trainyard),
                "api",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--workers",
                str(args.workers),
            ],
            env=env,
            cwd=REPO,
            base_url=base_url,
        )
        servers.append(server)
        wait_ready(server, "/healthz", timeout=args.start_timeout)
    results = measure_pair(
        args,
        name="Trainyard",
        base_url=base_url,
        server=server,
        create_path="/runs",
        create_body=TRAINYARD_CREATE_BODY,
        create_status=EXPECTED_STATUS["Trainyard", "create"],
        get_template="/runs/{id}",
        get_id=lambda j: j["id"],
        headers={"Authorization": f"Bearer {key}"},
        secret=key,
    )
    return results, version


def trainyard_version() -> str:
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


# ------------------------------------------------------------------------------ report


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


def wrk_version() -> str:
    res = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    m = re.search(r"wrk (\S+)", res.stdout + res.stderr)
    return m.group(1) if m else "unknown"


def fmt_ms(ms: float) -> str:
    if ms != ms:  # NaN
        return "n/a"
    return f"{ms:.0f} ms" if ms >= 100 else f"{ms:.1f} ms"


def render_table(results: list[Measurement]) -> str:
    rows = [
        "| server | operation | req/s | p50 | p99 | errors | wrk CPU | server CPU | Postgres CPU |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    op_names = {
        ("Trainyard", "create"): "create (`POST /runs`)",
        ("Trainyard", "get"): "get (`GET /runs/{id}`)",
        ("MLflow", "create"): "create (`POST runs/create`)",
        ("MLflow", "get"): "get (`GET runs/get`)",
    }
    for r in results:
        errors = f"{r.errors}" if r.errors == 0 else f"**{r.errors}** of {r.requests}"
        server_cpu = "n/a" if r.server_cpu_pct is None else f"{r.server_cpu_pct:.0f}%"
        pg_cpu = "n/a" if r.postgres_cpu_pct is None else f"{r.postgres_cpu_pct:.0f}%"
        rows.append(
            f"| {r.server} | {op_names.get((r.server, r.operation), r.operation)} |"
            f" {r.rps:.1f} | {fmt_ms(r.p50_ms)} | {fmt_ms(r.p99_ms)} | {errors} |"
            f" {r.wrk_cpu_pct:.0f}% | {server_cpu} | {pg_cpu} |"
        )
    return "\n".join(rows)


def render_ratios(results: list[Measurement]) -> list[str]:
    by = {(r.server, r.operation): r for r in results}
    lines = []
    for op in ("create", "get"):
        ty, ml = by.get(("Trainyard", op)), by.get(("MLflow", op))
        if not (ty and ml) or not ml.rps or not ml.p50_ms or not ml.p99_ms:
            continue
        lines.append(
            f"- {op}: {ty.rps / ml.rps:.2f}x the requests per second,"
            f" p50 {ty.p50_ms / ml.p50_ms:.2f}x, p99 {ty.p99_ms / ml.p99_ms:.2f}x"
        )
    return lines


def render_section(
    args: argparse.Namespace, results: list[Measurement], versions: dict[str, str], started: str
) -> str:
    command = shlex.join([".venv/bin/python", "bench/api_vs_mlflow.py", *sys.argv[1:]])
    secret = args.trainyard_key
    if secret:
        command = command.replace(secret, "<key>")
    ratios = render_ratios(results)
    unexpected = [
        f"{r.server} {r.operation}: {r.statuses}"
        for r in results
        if r.statuses and set(r.statuses) != {str(EXPECTED_STATUS[r.server, r.operation])}
    ]
    busy = [f"{r.server} {r.operation} {r.machine_busy_pct:.0f}%" for r in results]
    parts = [
        MARK_START,
        "## API throughput: Trainyard vs MLflow",
        "",
        "Written by `bench/api_vs_mlflow.py` (see `bench/README.md`); rerun it rather than"
        " editing this section.",
        "",
        f"- Command: `{command}`",
        f"- Date: {started}",
        f"- Machine: {machine_description()}",
        "- Versions: " + ", ".join(f"{k} {v}" for k, v in versions.items()),
        f"- Load: wrk, {args.threads} threads, {args.connections} connections,"
        f" {args.duration:g} s per measurement after a {args.warmup:g} s warm-up; get cycles"
        f" through {args.get_ids} runs created beforehand. Servers run one at a time with"
        f" {args.workers} workers each, on the same machine as wrk and PostgreSQL.",
        "",
        render_table(results),
        "",
        "CPU columns are % of one core over the measurement (wrk: the load generator's own"
        " cost, taken from its rusage; server: the server's whole process tree; Postgres: the"
        " postmaster listening on the database port and all its backends). Errors are"
        " non-2xx responses plus socket errors and time-outs.",
    ]
    if ratios:
        parts += [
            "",
            "Trainyard / MLflow (above 1 is more requests; below 1 is lower latency):",
            "",
            *ratios,
        ]
    parts += ["", "Machine CPU busy during each measurement: " + ", ".join(busy) + "."]
    if unexpected:
        parts += ["", "Unexpected status codes: " + "; ".join(unexpected) + "."]
    parts.append(MARK_END)
    return "\n".join(parts) + "\n"


def write_section(
    path: Path, section: str, start_mark: str = MARK_START, end_mark: str = MARK_END
) -> None:
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


# -------------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="API throughput of Trainyard vs MLflow's tracking server, measured with wrk.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--duration", type=float, default=15.0, help="seconds per measurement")
    p.add_argument(
        "--warmup",
        type=float,
        default=3.0,
        help="seconds of unrecorded load before each measurement (0: none)",
    )
    p.add_argument("--connections", type=int, default=32, help="wrk -c")
    p.add_argument("--threads", type=int, default=2, help="wrk -t")
    p.add_argument(
        "--wrk-timeout",
        type=float,
        default=10.0,
        help="wrk --timeout: a slower response counts as an error",
    )
    p.add_argument("--workers", type=int, default=2, help="server worker processes, both servers")
    p.add_argument(
        "--get-ids",
        type=int,
        default=200,
        help="runs created before the get measurement, which cycles through them",
    )
    p.add_argument("--only", choices=["trainyard", "mlflow"], help="measure one server only")
    p.add_argument(
        "--trainyard-url", help="use this running Trainyard server instead of starting one"
    )
    p.add_argument("--trainyard-key", help="API key for --trainyard-url")
    p.add_argument(
        "--trainyard-bin",
        type=Path,
        default=REPO / ".venv" / "bin" / "trainyard",
        help="the trainyard CLI used to migrate, create a key and start the API",
    )
    p.add_argument(
        "--trainyard-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra environment for the Trainyard server the harness starts (its rate limit "
        "and active-run cap are off unless set here)",
    )
    p.add_argument("--mlflow-spec", default=MLFLOW_SPEC, help="pip requirement for MLflow")
    p.add_argument(
        "--pg-url",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="admin connection; bench_trainyard and bench_mlflow are (re)created",
    )
    p.add_argument(
        "--redis-url",
        default="redis://127.0.0.1:6379/15",
        help="Redis for the Trainyard server the harness starts (flushed!)",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=REPO / "docs" / "benchmarks.md",
        help="markdown file whose api-throughput section is replaced",
    )
    p.add_argument(
        "--settle-timeout",
        type=float,
        default=60.0,
        help="longest wait for the machine to go idle before each measurement",
    )
    p.add_argument(
        "--start-timeout",
        type=float,
        default=120.0,
        help="longest wait for a server to answer after starting it",
    )
    args = p.parse_args(argv)
    if args.trainyard_url and not args.trainyard_key:
        p.error("--trainyard-url needs --trainyard-key")
    if args.trainyard_key and not args.trainyard_url:
        p.error("--trainyard-key only goes with --trainyard-url (otherwise a key is created)")
    if args.trainyard_url and args.only == "mlflow":
        p.error("--trainyard-url with --only mlflow makes no sense")
    args.postgres_pid = None  # found in main() when PostgreSQL runs on this machine
    return args


@contextlib.contextmanager
def stop_on_exit(servers: list[Server]) -> Iterator[None]:
    """Stop every started server however we leave: error, Ctrl-C, SIGTERM or SIGHUP."""

    def raise_interrupt(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    old = {s: signal.signal(s, raise_interrupt) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        # A second Ctrl-C must not leave servers behind: ignore signals while stopping.
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN)
        for server in reversed(servers):
            log(f"stopping {server.name} (process group {server.pgid})")
            try:
                server.stop()
            except Exception as e:  # keep stopping the others
                log(f"WARNING: could not stop {server.name}: {e}")
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for s, handler in old.items():
            signal.signal(s, handler)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if shutil.which("wrk") is None:
        print(
            "wrk (the HTTP load generator) is not installed. Install it with:\n"
            "    sudo apt-get update && sudo apt-get install -y wrk    # Debian/Ubuntu\n"
            "    brew install wrk                                       # macOS",
            file=sys.stderr,
        )
        return 2
    OUT.mkdir(parents=True, exist_ok=True)
    started = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    versions: dict[str, str] = {}
    results: list[Measurement] = []
    servers: list[Server] = []
    try:
        with stop_on_exit(servers):
            versions["PostgreSQL"] = pg_query(args.pg_url, "SHOW server_version")[0] or "?"
            pg = urllib.parse.urlsplit(args.pg_url)
            if pg.hostname in ("127.0.0.1", "localhost", "::1"):
                args.postgres_pid = listening_pid(pg.port or 5432)
            # Everything that can fail before the first measurement fails here.
            if args.only != "mlflow" and not args.trainyard_url:
                if not args.trainyard_bin.exists():
                    raise BenchError(
                        f"{args.trainyard_bin} not found: install the project first"
                        " (make install) or pass --trainyard-url and --trainyard-key"
                    )
                redis_command(args.redis_url, "PING")
            mlflow_venv = None if args.only == "trainyard" else ensure_mlflow_venv(args.mlflow_spec)

            if args.only != "mlflow":
                ty_results, versions["Trainyard"] = bench_trainyard(args, servers)
                results += ty_results
                for server in servers:
                    log(f"stopping {server.name} before the next server starts")
                    server.stop()
                servers.clear()
                if not args.trainyard_url:
                    redis_command(args.redis_url, "FLUSHDB")  # the enqueued, unworked tasks
            if mlflow_venv is not None:
                ml_results, versions["MLflow"] = bench_mlflow(args, servers, mlflow_venv)
                results += ml_results
    except BenchError as e:
        print(f"\nbench failed: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nbench interrupted; servers stopped", file=sys.stderr)
        return 130

    versions["wrk"] = wrk_version()
    versions["Python"] = platform.python_version()
    versions = {
        k: versions[k]
        for k in ("Trainyard", "MLflow", "PostgreSQL", "wrk", "Python")
        if k in versions
    }
    section = render_section(args, results, versions, started)
    write_section(args.output, section)
    (OUT / "api_vs_mlflow.json").write_text(
        json.dumps(
            {
                "started": started,
                "versions": versions,
                "args": {k: str(v) for k, v in vars(args).items() if k != "trainyard_key"},
                "results": [dataclasses.asdict(r) for r in results],
            },
            indent=2,
        )
        + "\n"
    )
    print()
    print(render_table(results))
    for line in render_ratios(results):
        print(line)
    print(
        f"\nwrote {args.output} (section {MARK_START} … {MARK_END});"
        f" raw wrk output and server logs in {OUT.relative_to(REPO)}/"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
