"""``trainyard up`` (the services, migrated, the API and a worker under a supervisor, and
the state file the other commands read), ``trainyard status`` (what that file says) and
``trainyard demo`` (all of it end to end; the demo itself is app/cli/demo.py)."""

from __future__ import annotations

import os
import signal
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Annotated

import typer

from app.auth.roles import Role
from app.cli.common import CliError, Json, err, print_json
from app.cli.common import settings as _settings
from app.cli.db import safe_url, upgrade
from app.cli.http import auth
from app.cli.keys import create_key
from app.cli.supervisor import Supervisor

UP_PROJECT = "default"  # the project of the key `trainyard up` makes


def _client_host(host: str) -> str:
    """Where a client on this machine reaches an API listening on ``host``."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _check_port(host: str, port: int) -> None:
    """Fail at once on a port in use, rather than after the API's restarts run out."""
    import socket

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise CliError(
                f"cannot serve on {host}:{port} ({exc.strerror}): stop what uses it, or pass --port"
            ) from exc


def _wait_for_api(supervisor: Supervisor, url: str, timeout: float = 180.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        supervisor.check()
        try:
            if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise CliError(f"the API did not answer {url}/healthz within {timeout:.0f} s")
        time.sleep(0.2)


def _key_works(url: str, key: str) -> bool:
    import httpx

    try:
        answer = httpx.get(f"{url}/runs", params={"limit": 1}, headers=auth(key), timeout=10)
    except httpx.HTTPError:
        return False
    return answer.status_code == 200


def up(
    host: str = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    api_workers: Annotated[int, typer.Option(min=1)] = 1,
) -> None:
    """Start what is needed (embedded PostgreSQL/Redis when no URL is set), migrate, then
    serve the API and one worker in the foreground, restarting either if it dies.

    Leaves the API's URL and an API key (project 'default') in `<home>/up.json`, where the
    other commands find them. Ctrl-C or SIGTERM stops everything it started."""
    import psutil

    from app.cli.installation import (
        Installation,
        held_by_another,
        read_state,
        state_files,
        write_state,
    )

    settings = _settings()
    home = settings.home.expanduser().resolve()
    paths = state_files(settings)
    me = psutil.Process()
    previous = read_state(paths[0])
    if previous is not None and previous.running():
        raise CliError(
            f"trainyard up is already running for {home} (pid {previous.pid}, API at "
            f"{previous.api_url}); stop it first, or set TRAINYARD_HOME to another folder"
        )
    _check_port(host, port)
    state: Installation | None = None
    left_alone: set[Path] = set()

    def say(message: str) -> None:
        err.print(f"[dim]up:[/] {message}", highlight=False)

    def save() -> list[Path]:
        """Write the state where this ``up`` may; the files written."""
        written = []
        if state is not None:
            for path in paths:
                other = held_by_another(path, me.pid)
                if other is None:
                    write_state(path, state)
                    written.append(path)
                elif path not in left_alone:
                    left_alone.add(path)
                    say(
                        f"left {path} alone: it names the `trainyard up` running for "
                        f"{other.home} (pid {other.pid}, API at {other.api_url}), which "
                        "commands outside this folder keep finding; they find this one with "
                        f"TRAINYARD_HOME={home}"
                    )
        return written

    def on_change() -> None:
        nonlocal state
        if state is not None:
            state = replace(state, children=supervisor.pids())
            save()

    supervisor = Supervisor(say, on_change)

    def interrupted(*_: object) -> None:
        raise KeyboardInterrupt  # SIGTERM (and a closed terminal) stop the way Ctrl-C does

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGHUP, interrupted)
    try:
        if settings.database_url:
            db_url = settings.database_url
        else:
            from app.core.embedded import start_postgres

            pg = start_postgres(home)
            supervisor.keep("embedded PostgreSQL", pg, lambda: start_postgres(home))
            db_url = pg.url
            say(f"embedded PostgreSQL ({'started' if pg.started else 'reused'}) in {home}")
        if settings.redis_url:
            broker = settings.redis_url
        else:
            from app.core.embedded import start_redis

            rd = start_redis(home)
            supervisor.keep("embedded Redis", rd, lambda: start_redis(home))
            broker = rd.url
            say(f"embedded Redis ({'started' if rd.started else 'reused'}) in {home}")
        # One person's machine: the runs are its user's own, so they may name any code.
        policy = settings.code_policy or "open"
        say(
            f"code policy {policy}"
            + (
                ": runs may name any import path, command, URL or model folder "
                "(TRAINYARD_CODE_POLICY=catalog allows only the catalog's; docs/security.md)"
                if policy == "open"
                else f" (catalog: {settings.catalog or 'none, built-ins only'})"
            )
        )
        env = {
            **os.environ,
            "TRAINYARD_DATABASE_URL": db_url,
            "TRAINYARD_REDIS_URL": broker,
            "TRAINYARD_HOME": str(home),
            "TRAINYARD_CODE_POLICY": policy,
            # Where a push-mode gateway run's harness reaches this API.
            "TRAINYARD_PUBLIC_URL": os.environ.get(
                "TRAINYARD_PUBLIC_URL", f"http://{_client_host(host)}:{port}"
            ),
        }
        upgrade(db_url)
        exe = [sys.executable, "-m", "app.cli"]
        api_argv = ["api", "--host", host, "--port", str(port), "--workers", str(api_workers)]
        supervisor.start("api", [*exe, *api_argv], env)
        supervisor.start("worker", [*exe, "worker"], env)
        url = f"http://{_client_host(host)}:{port}"
        _wait_for_api(supervisor, url)

        if previous is not None and previous.api_key and _key_works(url, previous.api_key):
            key_id, key = previous.api_key_id, previous.api_key
        else:
            # Its user's own key: every route, webhooks included.
            made_id, key = create_key(db_url, UP_PROJECT, "trainyard up", Role.admin)
            key_id = made_id
        state = Installation(
            home=str(home),
            api_url=url,
            database_url=db_url,
            broker_url=broker,
            pid=me.pid,
            process_started=me.create_time(),
            api_key=key,
            api_key_id=key_id,
            children=supervisor.pids(),
        )
        written = save()
        err.print(f"[bold green]Trainyard is up[/] on {url}  (Ctrl-C stops it)", highlight=False)
        err.print(
            f"API key (project {UP_PROJECT!r}): {key}\n"
            f"[dim]saved in {' and '.join(map(str, written))}: `trainyard runs …` in another "
            "terminal uses it; `trainyard keys create --project NAME` makes more",
            highlight=False,
        )
        while True:
            supervisor.check()
            time.sleep(0.2)
    except KeyboardInterrupt:
        say("stopping…")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            supervisor.stop()
            if state is not None:
                stopped = state.stopped()
                for path in paths:
                    current = read_state(path)
                    if current is None or current.pid == state.pid:  # not another up's
                        write_state(path, stopped)
            # Reused ones too: with no other `up` for this home (checked above), a server
            # already running there was left by an `up` that crashed.
            for service in supervisor.running_services():
                service.stop()
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def status(
    as_json: Json = False,
    key: Annotated[bool, typer.Option("--key", help="Print only its API key.")] = False,
) -> None:
    """Say whether a `trainyard up` is running, and where its parts are."""
    from app.cli.installation import find_installation, no_installation

    settings = _settings()
    found = find_installation(settings)
    if found is None:
        raise no_installation(settings)
    if key:
        if not found.api_key:
            raise CliError("the running `trainyard up` has no key yet")
        print(found.api_key, flush=True)
        return
    if as_json:
        print_json(asdict(found))
        return
    children = ", ".join(f"{name} pid {pid}" for name, pid in found.children.items())
    print(f"up:       pid {found.pid} ({children})")
    print(f"api:      {found.api_url}")
    print(f"home:     {found.home}")
    print(f"database: {safe_url(found.database_url)}")
    print(f"broker:   {found.broker_url}")
    print(f"key:      {found.api_key or '(none)'}")


def demo(
    port: Annotated[int, typer.Option(min=1, max=65535)] = 8000,
    preset: Annotated[
        Path | None,
        typer.Option(
            exists=True,
            dir_okay=False,
            help="The run body. Default: `configs/runs/letters.yaml` "
            "(`configs/runs/agent-calculator.yaml` with --agent, "
            "`configs/runs/agent-gateway.yaml` with --gateway).",
        ),
    ] = None,
    agent: Annotated[
        bool,
        typer.Option(
            "--agent",
            help="An agent run: the tiny model's tool variant, an SFT warm-up, then GRPO in "
            "the calculator environment, one episode shown every few steps.",
        ),
    ] = False,
    gateway: Annotated[
        bool,
        typer.Option(
            "--gateway",
            help="A gateway run: the calculator agent played by a harness in a process of "
            "its own (examples/gateway/calculator.py, the plain openai SDK) through the "
            "gateway.",
        ),
    ] = False,
    overrides: Annotated[list[str] | None, typer.Argument(help="Dotted overrides.")] = None,
) -> None:
    """Everything end to end: services, API, worker, the tiny model, a real training run
    created over HTTP and followed to the end."""
    from app.cli.demo import AGENT, GATEWAY, PLAIN, run_demo

    flavour = GATEWAY if gateway else AGENT if agent else PLAIN
    raise typer.Exit(run_demo(port, preset, overrides or [], flavour))
