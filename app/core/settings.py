"""Process settings, read from ``TRAINYARD_*`` environment variables.

Every field carries a description (tests/test_configs.py holds every field to it): this
class is the reference, and the README's settings table says the same in short.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from fastapi import Request
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="TRAINYARD_", extra="ignore")

    database_url: str | None = Field(
        default=None,
        description="SQLAlchemy URL (postgresql+asyncpg://...). Unset: embedded PostgreSQL "
        "under <home>/pg.",
    )
    redis_url: str | None = Field(
        default=None,
        description="Celery broker URL. Unset: embedded Redis under <home>/redis.",
    )
    broker_prefix: str = Field(
        default="",
        max_length=100,
        description="Prefix for every Redis key Celery uses, so several Trainyard "
        "installations (or test sessions) can share one Redis.",
    )
    home: Path = Field(
        default=Path(".trainyard"),
        description="Folder for embedded services and local artefacts (checkpoints).",
    )
    artifacts_dir: Path | None = Field(
        default=None,
        description="Where workers write checkpoints and final models (shared storage on a "
        "fleet, so any worker can resume any run). Unset: <home>/artifacts.",
    )
    db_pool_size: int = Field(
        default=10,
        ge=1,
        description="Size of each of an API process's two PostgreSQL pools: the SQLAlchemy "
        "engine (the ORM queries) and the asyncpg pool (key lookups, POST /runs, GET "
        "/runs/{id} and the lists and streams written in SQL) each hold up to this many "
        "connections, so one API process opens up to twice it. A request that finds its pool "
        "empty waits, then gets a 503. Workers have pools of their own (4 + 2 connections "
        "per worker process).",
    )
    max_body_bytes: int = Field(
        default=2 * 1024 * 1024, ge=1024, description="Largest request body accepted (413 above)."
    )
    max_page_size: int = Field(default=200, ge=1, description="Cap on ?limit= for every list.")
    default_page_size: int = Field(
        default=50, ge=1, description="Page size of a list when ?limit= is not given."
    )
    lease_ttl_seconds: float = Field(
        default=30.0, gt=0, description="How long a worker holds a run without heartbeating."
    )
    heartbeat_seconds: float = Field(
        default=5.0, gt=0, description="How often a worker renews its lease and reads cancel."
    )
    reaper_interval_seconds: float = Field(
        default=5.0, gt=0, description="How often each worker sweeps expired leases and outbox."
    )
    max_attempts: int = Field(
        default=3,
        ge=1,
        description="Failures of one run (a lease that ran out, a crash) before it is failed "
        "as a poison run; pauses, resumes and handovers do not count.",
    )
    redispatch_seconds: float = Field(
        default=30.0,
        gt=0,
        description="An unheld live run whose task was published this long ago is published "
        "again (covers a lost message, a flushed broker, a crash between commit and publish).",
    )
    broker_visibility_timeout_seconds: float = Field(
        default=3600.0,
        gt=0,
        description="Redis gives an unacknowledged task to another worker after this long. "
        "Far above a heartbeat, so only a lost worker's task comes back; a task redelivered "
        "while its run is still leased is refused by the lease.",
    )
    pipeline: str = Field(
        default="workers.pipeline:run_pipeline",
        description="The coroutine function (module:name) a worker runs for each claimed run.",
    )
    sse_gather_seconds: float = Field(
        default=0.1,
        ge=0,
        le=1,
        description="A live stream's events are gathered this long after a commit notifies "
        "them, then read once and sent to every stream of the run in one write each.",
    )
    sse_buffer_events: int = Field(
        default=2000,
        gt=0,
        description="Events an SSE stream may fall behind its run before it is closed with a "
        "retry hint (its client resumes from Last-Event-ID); a slow client never slows others.",
    )
    sse_keepalive_seconds: float = Field(
        default=15.0,
        gt=0,
        description="An idle SSE stream sends a comment after this long without a message "
        "(within a quarter more), so proxies keep it open.",
    )
    public_url: str | None = Field(
        default=None,
        description="The API's base URL as harnesses reach it (http://trainyard.internal:8000): "
        "a gateway run in push mode hands each episode's OpenAI base URL under it to its "
        "harness. Workers need it for push mode only; `trainyard up` sets it.",
    )
    judge_base_url: str | None = Field(
        default=None,
        description="The workers' default LLM judge (an OpenAI-compatible endpoint such as "
        "http://host:8000/v1), used by RULER runs that name no judge of their own.",
    )
    judge_model: str | None = Field(
        default=None, description="The default judge's model name (with judge_base_url)."
    )
    judge_api_key_env: str | None = Field(
        default=None,
        description="Name of the environment variable holding the default judge's API key "
        "(the name, not the key, so the key never shows in settings dumps).",
    )
    max_dataset_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="Largest JSONL file POST /datasets accepts (413 above); that route alone "
        "may exceed max_body_bytes.",
    )
    rate_limit_per_second: float = Field(
        default=100.0,
        ge=0,
        description="Requests per second each API key may make on average, counted across "
        "every API process in Redis; above it the answer is 429 with Retry-After. 0 turns "
        "the limit off. If Redis cannot be reached, requests are let through.",
    )
    rate_limit_burst: int = Field(
        default=200,
        ge=1,
        description="Requests a key may make at once before rate_limit_per_second applies "
        "(a key idle for burst / rate seconds has its whole burst again).",
    )
    max_active_runs_per_project: int = Field(
        default=100,
        ge=0,
        description="Most runs one project may have that are not finished (pending, "
        "working or paused; a run being cancelled no longer counts); POST /runs beyond it "
        "is a 429. 0: no limit.",
    )
    # Observability (docs/observability.md)
    log_format: Literal["auto", "json", "text"] = Field(
        default="auto",
        description="How the API and workers log: JSON lines (time, level, logger, message, "
        "run_id, request_id, project_id, ...) for a log collector, or plain text for a "
        "person. auto: text when stderr is a terminal, JSON otherwise.",
    )
    metrics_enabled: bool = Field(
        default=True, description="Serve Prometheus metrics (GET /metrics on the API)."
    )
    opentelemetry: bool = Field(
        default=False,
        description="FastAPI's native OpenTelemetry: a span, metrics and logs for each API "
        "request through the globally configured providers (opentelemetry-instrument, "
        "FASTAPI_OTEL_AUTO_CONFIGURE). Off: no request looks for a provider (3 µs each).",
    )
    metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="Serve the API's /metrics on this port of its own instead of the API's.",
    )
    metrics_host: str = Field(
        default="127.0.0.1",
        max_length=255,
        description="The address metrics_port and worker_metrics_port bind to: loopback "
        "unless told otherwise (0.0.0.0 for a Prometheus on another host; set metrics_token "
        "then).",
    )
    metrics_token: str | None = Field(
        default=None,
        description="A bearer token /metrics then requires (401 without it); unset: open.",
    )
    worker_metrics_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="A worker serves its Prometheus metrics on this port; unset: it does not.",
    )
    # Ray (docs/scaling.md)
    ray_address: str | None = Field(
        default=None,
        description="The Ray cluster that runs with grpo.distributed.launcher 'ray' are "
        "placed on: the GCS address (host:6379, or 'auto') where the worker is a node of the "
        "cluster, or a Ray Client address (ray://host:10001). Unset: such runs fail at their "
        "start.",
    )
    ray_placement_timeout_seconds: float = Field(
        default=300.0,
        gt=0,
        description="How long a run's ranks may wait for the Ray cluster to place them "
        "before the attempt ends with what was asked and what the cluster has.",
    )
    # What runs may name (docs/security.md)
    code_policy: Literal["open", "catalog"] | None = Field(
        default=None,
        description="What a run may name for the workers to run or reach: 'open', any import "
        "path, command, URL or model folder (one person's laptop); 'catalog', only what the "
        "operator's catalog lists. Unset: 'open' under `trainyard up` and `trainyard demo`, "
        "'catalog' everywhere else (`trainyard api`, `trainyard worker`, the images).",
    )
    catalog: Path | None = Field(
        default=None,
        description="The operator's catalog (YAML): MCP servers, import-path prefixes, "
        "endpoints, vLLM server fleets and model folders that runs may name. Read by the API "
        "and the workers at start. Unset: an empty catalog (built-ins only).",
    )
    # Webhooks (docs/webhooks.md)
    webhooks_allow_private: bool = Field(
        default=False,
        description="Allow webhook URLs on loopback, private and link-local addresses "
        "(refused by default: a project must not reach the service's own network).",
    )
    webhook_timeout_seconds: float = Field(
        default=10.0, gt=0, le=300, description="How long one webhook delivery may take."
    )
    webhook_retry_hours: float = Field(
        default=24.0,
        gt=0,
        le=24 * 14,
        description="How long a failing delivery is retried (exponential backoff with "
        "jitter) before it is given up.",
    )

    @property
    def policy(self) -> Literal["open", "catalog"]:
        """The code policy in force: the setting, or 'catalog' (``trainyard up`` and
        ``trainyard demo`` set 'open' for the processes they start)."""
        return self.code_policy or "catalog"

    @property
    def artifacts(self) -> Path:
        return (self.artifacts_dir or self.home / "artifacts").resolve()


@lru_cache
def get_settings() -> Settings:
    return Settings()


def app_settings(request: Request) -> Settings:
    """The settings the running app was created with (tests and embedders pass their own)."""
    settings: Settings = request.app.state.settings
    return settings
