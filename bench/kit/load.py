"""The load generators: wrk, run as a child whose own CPU time is read back; ``RawHTTP``, a
lean keep-alive HTTP/1.1 client on asyncio streams; ``ClientFleet``, load client processes
released at one start time."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import re
import resource
import shlex
import subprocess
import time
import urllib.parse
from collections.abc import Callable, Coroutine
from typing import Any

from kit import BENCH, OUT, REPO, BenchError, log

WRK_SCRIPTS = BENCH / "wrk"


class TransportError(Exception):
    """A request that got no HTTP answer (refused, reset, closed early, timed out)."""


class RawHTTP:
    """One keep-alive HTTP/1.1 connection, one request at a time: the load generator of
    bench/pollers.py and bench/gateway.py. It earns its place: 200 pollers on a 2-core
    machine cost the client 0.23 ms of CPU per request this way and 5.0 ms through one
    shared ``httpx.AsyncClient`` (a 10 s side-by-side run, `--client raw` vs `--client
    httpx`), and the client's cores are the API's. Enough HTTP for our API: GET and a JSON
    POST, Content-Length or chunked bodies, and ``Connection: close``."""

    def __init__(self, base_url: str, key: str, timeout: float) -> None:
        u = urllib.parse.urlsplit(base_url)
        self.host = u.hostname or "127.0.0.1"
        self.port = u.port or 80
        self.head = f"Host: {u.netloc}\r\nAuthorization: Bearer {key}\r\n\r\n".encode()
        self.timeout = timeout
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def get(self, target: str, extra: bytes = b"") -> tuple[int, bytes]:
        """GET ``target``; ``extra``: more header lines, each ending in CRLF."""
        status, _, body = await self.request(target, extra)
        return status, body

    async def post(self, target: str, body: bytes) -> tuple[int, bytes]:
        """POST the JSON ``body`` to ``target``: status, body."""
        extra = b"Content-Type: application/json\r\nContent-Length: %d\r\n" % len(body)
        status, _, answer = await self.request(target, extra, b"POST", body)
        return status, answer

    async def request(
        self, target: str, extra: bytes = b"", method: bytes = b"GET", body: bytes = b""
    ) -> tuple[int, bytes, bytes]:
        """``method`` ``target``: status, the value of the response's ``ETag`` (b"" if
        none), body."""
        try:
            async with asyncio.timeout(self.timeout):
                return await self._send(method, target, extra, body)
        except (OSError, EOFError, TimeoutError, ValueError, asyncio.IncompleteReadError) as e:
            self.close()
            raise TransportError(type(e).__name__) from e

    async def _send(
        self, method: bytes, target: str, extra: bytes, body: bytes
    ) -> tuple[int, bytes, bytes]:
        if self.writer is None or self.reader is None:
            self.reader, self.writer = await asyncio.open_connection(self.host, self.port)
        self.writer.write(
            method + b" " + target.encode() + b" HTTP/1.1\r\n" + extra + self.head + body
        )
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split(b" ", 2)[1])
        length, chunked, close, etag = 0, False, False, b""
        for line in lines[1:]:
            name, _, value = line.partition(b":")
            name = name.strip().lower()
            if name == b"etag":
                etag = value.strip()
            elif name == b"content-length":
                length = int(value)
            elif name == b"transfer-encoding":
                chunked = b"chunked" in value.lower()
            elif name == b"connection":
                close = b"close" in value.lower()
        if chunked:
            parts = []
            while size := int((await self.reader.readuntil(b"\r\n")).split(b";")[0], 16):
                parts.append(await self.reader.readexactly(size + 2))
            await self.reader.readuntil(b"\r\n")
            body = b"".join(p[:-2] for p in parts)
        else:
            body = await self.reader.readexactly(length) if length else b""
        if close:
            self.close()
        return status, etag, body

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def client_process(
    main: Callable[[Any, mpc.Connection], Coroutine[Any, Any, Any]], cfg: Any, conn: mpc.Connection
) -> None:
    """Entry point of a load client process (:class:`ClientFleet`): runs ``main(cfg, conn)``
    on uvloop and sends back what it returns (a dataclass as a plain dict: its class lives
    in ``__mp_main__`` here) or the error, as a string. ``main`` sends "ready", receives the
    start time (``time.time()`` epoch) and loads the API until its window ends."""
    try:
        import uvloop

        factory: Callable[[], asyncio.AbstractEventLoop] | None = uvloop.new_event_loop
    except ImportError:  # pragma: no cover - uvloop comes with the API's dependencies
        factory = None
    try:
        with asyncio.Runner(loop_factory=factory) as runner:
            result: Any = runner.run(main(cfg, conn))
            if dataclasses.is_dataclass(result) and not isinstance(result, type):
                result = dataclasses.asdict(result)
            conn.send(result)
    except BaseException as e:  # the parent reports it
        with contextlib.suppress(OSError):
            conn.send(f"{type(e).__name__}: {e}")
    finally:
        conn.close()


class ClientFleet:
    """Load client processes, one per config, each running ``main`` (:func:`client_process`):
    started, released at one start time, collected and, if need be, killed. Spawned, not
    forked: the harness has threads (the pinner)."""

    what = "client process"

    def __init__(
        self, main: Callable[[Any, mpc.Connection], Coroutine[Any, Any, Any]], configs: list[Any]
    ) -> None:
        self.procs: list[Any] = []
        self.conns: list[mpc.Connection] = []
        ctx = mp.get_context("spawn")
        for cfg in configs:
            parent, child = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=client_process, args=(main, cfg, child), daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def _recv(self, conn: mpc.Connection, deadline: float, what: str) -> Any:
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            raise BenchError(f"a {self.what} did not {what} in time")
        try:
            msg = conn.recv()
        except EOFError as e:
            raise BenchError(f"a {self.what} exited before it could {what}") from e
        if isinstance(msg, str) and msg != "ready":
            raise BenchError(f"a {self.what} failed: {msg}")
        return msg

    def start(self, ready_timeout: float, lead: float) -> float:
        """Wait until every process is ready; they start ``lead`` s from now (returned)."""
        deadline = time.monotonic() + ready_timeout
        for conn in self.conns:
            self._recv(conn, deadline, "start")
        start_at = time.time() + lead
        for conn in self.conns:
            conn.send(start_at)
        return start_at

    def send(self, message: Any) -> None:
        """A message to every process (one its ``main`` waits for: "stop")."""
        for conn in self.conns:
            conn.send(message)

    def collect(self, timeout: float) -> list[Any]:
        """What each process's ``main`` returned, in order."""
        deadline = time.monotonic() + timeout
        results = [self._recv(conn, deadline, "report") for conn in self.conns]
        for proc in self.procs:
            proc.join(timeout=10)
        return results

    def kill(self) -> None:
        for proc in self.procs:
            with contextlib.suppress(Exception):
                if proc.is_alive():
                    proc.kill()
                proc.join(timeout=5)
        for conn in self.conns:
            with contextlib.suppress(OSError):
                conn.close()


@dataclasses.dataclass
class WrkRun:
    """What one wrk run reported, from the ``WRK_JSON`` line of bench/wrk/common.lua when
    there is one, else from wrk's own text."""

    rps: float
    p50_ms: float
    p99_ms: float
    requests: int
    errors: int  # non-2xx answers, socket errors and time-outs
    statuses: dict[str, int]
    cpu_seconds: float  # wrk's own user + system time
    wall_seconds: float


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
    *,
    label: str,
    url: str,
    script: str,
    script_args: list[str],
    threads: int,
    connections: int,
    duration: float,
    timeout: float,
    secret: str | None = None,
) -> WrkRun:
    """``wrk --latency -s bench/wrk/<script> url -- script_args``; raw output in
    ``bench/out/<label>.wrk.txt`` (``secret`` shown as ``<key>`` in the logged command)."""
    cmd = [
        "wrk",
        f"-t{threads}",
        f"-c{connections}",
        f"-d{duration:g}s",
        f"--timeout={timeout:g}s",
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
        f.seek(0)
        text = f.read()
    if proc.returncode != 0:
        raise BenchError(f"wrk exited with {proc.returncode}; output ({out_path}):\n{text[-3000:]}")
    cpu = rusage.ru_utime + rusage.ru_stime
    stats = parse_wrk_text(text)
    m = re.search(r"^WRK_JSON (\{.*\})\s*$", text, re.M)
    if not m:  # the Lua done() did not run; wrk's text still has the essentials
        log(f"WARNING: no WRK_JSON line in {out_path}; using wrk's text report")
        return WrkRun(
            rps=stats.get("rps", 0.0),
            p50_ms=stats.get("p50_ms", float("nan")),
            p99_ms=stats.get("p99_ms", float("nan")),
            requests=stats.get("requests", 0),
            errors=stats["non2xx"] + stats["socket_errors"],
            statuses={},
            cpu_seconds=cpu,
            wall_seconds=wall,
        )
    data = json.loads(m.group(1))
    statuses = {str(k): int(v) for k, v in data["statuses"].items()}
    e = data["errors"]
    requests = int(data["requests"])
    return WrkRun(
        rps=stats.get("rps") or requests / (data["duration_us"] / 1e6),
        p50_ms=data["latency_us"]["p50"] / 1e3,
        p99_ms=data["latency_us"]["p99"] / 1e3,
        requests=requests,
        errors=sum(n for code, n in statuses.items() if not 200 <= int(code) < 300)
        + e["connect"]
        + e["read"]
        + e["write"]
        + e["timeout"],
        statuses=statuses,
        cpu_seconds=cpu,
        wall_seconds=wall,
    )


def wrk_version() -> str:
    res = subprocess.run(["wrk", "-v"], capture_output=True, text=True)
    m = re.search(r"wrk (\S+)", res.stdout + res.stderr)
    return m.group(1) if m else "unknown"


async def window_cpu(start_at: float, end_at: float) -> tuple[float, float]:
    """This process's CPU seconds (user + system) between two ``time.time()`` instants, and
    the wall seconds between the readings: what a load client costs inside its window."""
    await asyncio.sleep(max(0.0, start_at - time.time()))
    r0, w0 = resource.getrusage(resource.RUSAGE_SELF), time.time()
    await asyncio.sleep(max(0.0, end_at - time.time()))
    r1, w1 = resource.getrusage(resource.RUSAGE_SELF), time.time()
    return (r1.ru_utime + r1.ru_stime) - (r0.ru_utime + r0.ru_stime), w1 - w0
