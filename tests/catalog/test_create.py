"""The catalog code policy at create time: every field that names code, a command, a host or
a folder is refused unless the operator's catalog lists it (a 422 naming the field and what
the catalog offers), catalog entries are accepted by name, and GET /catalog shows names and
descriptions only. On the real app and database, under both policies."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from app.catalog.models import Catalog, CatalogError, load_catalog
from app.catalog.policy import CodePolicy
from app.core.settings import get_settings
from tests.support.database import Tenant, app_on, client_of
from tests.support.runs import run_body

MODELS = "/srv/models"
CATALOG = {
    "mcp_servers": {
        "calc": {
            "description": "Arithmetic tools",
            "command": ["python", "-m", "tests.support.mcp_server"],
            "env": {"SECRET_TOKEN": "never-shown"},
        },
        "search": {"description": "Web search", "url": "http://search.internal:8000/mcp"},
    },
    "imports": [{"prefix": "acme.rewards", "description": "The team's reward functions"}],
    "endpoints": {
        "big-judge": {
            "description": "A large judge",
            "base_url": "http://judge.internal:8000/v1",
            "model": "judge-32b",
            "api_key_env": "JUDGE_API_KEY",
        }
    },
    "vllm_servers": {
        "fleet": {"description": "Two servers", "urls": ["http://v0:8000", "http://v1:8000"]},
        "single": {"description": "One server", "urls": ["http://v2:8000"]},
        "placed": {
            "description": "Placed by Ray for each run",
            "ray": {"command": ["/opt/vllm/bin/vllm", "serve"], "max_servers": 2},
        },
    },
    "harnesses": {
        "sandbox": {"description": "The agents' harness", "url": "http://agents.internal:9000/e"}
    },
    "models": {"folders": [MODELS], "hub": ["Qwen/", "tiny-llama"]},
}


def write_catalog(folder: Path, catalog: dict[str, Any] = CATALOG) -> Path:
    path = folder / "catalog.yaml"
    path.write_text(yaml.safe_dump(catalog))
    return path


@pytest.fixture(scope="module")
async def catalog_client(
    service_urls: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[httpx.AsyncClient]:
    settings = get_settings().model_copy(
        update={
            "code_policy": "catalog",
            "catalog": write_catalog(tmp_path_factory.mktemp("catalog")),
        }
    )
    async with app_on(settings) as application, client_of(application) as client:
        yield client


ENDPOINT = {"base_url": "http://169.254.169.254/v1", "model": "m"}
JUDGE_OF_THE_CATALOG = {"endpoint": "big-judge"}

REFUSED = [
    ({"model_name": "/home/other/final"}, "body.model_name", "no folder the catalog lists"),
    ({"model_name": f"{MODELS}/../etc"}, "body.model_name", "'..'"),
    ({"model_name": "./tiny-llama"}, "body.model_name", "neither an absolute path"),
    ({"model_name": "meta-llama/Llama-3"}, "body.model_name", "hub ids: Qwen/, tiny-llama"),
    (
        {"environment": {"type": "mcp", "command": ["sh", "-c", "id > owned.txt"]}},
        "body.environment.command",
        "it has: calc, search",
    ),
    (
        {"environment": {"type": "mcp", "url": "http://169.254.169.254/mcp"}},
        "body.environment.url",
        "never a url",
    ),
    (
        {"environment": {"type": "tools", "tools": ["add", "os:system"]}},
        "body.environment.tools[1]",
        "prefixes: acme.rewards",
    ),
    (
        {"environment": {"type": "python", "factory": "subprocess:Popen"}},
        "body.environment.factory",
        "neither a built-in",
    ),
    (
        {"reward": {"type": "function", "functions": [{"name": "builtins:eval"}]}},
        "body.reward.functions[0].name",
        "acme.rewards",
    ),
    (
        {"reward": {"type": "function", "functions": [{"name": "acme.rewardsevil:f"}]}},
        "body.reward.functions[0].name",
        "acme.rewards",
    ),
    (
        {
            "grpo": {
                "eval_metrics": [
                    {"name": "char_fraction", "args": {"char": "a"}},
                    {"name": "os:system"},
                ]
            }
        },
        "body.grpo.eval_metrics[1].name",
        "acme.rewards",
    ),
    ({"reward": {"type": "ruler", "judge": ENDPOINT}}, "body.reward.judge.base_url", "big-judge"),
    (
        {"reward": {"type": "rim", "small_model": JUDGE_OF_THE_CATALOG, "large_model": ENDPOINT}},
        "body.reward.large_model.base_url",
        "never a base_url",
    ),
    ({"generator": ENDPOINT}, "body.generator.base_url", "big-judge"),
    (
        {"teacher": {"student_endpoint": ENDPOINT}},
        "body.teacher.student_endpoint.base_url",
        "big-judge",
    ),
    (
        {"teacher": {"student_model": "/var/lib/other-project/final"}},
        "body.teacher.student_model",
        MODELS,
    ),
    (
        {"grpo": {"engine": "vllm-server", "vllm_server_url": "http://169.254.169.254"}},
        "body.grpo.vllm_server_url",
        "fleet, placed, single",
    ),
    (
        {"environment": {"type": "gateway", "harness_url": "http://169.254.169.254/"}},
        "body.environment.harness_url",
        "sandbox",
    ),
    # Names must exist, whatever the policy.
    (
        {"environment": {"type": "gateway", "harness": "elsewhere"}},
        "body.environment.harness",
        "no harness 'elsewhere'",
    ),
    (
        {"environment": {"type": "mcp", "server": "browser"}},
        "body.environment.server",
        "no MCP server 'browser'",
    ),
    ({"generator": {"endpoint": "gpt-9"}}, "body.generator.endpoint", "no endpoint 'gpt-9'"),
    (
        {"grpo": {"engine": "vllm-server", "vllm_servers": "elsewhere"}},
        "body.grpo.vllm_servers",
        "no vLLM servers 'elsewhere'",
    ),
    # Several servers need a LoRA run: a full fine-tune syncs into one.
    (
        {"grpo": {"engine": "vllm-server", "vllm_servers": "fleet"}},
        "body.grpo.vllm_servers",
        "train a LoRA adapter",
    ),
    # Servers Ray places load the run's adapter: LoRA runs only, and no more than offered.
    (
        {"grpo": {"engine": "vllm-server", "vllm_servers": "placed"}},
        "body.grpo.vllm_servers",
        "which Trainyard does not place",
    ),
    (
        {
            "grpo": {
                "engine": "vllm-server",
                "vllm_servers": "placed",
                "num_vllm_servers": 3,
                "lora": {},
            }
        },
        "body.grpo.num_vllm_servers",
        "'placed' places at most 2 server(s) per run",
    ),
    (
        {"grpo": {"engine": "vllm-server", "vllm_servers": "single", "num_vllm_servers": 1}},
        "body.grpo.num_vllm_servers",
        "num_vllm_servers is for a fleet Ray places",
    ),
]


@pytest.mark.parametrize(("overrides", "field", "says"), REFUSED)
async def test_what_the_catalog_does_not_list_is_refused_naming_the_field(
    catalog_client: httpx.AsyncClient,
    tenant: Tenant,
    overrides: dict[str, Any],
    field: str,
    says: str,
) -> None:
    r = await catalog_client.post("/runs", json=run_body(**overrides), headers=tenant.headers)
    assert r.status_code == 422, r.text
    assert r.headers["content-type"] == "application/problem+json"
    [error] = r.json()["errors"]
    assert error["field"] == field, error
    assert error["type"] == "not_in_catalog", error
    assert says in error["message"], error
    listed = await catalog_client.get("/runs", headers=tenant.headers)
    assert listed.json()["data"] == []  # nothing was written


ACCEPTED = [
    {"model_name": f"{MODELS}/qwen-0.5b"},
    {"model_name": "Qwen/Qwen2.5-0.5B-Instruct"},
    {"model_name": "tiny-llama"},
    {"environment": {"type": "mcp", "server": "calc", "tools": ["add"]}},
    {"environment": {"type": "tools", "tools": ["add", "acme.rewards.tools:lookup"]}},
    {"environment": {"type": "python", "factory": "calculator"}},
    {"reward": {"type": "function", "functions": [{"name": "acme.rewards:exact"}]}},
    {"reward": {"type": "ruler", "judge": JUDGE_OF_THE_CATALOG}},
    {"reward": {"type": "rim", "small_model": JUDGE_OF_THE_CATALOG}},
    {"generator": {"endpoint": "big-judge", "timeout_s": 5}},
    {"teacher": {"student_endpoint": JUDGE_OF_THE_CATALOG}},
    {"teacher": {"student_model": f"{MODELS}/student"}},
    {"grpo": {"engine": "vllm-server", "vllm_servers": "single"}},
    {"grpo": {"engine": "vllm-server", "vllm_servers": "fleet", "lora": {}}},
    {"grpo": {"engine": "vllm-server", "vllm_servers": "placed", "lora": {}}},
    {
        "grpo": {
            "engine": "vllm-server",
            "vllm_servers": "placed",
            "num_vllm_servers": 2,
            "lora": {"r": 24},
        }
    },
    {"environment": {"type": "gateway"}},  # pull mode names nothing
    {"environment": {"type": "gateway", "harness": "sandbox"}},
]


@pytest.mark.parametrize("overrides", ACCEPTED)
async def test_catalog_entries_and_built_ins_are_accepted_by_name(
    catalog_client: httpx.AsyncClient, tenant: Tenant, overrides: dict[str, Any]
) -> None:
    r = await catalog_client.post("/runs", json=run_body(**overrides), headers=tenant.headers)
    assert r.status_code == 202, r.text
    run = r.json()
    # The run keeps the names; what they stand for is never served.
    assert "judge.internal" not in r.text
    assert "never-shown" not in r.text
    if "environment" in overrides and overrides["environment"]["type"] == "mcp":
        assert run["environment"]["server"] == "calc"
        assert run["environment"]["command"] is None


async def test_the_open_policy_still_takes_anything_but_unknown_names(
    client: httpx.AsyncClient, tenant: Tenant
) -> None:
    """The suite's app runs under `open` (tests/conftest.py) with no catalog: what worked
    before still does, and a catalog name that does not exist is still a 422."""
    for overrides in (
        {"environment": {"type": "mcp", "command": ["python", "-m", "srv"]}},
        {"reward": {"type": "ruler", "judge": ENDPOINT}},
        {"model_name": "./anywhere"},
        {"reward": {"type": "function", "functions": [{"name": "my_pkg.rewards:f"}]}},
    ):
        r = await client.post("/runs", json=run_body(**overrides), headers=tenant.headers)
        assert r.status_code == 202, (overrides, r.text)
    r = await client.post(
        "/runs", json=run_body(generator={"endpoint": "big-judge"}), headers=tenant.headers
    )
    assert r.status_code == 422
    assert (
        r.json()["errors"][0]["message"] == "no endpoint 'big-judge' in the catalog (it has: none)"
    )


async def test_get_catalog_shows_names_and_descriptions_never_commands_or_secrets(
    catalog_client: httpx.AsyncClient, tenant: Tenant
) -> None:
    r = await catalog_client.get("/catalog", headers=tenant.headers)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["policy"] == "catalog"
    assert body["mcp_servers"] == [
        {"name": "calc", "description": "Arithmetic tools", "transport": "stdio"},
        {"name": "search", "description": "Web search", "transport": "http"},
    ]
    assert body["endpoints"] == [
        {"name": "big-judge", "description": "A large judge", "model": "judge-32b"}
    ]
    assert body["vllm_servers"][0] == {
        "name": "fleet",
        "description": "Two servers",
        "servers": 2,
        "placed_by_ray": False,
    }
    assert body["vllm_servers"][1] == {
        "name": "placed",
        "description": "Placed by Ray for each run",
        "servers": 2,
        "placed_by_ray": True,
    }
    assert body["imports"] == [
        {"prefix": "acme.rewards", "description": "The team's reward functions"}
    ]
    assert body["models"] == {"folders": [MODELS], "hub": ["Qwen/", "tiny-llama"]}
    for secret in (
        "tests.support.mcp_server",
        "never-shown",
        "SECRET_TOKEN",
        "judge.internal",
        "JUDGE_API_KEY",
        "search.internal",
        "http://v0",
    ):
        assert secret not in r.text
    assert (await catalog_client.get("/catalog")).status_code == 401


def test_a_bad_catalog_stops_the_start_naming_where(tmp_path: Path) -> None:
    bad = write_catalog(
        tmp_path,
        {
            "mcp_servers": {
                "x": {"command": ["a"], "url": "http://h"},
                "neither": {"description": "no way to start it"},
            },
            "vllm_servers": {
                "both": {"urls": ["http://v:8000"], "ray": {"command": ["vllm", "serve"]}},
                "placed": {"ray": {"command": ["vllm", "serve"], "max_servers": 0}},
            },
            "models": {"folders": ["relative/models"]},
            "endpoint": {},
        },
    )
    with pytest.raises(CatalogError) as caught:
        load_catalog(bad)
    said = str(caught.value)
    assert "mcp_servers.x: Value error, give exactly one of command and url" in said
    assert "mcp_servers.neither: Value error, give exactly one of command and url" in said
    assert "vllm_servers.both: Value error, give exactly one of urls and ray" in said
    assert "vllm_servers.placed.ray.max_servers: Input should be greater" in said
    assert "models.folders: Value error, relative/models is not an absolute path" in said
    assert "endpoint: Extra inputs are not permitted" in said
    with pytest.raises(CatalogError, match="cannot be read"):
        load_catalog(tmp_path / "missing.yaml")


def test_a_start_without_models_under_catalog_says_every_run_will_be_refused() -> None:
    said = CodePolicy("catalog", Catalog()).summary()
    assert said.startswith("code policy catalog; catalog (none): MCP servers 0")
    assert said.endswith("every run will be refused until one is listed)")
    listed = CodePolicy("catalog", Catalog.model_validate({"models": {"hub": ["Qwen/"]}}))
    assert not listed.refuses_every_run and "refused" not in listed.summary()
    assert not CodePolicy("open", Catalog()).refuses_every_run


def test_a_push_harness_of_the_catalog_is_its_url_on_the_worker() -> None:
    policy = CodePolicy("catalog", Catalog.model_validate(CATALOG))
    spec = {"environment": {"type": "gateway", "harness": "sandbox", "max_calls": 4}}
    assert policy.refusals(spec) == []
    assert policy.resolve(spec)["environment"] == {
        "type": "gateway",
        "harness": None,
        "harness_url": "http://agents.internal:9000/e",
        "max_calls": 4,
    }


def test_vllm_servers_ray_places_resolve_into_the_urls_the_worker_placed() -> None:
    policy = CodePolicy("catalog", Catalog.model_validate(CATALOG))
    spec = {"grpo": {"engine": "vllm-server", "vllm_servers": "placed", "num_vllm_servers": 2}}
    fleet = policy.placed_vllm("placed")
    assert fleet is not None and fleet.command == ["/opt/vllm/bin/vllm", "serve"]
    assert policy.placed_vllm("single") is None and policy.placed_vllm(None) is None
    assert policy.resolve(spec) == {}  # not started yet: the name stays
    urls = ["http://10.0.0.5:41000", "http://10.0.0.6:41000"]
    assert policy.resolve(spec, placed=urls)["grpo"] == {
        "engine": "vllm-server",
        "vllm_servers": None,
        "num_vllm_servers": None,
        "vllm_server_url": urls,
    }
