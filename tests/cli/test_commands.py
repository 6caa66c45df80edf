"""The client commands as a new user meets them: every error one line and a non-zero exit,
ids whole, --json output, and model paths sent absolute. The API is a real ``trainyard api``
process on the session's database; the commands are real ``trainyard`` processes."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.cli import ROOT, cli, free_port, servers_under, user_env, wait_for


def _one_line_error(done: subprocess.CompletedProcess[str], code: int = 1) -> str:
    assert done.returncode == code, (done.returncode, done.stdout, done.stderr)
    assert "Traceback" not in done.stderr and done.stdout == ""
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), done.stderr
    return lines[0]


@pytest.mark.slow
def test_without_a_running_up_client_commands_say_so_and_start_nothing(tmp_path: Path) -> None:
    env = user_env(tmp_path / "user")
    for args in (
        ["keys", "create", "--project", "p"],
        ["keys", "revoke", str(uuid.uuid4())],
        ["data", "export", "-"],
        ["status"],
    ):
        line = _one_line_error(cli(*args, cwd=tmp_path, env=env))
        assert "no running Trainyard" in line and "trainyard up" in line, line
    # No embedded PostgreSQL was started in the folder (the old `keys create` did, and then
    # failed on its empty database with a 157-line traceback).
    assert not (tmp_path / ".trainyard").exists() and not servers_under(tmp_path)
    line = _one_line_error(cli("runs", "list", cwd=tmp_path, env=env))
    assert "no API key" in line and "TRAINYARD_API_KEY" in line


@pytest.mark.slow
def test_a_database_without_the_schema_is_one_line_saying_what_to_run(
    service_urls: tuple[str, str], tmp_path: Path
) -> None:
    import asyncio

    import asyncpg
    from sqlalchemy.engine import make_url

    from app.core.pg import connect_kwargs

    name = f"trainyard_cli_empty_{uuid.uuid4().hex[:8]}"

    async def admin(sql: str) -> None:
        conn = await asyncpg.connect(**connect_kwargs(service_urls[0]))
        try:
            await conn.execute(sql)
        finally:
            await conn.close()

    asyncio.run(admin(f'CREATE DATABASE "{name}"'))
    try:
        empty = make_url(service_urls[0]).set(database=name).render_as_string(False)
        env = user_env(tmp_path / "user", TRAINYARD_DATABASE_URL=empty)
        line = _one_line_error(cli("keys", "create", "--project", "p", cwd=tmp_path, env=env))
        assert "no Trainyard tables" in line and "trainyard db upgrade" in line
    finally:
        asyncio.run(admin(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))


@dataclass
class Server:
    url: str
    key: str
    env: dict[str, str]  # a user who has set the database URL only


@pytest.fixture(scope="module")
def server(
    service_urls: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    """`trainyard api` on the session's database, and a key `trainyard keys create` made
    there through TRAINYARD_DATABASE_URL."""
    import os

    folder = tmp_path_factory.mktemp("api")
    db_url, broker = service_urls
    env = user_env(folder / "user", TRAINYARD_DATABASE_URL=db_url)
    api_env = {
        **env,
        "TRAINYARD_REDIS_URL": broker,
        "TRAINYARD_BROKER_PREFIX": os.environ["TRAINYARD_BROKER_PREFIX"],
        "TRAINYARD_HOME": str(folder / "home"),
        # `trainyard api` alone runs the catalog policy; this user's runs name a model folder
        # of their own, as under `trainyard up`.
        "TRAINYARD_CODE_POLICY": "open",
    }
    port = free_port()
    log = (folder / "api.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "app.cli", "api", "--port", str(port)],
        cwd=folder,
        env=api_env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"

    def answers() -> bool:
        assert proc.poll() is None, (folder / "api.log").read_text()
        try:
            return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_for("the API", answers, 60, folder / "api.log")
        made = cli(
            "keys", "create", "--project", f"cli-{uuid.uuid4().hex[:8]}", cwd=folder, env=env
        )
        assert made.returncode == 0, made.stderr
        yield Server(url, made.stdout.strip().splitlines()[-1], env)
    finally:
        proc.terminate()
        proc.wait(30)
        log.close()


def _api(server: Server) -> list[str]:
    return ["--api-url", server.url, "--api-key", server.key]


def _run_body(**fields: object) -> dict[str, object]:
    return {
        "model_name": "org/tiny",
        "task_description": "say a",
        "inputs": [{"input_text": "a"}],
        "reward": {"type": "function", "functions": [{"name": "char_fraction"}]},
        **fields,
    }


@pytest.mark.slow
def test_api_errors_are_one_line_with_the_problem(server: Server, tmp_path: Path) -> None:
    missing = str(uuid.uuid4())
    line = _one_line_error(cli("runs", "get", missing, *_api(server), cwd=tmp_path, env=server.env))
    assert "404" in line and "not found" in line.lower()

    line = _one_line_error(
        cli("runs", "get", "not-a-uuid", *_api(server), cwd=tmp_path, env=server.env)
    )
    assert "422" in line and "run_id" in line

    preset = tmp_path / "run.json"
    preset.write_text(json.dumps(_run_body()))
    made = cli(
        "runs", "create", str(preset), "grpo.beta=-1", *_api(server), cwd=tmp_path, env=server.env
    )
    line = _one_line_error(made)
    assert "422" in line and "body.grpo.beta" in line

    bad_key = ["--api-url", server.url, "--api-key", "ty_not-a-key"]
    line = _one_line_error(cli("runs", "list", *bad_key, cwd=tmp_path, env=server.env))
    assert "401" in line and "keys create" in line

    nowhere = ["--api-url", f"http://127.0.0.1:{free_port()}", "--api-key", server.key]
    line = _one_line_error(cli("runs", "list", *nowhere, cwd=tmp_path, env=server.env))
    assert "cannot reach the API" in line and "trainyard up" in line

    # No key at all used to be `Illegal header value b'Bearer '`.
    line = _one_line_error(
        cli("runs", "list", "--api-url", server.url, cwd=tmp_path, env=server.env)
    )
    assert "no API key" in line

    line = _one_line_error(
        cli("runs", "create", str(preset), "grpo", cwd=tmp_path, env=server.env), 2
    )
    assert "key.path=value" in line


@pytest.mark.slow
def test_runs_list_prints_whole_ids_and_every_command_has_json(
    server: Server, tmp_path: Path
) -> None:
    # A model name far past 80 columns, and no terminal: nothing may be cut.
    long_name = "org/" + "m" * 120
    preset = tmp_path / "run.json"
    preset.write_text(json.dumps(_run_body(model_name=long_name)))
    created = cli("runs", "create", str(preset), *_api(server), cwd=tmp_path, env=server.env)
    assert created.returncode == 0, created.stderr
    run_id = created.stdout.strip()
    uuid.UUID(run_id)

    listed = cli("runs", "list", *_api(server), cwd=tmp_path, env=server.env)
    assert listed.returncode == 0, listed.stderr
    row = next(line for line in listed.stdout.splitlines() if line.startswith(run_id))
    assert row.split()[:2] == [run_id, "pending"] and long_name in row.split()

    page = json.loads(
        cli("runs", "list", "--json", *_api(server), cwd=tmp_path, env=server.env).stdout
    )
    assert run_id in [r["id"] for r in page["data"]] and "has_more" in page
    got = json.loads(
        cli("runs", "get", run_id, "--json", *_api(server), cwd=tmp_path, env=server.env).stdout
    )
    assert got["id"] == run_id and got["model_name"] == long_name
    human = cli("runs", "get", run_id, *_api(server), cwd=tmp_path, env=server.env)
    assert f"id: {run_id}" in human.stdout.splitlines()
    again = cli(
        "runs", "create", str(preset), "--json", *_api(server), cwd=tmp_path, env=server.env
    )
    assert json.loads(again.stdout)["status"] == "pending"
    cancelled = cli("runs", "cancel", run_id, "--json", *_api(server), cwd=tmp_path, env=server.env)
    assert json.loads(cancelled.stdout)["id"] == run_id
    cli(
        "runs",
        "cancel",
        json.loads(again.stdout)["id"],
        *_api(server),
        cwd=tmp_path,
        env=server.env,
    )
    key = cli("keys", "create", "--project", "json", "--json", cwd=tmp_path, env=server.env)
    assert json.loads(key.stdout)["key"].startswith("ty_")


@pytest.mark.slow
def test_relative_model_paths_are_sent_absolute(server: Server, tmp_path: Path) -> None:
    # A checkout: letters.yaml names the tiny model relative to the checkout.
    checkout = tmp_path / "checkout"
    (checkout / "configs" / "runs").mkdir(parents=True)
    preset = checkout / "configs" / "runs" / "letters.yaml"
    preset.write_text((ROOT / "configs" / "runs" / "letters.yaml").read_text())
    teacher = checkout / "configs" / "runs" / "teacher-letters.yaml"
    teacher.write_text((ROOT / "configs" / "runs" / "teacher-letters.yaml").read_text())
    model = checkout / ".trainyard" / "models" / "tiny-llama"
    model.mkdir(parents=True)
    # ... and a preset that names a model next to itself.
    (tmp_path / "presets").mkdir()
    (tmp_path / "models" / "m").mkdir(parents=True)
    beside = tmp_path / "presets" / "run.yaml"
    beside.write_text(json.dumps(_run_body(model_name="../models/m")))

    def created(cwd: Path, *args: str) -> dict[str, Any]:
        done = cli("runs", "create", *args, "--json", *_api(server), cwd=cwd, env=server.env)
        assert done.returncode == 0, done.stderr
        run: dict[str, Any] = json.loads(done.stdout)
        cli("runs", "cancel", run["id"], *_api(server), cwd=cwd, env=server.env)
        return run

    def sent(cwd: Path, *args: str) -> str:
        return str(created(cwd, *args)["model_name"])

    assert sent(checkout, "configs/runs/letters.yaml") == str(model)
    # A teacher run's student is a model the worker loads too.
    run = created(checkout, "configs/runs/teacher-letters.yaml")
    assert (run["model_name"], run["teacher"]["student_model"]) == (str(model), str(model))
    assert sent(tmp_path, str(beside)) == str(tmp_path / "models" / "m")
    # An override is typed in the current folder, so it is read from there.
    assert sent(tmp_path / "presets", "run.yaml", "model_name=../models/m") == str(
        tmp_path / "models" / "m"
    )
    # A hub id stays one.
    assert sent(tmp_path, str(beside), "model_name=Qwen/Qwen2.5-0.5B") == "Qwen/Qwen2.5-0.5B"

    # From another folder letters.yaml's path names nothing: said before anything is sent.
    line = _one_line_error(
        cli("runs", "create", str(preset), *_api(server), cwd=tmp_path, env=server.env)
    )
    assert "'.trainyard/models/tiny-llama'" in line and "tiny-model" in line
    line = _one_line_error(
        cli(
            "runs",
            "create",
            str(teacher),
            f"model_name={model}",
            *_api(server),
            cwd=tmp_path,
            env=server.env,
        )
    )
    assert line.startswith("error: teacher.student_model '.trainyard/models/tiny-llama'"), line


@pytest.mark.slow
def test_tiny_model_prints_the_absolute_path_a_run_can_name(tmp_path: Path) -> None:
    done = cli("tiny-model", cwd=tmp_path, env=user_env(tmp_path / "user"))
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert path == tmp_path / ".trainyard" / "models" / "tiny-llama"
    assert (path / "config.json").is_file()


@pytest.mark.slow
def test_tiny_model_builds_a_wider_deeper_one_on_request(tmp_path: Path) -> None:
    """The benchmark of asynchronous rollouts trains a larger tiny model (bench/scaling.py
    async --width 256 --layers 4); a width the heads cannot divide is refused."""
    env = user_env(tmp_path / "user")
    done = cli("tiny-model", "wide", "--width", "256", "--layers", "4", cwd=tmp_path, env=env)
    assert done.returncode == 0, done.stderr
    config = json.loads((Path(done.stdout.strip()) / "config.json").read_text())
    assert (config["hidden_size"], config["num_hidden_layers"]) == (256, 4)
    assert (config["num_attention_heads"], config["intermediate_size"]) == (8, 512)
    refused = cli("tiny-model", "odd", "--width", "100", cwd=tmp_path, env=env)
    assert refused.returncode != 0 and "--width" in refused.stderr, refused.stderr


@pytest.mark.slow
def test_the_readme_curl_example_is_a_run_the_api_accepts(server: Server, tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    shell = readme[readme.index("curl -s -X POST localhost:8000/runs") :]
    body = shell[shell.index("-d '") + 4 :]
    body = body[: body.index("}}'") + 2]
    model = tmp_path / "tiny-llama"  # what `trainyard tiny-model` prints: an absolute path
    sent = json.loads(body.replace("'\"$MODEL\"'", str(model)))
    answer = httpx.post(
        f"{server.url}/runs", json=sent, headers={"Authorization": f"Bearer {server.key}"}
    )
    assert answer.status_code == 202, answer.text
    assert answer.json()["model_name"] == str(model)
    httpx.post(
        f"{server.url}/runs/{answer.json()['id']}/cancel",
        headers={"Authorization": f"Bearer {server.key}"},
    )
