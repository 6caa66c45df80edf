"""Schemathesis against ``/openapi.json``: every operation with positive and negative data
and every check, then scenarios that follow the document's links.

The app is the real one with its lifespan (PostgreSQL, Redis), reached in-process through
Schemathesis' ASGI transport and authenticated with a real API key. No worker runs: the runs
the fuzzer creates stay pending, as they would behind a busy queue.

Reproducible and bounded: a fixed seed, derandomized generation, no example database, at
most MAX_EXAMPLES fuzzed cases per operation (plus the coverage phase's fixed set of
boundary and negative cases), STATEFUL_SCENARIOS scenarios of at most STATEFUL_STEPS steps.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import hypothesis
import pytest
import schemathesis
from fastapi import FastAPI
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, initialize
from schemathesis.generation.stateful.state_machine import StepInput
from schemathesis.python import asgi
from schemathesis.specs.openapi.checks import positive_data_acceptance
from starlette.types import Receive, Scope, Send

from app.core.errors import (
    INCONSISTENT,
    INVALID_CURSOR,
    KEY_REUSED,
    NOT_IN_CATALOG,
    UNKNOWN_REFERENCE,
    UNUSABLE_TARGET,
)
from app.core.openapi import install_openapi
from app.core.settings import Settings
from app.main import create_app
from tests.support.database import new_tenant, sessions_on
from tests.support.runs import run_body

pytestmark = pytest.mark.chaos

SEED = 20240513
MAX_EXAMPLES = 25
STATEFUL_SCENARIOS = 30
STATEFUL_STEPS = 8

CONFIG = schemathesis.Config.from_dict(
    {
        "seed": SEED,
        "suppress-health-check": ["all"],
        "generation": {
            "mode": "all",  # positive and negative
            "max-examples": MAX_EXAMPLES,
            "deterministic": True,
            "database": "none",
        },
        "checks": {
            "enabled": True,  # every check, not only the default set
            "negative_data_rejection": {
                # Schemathesis' list, and 413: a body over the size limit is refused too.
                "expected-statuses": [
                    *("400", "401", "403", "404", "405", "406", "409", "413", "415", "422"),
                    *("428", "429", "5xx"),
                ]
            },
        },
        "phases": {"stateful": {"max-steps": STATEFUL_STEPS}},
        "request-timeout": 10,
        # The event stream of a pending run never ends: its first event is enough, and a
        # second of silence (resuming after its last event) too.
        "max-stream-events": 1,
        "operations": [{"include-operation-id": "stream_run_events", "request-timeout": 1}],
    }
)


def _app(settings: Settings) -> FastAPI:
    app = create_app(settings)
    install_openapi(app, settings)  # idempotent: app.main may install it already
    return app


class DeferredApp:
    """The ASGI app Schemathesis calls, bound to a real app by the ``fuzz_app`` fixture once
    the session's database exists (collection comes first)."""

    def __init__(self) -> None:
        self.app: FastAPI | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        assert self.app is not None, "use the fuzz_app fixture"
        await self.app(scope, receive, send)


class ApiKey:
    """Schemathesis' auth provider: the test's tenant key, as a Bearer token. Being the
    schema's auth, it is left out where a negative case drops or mangles the header."""

    key: str | None = None

    def get(self, case: schemathesis.Case, ctx: schemathesis.AuthContext) -> str | None:
        return ApiKey.key

    def set(self, case: schemathesis.Case, data: str, ctx: schemathesis.AuthContext) -> None:
        case.headers = {**(case.headers or {}), "Authorization": f"Bearer {data}"}


# The document is built at import (collection needs its operations), which needs no
# database; test_the_fuzzed_document_is_served checks it is what GET /openapi.json answers.
DOCUMENT = _app(Settings()).openapi()
APP = DeferredApp()
schema = schemathesis.openapi.from_dict(DOCUMENT, config=CONFIG)
schema.app = APP
schema.auth(refresh_interval=None)(ApiKey)


def _jsonl_line() -> st.SearchStrategy[dict[str, Any]]:
    text = st.text(st.characters(exclude_categories=["Cs"], exclude_characters="\x00"), max_size=20)
    return st.fixed_dictionaries(
        {"input_text": text.filter(str.strip)},
        optional={
            "context": st.none() | st.dictionaries(text, st.integers() | text, max_size=3),
            "split": st.sampled_from(["train", "validation"]),
        },
    )


# A dataset upload's body is a JSONL file (its lines follow x-line-schema), which JSON Schema
# cannot describe: send real files, as clients do. Negative cases still break the multipart
# envelope and its fields; tests/api/test_datasets.py covers bad lines.
schemathesis.openapi.media_type(
    "application/x-ndjson",
    st.lists(_jsonl_line(), min_size=1, max_size=5).map(
        lambda lines: "".join(json.dumps(line) + "\n" for line in lines).encode()
    ),
)


def _unforeseeable(response: schemathesis.Response) -> bool:
    """Whether a 422 is one that no OpenAPI document can foresee, so schema-valid data may
    get it: every field it names is valid alone but not with another (an inverted range,
    exclusive options), is a cursor the server never handed out or an Idempotency-Key first
    used with another body, names a dataset the project does not have, is a webhook URL
    whose host does not resolve (or resolves to a private address), or names code, a host
    or a model the operator's catalog does not list."""
    if response.status_code != 422:
        return False
    problem = response.json()
    return all(
        error.get("type")
        in (
            INCONSISTENT,
            INVALID_CURSOR,
            KEY_REUSED,
            UNKNOWN_REFERENCE,
            UNUSABLE_TARGET,
            NOT_IN_CATALOG,
        )
        # A dataset the project has, but with only validation rows: nothing to train on.
        or (problem.get("title"), error.get("field")) == ("Unusable dataset", "body.dataset_id")
        for error in problem.get("errors") or [{}]
    )


def accepts_schema_valid_data(
    ctx: schemathesis.CheckContext, response: schemathesis.Response, case: schemathesis.Case
) -> bool | None:
    """positive_data_acceptance, but for the rejections of :func:`_unforeseeable`."""
    if _unforeseeable(response):
        return None
    return positive_data_acceptance(ctx, response, case)


CHECKS: dict[str, Any] = {
    "excluded_checks": [positive_data_acceptance],
    "additional_checks": [accepts_schema_valid_data],
}


# What a team's API runs under: the catalog code policy, with one entry of each kind.
CATALOG = {
    "mcp_servers": {"calc": {"command": ["python", "-m", "tests.support.mcp_server"]}},
    "imports": [{"prefix": "acme.rewards"}],
    "endpoints": {"judge": {"base_url": "http://judge.internal:8000/v1", "model": "j"}},
    "vllm_servers": {"fleet": {"urls": ["http://vllm.internal:8000"]}},
    "models": {"folders": ["/models"], "hub": ["tiny-llama", "Qwen/"]},
}


@pytest.fixture(scope="module")
def fuzz_app(
    service_urls: tuple[str, str], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[DeferredApp]:
    """The real app on the session's database, its lifespan run by Schemathesis' ASGI
    transport on an event loop of its own (the ``api`` fixture's pools belong to pytest's),
    under the ``catalog`` code policy, as a team's API is.

    Without the per-key request rate and the cap on active runs: a 429 that depends on how
    fast this machine sends, or on how many runs earlier cases created, would make the
    answers depend on more than the seed (tests/api cover both limits)."""
    catalog = tmp_path_factory.mktemp("fuzz") / "catalog.yaml"
    catalog.write_text(json.dumps(CATALOG))  # JSON is YAML
    APP.app = _app(
        Settings(
            rate_limit_per_second=0,
            max_active_runs_per_project=0,
            code_policy="catalog",
            catalog=catalog,
        )
    )
    yield APP
    asgi.shutdown_lifespans()
    APP.app = None


@pytest.fixture
async def tenant_key(service_urls: tuple[str, str]) -> AsyncIterator[str]:
    """A tenant on the session's database, the one ``fuzz_app`` serves (this folder's
    ``make_tenant`` is on a test's own database, for the tests with workers)."""
    async with sessions_on(service_urls[0], pool_size=1) as maker:
        tenant = await new_tenant(maker)
    ApiKey.key = tenant.key
    yield tenant.key
    ApiKey.key = None


def test_the_fuzzed_document_is_served(fuzz_app: DeferredApp) -> None:
    with asgi.get_client(fuzz_app) as client:
        response = client.get("/openapi.json")
    assert response.status_code == 200
    assert response.json() == DOCUMENT
    links = DOCUMENT["paths"]["/runs"]["post"]["responses"]["202"]["links"]
    assert links["GetRun"]["parameters"] == {"path.run_id": "$response.body#/id"}


@schema.parametrize()
def test_every_operation(case: schemathesis.Case, fuzz_app: DeferredApp, tenant_key: str) -> None:
    case.call_and_validate(**CHECKS)


def test_stateful_links(fuzz_app: DeferredApp, tenant_key: str) -> None:
    """Scenarios along the links: create a run, then read it, poll it with its ETag, pause,
    resume and cancel it, list what it has; upload a dataset, then read it and its rows."""
    seen: Counter[tuple[str, int]] = Counter()

    class Workflow(schema.as_state_machine()):  # type: ignore[misc]
        # Schemathesis starts scenarios only where it expects random data to succeed, and its
        # dependency inference takes create_run's optional dataset_id for a reference nothing
        # produces, so it never starts one there: each scenario starts with a real run.
        @initialize(target=Bundle("catch_all"))
        def create_a_run(self) -> Any:
            case = schema["/runs"]["POST"].Case(
                body=run_body(learning_key="fuzz"),
                headers={"Authorization": f"Bearer {tenant_key}"},
            )
            self.recorder.record_case(case=case)
            return self.step(StepInput.initial(case))

        def after_call(self, response: schemathesis.Response, case: schemathesis.Case) -> None:
            super().after_call(response, case)
            seen[case.operation.label, response.status_code] += 1

        def validate_response(
            self, response: schemathesis.Response, case: schemathesis.Case, **kwargs: Any
        ) -> None:
            kwargs.pop("additional_checks", None)
            case.validate_response(
                response,
                transport_kwargs=kwargs or None,
                recorder=self.recorder,
                **CHECKS,
            )

    Workflow.run(
        settings=hypothesis.settings(
            max_examples=STATEFUL_SCENARIOS,
            stateful_step_count=STATEFUL_STEPS,
            derandomize=True,
            database=None,
            deadline=None,
            suppress_health_check=list(hypothesis.HealthCheck),
        )
    )
    # A run-scoped operation answered 2xx only for a run a link named (a random id is a 404).
    followed = {
        (label, status)
        for label, status in seen
        if label.startswith("/runs/{run_id}", label.find(" ") + 1) and 200 <= status < 300
    }
    assert seen["POST /runs", 202] and followed, sorted(seen.items())
