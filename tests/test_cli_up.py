"""`trainyard up` from an empty folder: embedded PostgreSQL and Redis, API and a worker, kept
running (a killed child comes back, the rest stays up), found by the other commands from any
folder without exports; SIGTERM stops everything it started."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.support.cli import TICKING, Up, cli, scratch, servers_under, user_env, wait_for


@pytest.fixture
def folder() -> Iterator[Path]:
    """Not pytest's tmp_path: see :func:`tests.cli.support.scratch`."""
    with scratch() as path:
        yield path


def _status(base: str, key: str, run_id: str) -> str:
    answer = httpx.get(f"{base}/runs/{run_id}", headers={"Authorization": f"Bearer {key}"})
    return str(answer.raise_for_status().json()["status"])


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _wait_for_state(path: Path, state: dict[str, Any]) -> None:
    """Until ``path`` holds ``state``: `up` writes its folder's file (what ``Up.start`` waits
    for) and then the user's, so a busy machine can read between the two."""

    def holds() -> bool:
        try:
            return bool(json.loads(path.read_text()) == state)
        except (OSError, ValueError):
            return False

    wait_for(f"{path} to name this up", holds, 10)


@pytest.mark.slow
def test_up_serves_the_api_and_other_folders_find_it(folder: Path) -> None:
    proj, elsewhere = folder / "proj", folder / "elsewhere"
    proj.mkdir()
    elsewhere.mkdir()
    env = user_env(folder / "user", TRAINYARD_PIPELINE=TICKING, TRAINYARD_HEARTBEAT_SECONDS="0.5")
    up = Up(proj, env, folder / "up.log")
    try:
        state = up.start()
        base = state["api_url"]
        assert base == f"http://127.0.0.1:{up.port}" and state["api_key"].startswith("ty_")
        # The same state where a terminal in any other folder looks for it.
        _wait_for_state(folder / "user" / ".trainyard" / "up.json", state)
        # Printed just after the state is written: wait for the line, not the file.
        wait_for("up to print its key", lambda: state["api_key"] in up.output(), 30, up.log)

        # From another folder, nothing exported: the up's database, not a new one there.
        made = cli("keys", "create", "--project", "other", "--json", cwd=elsewhere, env=env)
        assert made.returncode == 0, made.stderr
        other_key = json.loads(made.stdout)["key"]
        assert httpx.get(
            f"{base}/runs", headers={"Authorization": f"Bearer {other_key}"}
        ).is_success
        assert not (elsewhere / ".trainyard").exists() and not servers_under(elsewhere)

        preset = elsewhere / "run.json"
        preset.write_text(
            json.dumps(
                {
                    "model_name": "tiny",
                    "task_description": "say a",
                    "inputs": [{"input_text": "a"}],
                    "max_steps": 50,
                    "reward": {"type": "function", "functions": [{"name": "char_fraction"}]},
                }
            )
        )
        created = cli("runs", "create", str(preset), "config.tick=5", cwd=elsewhere, env=env)
        assert created.returncode == 0, created.stderr
        run_id = created.stdout.strip()
        got = cli("runs", "get", run_id, "--json", cwd=elsewhere, env=env)
        run = json.loads(got.stdout)
        assert run["id"] == run_id and run["config"] == {"tick": 5}
        listed = cli("runs", "list", cwd=elsewhere, env=env)
        assert listed.returncode == 0 and run_id in listed.stdout.split()

        key = state["api_key"]
        wait_for("the run to be collecting", lambda: _status(base, key, run_id) == "collecting", 30)
        cancelled = cli("runs", "cancel", run_id, cwd=elsewhere, env=env)
        assert cancelled.returncode == 0, cancelled.stderr
        wait_for("the cancel", lambda: _status(base, key, run_id) == "cancelled", 10)
        assert servers_under(up.home)
    finally:
        code = up.stop()
    assert code == 0, up.output()
    wait_for("the embedded servers to stop", lambda: not servers_under(up.home), 10)
    stopped = up.state(running=False)
    assert stopped is not None and stopped["pid"] is None and stopped["api_key"] == key
    after = cli("runs", "list", cwd=elsewhere, env=env)
    assert after.returncode == 1 and len(after.stderr.splitlines()) == 1
    assert "trainyard up" in after.stderr


@pytest.mark.slow
def test_a_killed_worker_or_api_is_restarted_and_the_rest_stays_up(folder: Path) -> None:
    env = user_env(folder / "user", TRAINYARD_PIPELINE=TICKING, TRAINYARD_HEARTBEAT_SECONDS="0.5")
    up = Up(folder, env, folder / "up.log")
    children: set[int] = set()
    try:
        state = up.start()
        base, key = state["api_url"], state["api_key"]
        servers = _embedded_servers(up.home)
        assert all(_alive(pid) for pid in servers)
        worker, api = state["children"]["worker"], state["children"]["api"]
        children |= {worker, api}

        os.kill(worker, signal.SIGKILL)
        state = wait_for(
            "a new worker",
            lambda: (s := up.state(running=True)) and s["children"]["worker"] != worker and s,
            30,
            up.log,
        )
        new_worker = state["children"]["worker"]
        children.add(new_worker)
        assert f"worker (pid {worker}) was killed by SIGKILL; restarting in 1 s" in up.output()
        assert f"worker restarted (pid {new_worker})" in up.output()
        # Nothing else went down with it.
        assert state["children"]["api"] == api and _alive(api) and up.ready()
        assert _embedded_servers(up.home) == servers and all(_alive(pid) for pid in servers)

        # The new worker does the work.
        created = cli("runs", "create", str(_preset(folder)), cwd=folder, env=env)
        assert created.returncode == 0, created.stderr
        run_id = created.stdout.strip()
        wait_for(
            "the worker to take the run", lambda: _status(base, key, run_id) == "generating", 30
        )

        os.kill(api, signal.SIGKILL)
        state = wait_for(
            "a new API",
            lambda: (s := up.state(running=True)) and s["children"]["api"] != api and s,
            30,
            up.log,
        )
        children.add(state["children"]["api"])
        wait_for("the new API to answer", up.ready, 60, up.log)
        assert state["children"]["worker"] == new_worker and _alive(new_worker)
        assert _status(base, key, run_id) == "generating"  # the worker kept the run
        assert cli("runs", "cancel", run_id, cwd=folder, env=env).returncode == 0
        wait_for("the cancel", lambda: _status(base, key, run_id) == "cancelled", 10)
    finally:
        code = up.stop()
    assert code == 0, up.output()
    assert not [pid for pid in children if _alive(pid)]
    wait_for("the embedded servers to stop", lambda: not servers_under(up.home), 10)


@pytest.mark.slow
def test_a_second_up_leaves_the_user_file_of_a_running_one_alone(folder: Path) -> None:
    """~/.trainyard/up.json belongs to the `up` it names while that one runs: an `up` in a
    second folder writes only its own folder's file and says which one it left alone."""
    one_dir, two_dir = folder / "one", folder / "two"
    one_dir.mkdir()
    two_dir.mkdir()
    env = user_env(folder / "user")
    user_file = folder / "user" / ".trainyard" / "up.json"
    first = Up(one_dir, env, folder / "one.log")
    second = Up(two_dir, env, folder / "two.log")
    # Each `up` is stopped whatever fails (a failure must not leave the first one's worker and
    # servers running), the second inside the first.
    try:
        one = first.start()
        _wait_for_state(user_file, one)
        try:
            two = second.start()
            key_line = f"saved in {second.state_file}: "
            wait_for("the second up to print its key", lambda: key_line in second.output(), 30)
            said = second.output()
            assert f"left {user_file} alone: it names the `trainyard up` running for " in said
            assert f"{one['home']} (pid {one['pid']}, API at {one['api_url']})" in said
            assert json.loads(user_file.read_text()) == one  # still the first's
            assert two["pid"] == second.proc.pid and two["api_url"] != one["api_url"]
            # From a third folder, a command still reaches the first.
            found = cli("status", "--json", cwd=folder, env=env)
            assert json.loads(found.stdout)["pid"] == one["pid"], found.stderr
        finally:
            code = second.stop()
        assert code == 0, second.output()
        assert json.loads(user_file.read_text()) == one  # its stop did not write it either
    finally:
        first_code = first.stop()
    assert first_code == 0, first.output()


def _rows(base: str, key: str, run_id: str) -> list[tuple[int, int, int]]:
    """The run's rollouts as (step, group, rollout), oldest first, every page."""
    rows: list[tuple[int, int, int]] = []
    params: dict[str, Any] = {"limit": 200}
    while True:
        page = httpx.get(
            f"{base}/runs/{run_id}/trajectories",
            params=params,
            headers={"Authorization": f"Bearer {key}"},
        ).raise_for_status()
        body = page.json()
        rows += [(t["step"], t["group_index"], t["rollout_index"]) for t in body["data"]]
        if not body.get("next_cursor"):
            return sorted(rows)
        params["after"] = body["next_cursor"]


@pytest.mark.chaos  # a process killed: the chaos tier (make test-chaos)
@pytest.mark.slow
def test_killed_embedded_postgres_and_redis_come_back_and_the_runs_finish_by_themselves(
    folder: Path,
) -> None:
    """`up` keeps what it started running, the embedded servers too: `kill -9` of the
    postmaster mid-run, then of Redis mid-run, and each run completes with every rollout
    once, nobody touching anything."""
    # A worker that lost the database mid-step cannot release its lease: the run is taken
    # again once the lease runs out (3 s here, 30 by default) and a sweep finds it.
    env = user_env(
        folder / "user",
        TRAINYARD_PIPELINE=TICKING,
        TRAINYARD_HEARTBEAT_SECONDS="0.5",
        TRAINYARD_LEASE_TTL_SECONDS="3",
        TRAINYARD_REAPER_INTERVAL_SECONDS="0.5",
    )
    up = Up(folder, env, folder / "up.log")
    steps, groups, rollouts = 8, 2, 2
    preset = folder / "run.yaml"
    preset.write_text(
        "model_name: tiny\ntask_description: say a\ninputs: [{input_text: a}]\n"
        f"max_steps: {steps}\nrollouts_per_group: {rollouts}\n"
        f"grpo: {{groups_per_step: {groups}}}\n"
        "reward: {type: function, functions: [{name: char_fraction}]}\nconfig: {tick: 0.5}\n"
    )
    expected = [(s, g, r) for s in range(steps) for g in range(groups) for r in range(rollouts)]
    try:
        state = up.start()
        base, key = state["api_url"], state["api_key"]
        postmaster, redis_server = _embedded_servers(up.home)

        def step_of(run_id: str) -> int:
            answer = httpx.get(f"{base}/runs/{run_id}", headers={"Authorization": f"Bearer {key}"})
            return int(answer.json()["step"]) if answer.status_code == 200 else -1

        for name, pid in (("embedded PostgreSQL", postmaster), ("embedded Redis", redis_server)):
            created = cli("runs", "create", str(preset), cwd=folder, env=env)
            assert created.returncode == 0, created.stderr
            run_id = created.stdout.strip()
            wait_for("the run to reach step 2", lambda run_id=run_id: step_of(run_id) >= 2, 60)
            os.kill(pid, signal.SIGKILL)
            wait_for(
                f"{name} to be restarted",
                lambda n=name: f"{n} restarted" in up.output(),
                60,
                up.log,
            )
            assert f"{name} (pid {pid}) is gone; restarting in 1 s" in up.output()
            wait_for(
                "the run to complete",
                lambda run_id=run_id: _status(base, key, run_id) in {"completed", "failed"},
                120,
                up.log,
            )
            assert _status(base, key, run_id) == "completed", up.output()
            assert _rows(base, key, run_id) == expected
        # The API and the worker never went down; the servers are new ones.
        now = up.state(running=True)
        assert now is not None and now["children"] == state["children"]
        assert set(_embedded_servers(up.home)).isdisjoint({postmaster, redis_server})
    finally:
        code = up.stop()
    assert code == 0, up.output()
    wait_for("the embedded servers to stop", lambda: not servers_under(up.home), 10)


def _embedded_servers(home: Path) -> list[int]:
    """The pids of the embedded PostgreSQL postmaster and Redis server."""
    pidfiles = (home / "pg" / "postmaster.pid", home / "redis" / "redis.pid")
    return [int(f.read_text().split()[0]) for f in pidfiles]


def _preset(folder: Path) -> Path:
    preset = folder / "run.yaml"
    preset.write_text(
        "model_name: tiny\ntask_description: say a\ninputs: [{input_text: a}]\nmax_steps: 50\n"
        "reward: {type: function, functions: [{name: char_fraction}]}\nconfig: {tick: 30}\n"
    )
    return preset


def test_up_on_a_port_in_use_says_so_and_starts_nothing(folder: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = cli("up", "--port", str(port), cwd=folder, env=user_env(folder / "user"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.splitlines() == [done.stderr.strip()] and "--port" in done.stderr
    assert not (folder / ".trainyard").exists()


@pytest.mark.slow
def test_a_killed_up_takes_its_children_along_and_the_next_up_cleans_up(folder: Path) -> None:
    env = user_env(folder / "user")
    first = Up(folder, env, folder / "first.log")
    try:
        state = first.start()
        servers = _embedded_servers(first.home)
        assert first.proc is not None
        first.proc.kill()
        first.proc.wait()
        wait_for(
            "the API and the worker to die with their parent",
            lambda: not any(_alive(pid) for pid in state["children"].values()),
            30,
        )
    finally:
        first.stop()
    assert all(_alive(pid) for pid in servers)  # detached: they outlive `up`

    second = Up(folder, env, folder / "second.log")
    try:
        again = second.start()
        assert _embedded_servers(second.home) == servers and "(reused)" in second.output()
        assert again["api_key"] == state["api_key"]  # the same key, still valid
    finally:
        code = second.stop()
    assert code == 0, second.output()
    wait_for("the embedded servers to stop", lambda: not servers_under(second.home), 10)
