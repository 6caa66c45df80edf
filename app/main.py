"""The FastAPI application. No ML library is imported anywhere under ``app/``."""

from __future__ import annotations

import gc
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI

from app.auth.router import router as auth_router
from app.auth.service import KeyCache
from app.catalog.policy import CodePolicy
from app.catalog.router import router as catalog_router
from app.checkpoints.router import router as checkpoints_router
from app.core.db import make_engine, make_sessionmaker
from app.core.errors import install_error_handlers, problem_responses
from app.core.limits import BodySizeLimit
from app.core.logs import RequestBatch, RequestLog
from app.core.openapi import install_openapi
from app.core.pg import create_pool
from app.core.ratelimit import RateLimiter, RateLimitHeaders
from app.core.services import database_url, redis_url
from app.core.settings import Settings, get_settings
from app.datasets.router import router as datasets_router
from app.datasets.upload import MULTIPART_ENVELOPE_BYTES
from app.events.conditional import Answered, NotModified
from app.events.fanout import EventHub
from app.events.router import router as events_router
from app.gateway.hub import GatewayHub
from app.gateway.openai_api import router as gateway_openai_router
from app.gateway.router import router as gateway_router
from app.gateway.service import Claims
from app.health import broker_client
from app.health import router as health_router
from app.inputs.router import router as inputs_router
from app.metrics.router import router as metrics_router
from app.observability import prometheus
from app.runs.lifecycle.dispatch import DueBell
from app.runs.router import router as runs_router
from app.trajectories.router import router as trajectories_router
from app.ui.router import router as ui_router
from app.ui.router import static_files as ui_static
from app.webhooks.router import router as webhooks_router

log = logging.getLogger(__name__)

try:
    VERSION = version("trainyard")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    VERSION = "0.0.0"


# The garbage collector's thresholds while the API serves. A request allocates a few thousand
# objects and frees nearly all of them by reference counting, but with the default young
# threshold (700) the requests in flight at any moment were enough to start a collection
# every few requests: 35 µs of CPU per create, against 6 µs with these (docs/benchmarks.md,
# "The request path against 224089f"). What cyclic garbage a request leaves waits a little
# longer to be freed, and full passes are much rarer.
GC_THRESHOLDS = (10_000, 20, 100)


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        url = database_url(settings)
        app.state.settings = settings
        app.state.policy = CodePolicy.from_settings(settings)  # a bad catalog stops the start
        policy = app.state.policy
        (log.warning if policy.refuses_every_run else log.info)("%s", policy.summary())
        engine = make_engine(url, pool_size=settings.db_pool_size)
        app.state.pg = await create_pool(url, size=settings.db_pool_size)
        app.state.engine = engine
        app.state.sessionmaker = make_sessionmaker(engine)
        app.state.read_sessionmaker = make_sessionmaker(
            engine.execution_options(isolation_level="AUTOCOMMIT")
        )
        app.state.key_cache = KeyCache()
        app.state.event_hub = EventHub(
            url,
            app.state.pg,
            buffer=settings.sse_buffer_events,
            keepalive_seconds=settings.sse_keepalive_seconds,
            gather_seconds=settings.sse_gather_seconds,
        )
        app.state.event_hub.start()
        app.state.due_bell = DueBell(app.state.pg)
        app.state.due_bell.start()
        broker = redis_url(settings)
        app.state.redis = broker_client(broker)  # for /readyz
        app.state.gateway = GatewayHub(broker, settings.broker_prefix)
        app.state.claims = Claims()
        app.state.rate_limiter = (
            RateLimiter(
                broker,
                rate=settings.rate_limit_per_second,
                burst=settings.rate_limit_burst,
                prefix=settings.broker_prefix,
            )
            if settings.rate_limit_per_second > 0
            else None
        )
        metrics_server = (
            prometheus.serve(settings.metrics_port, settings.metrics_token, settings.metrics_host)
            if settings.metrics_enabled and settings.metrics_port is not None
            else None
        )
        # Everything built so far lives as long as the process: keep it out of the garbage
        # collector's full passes, which otherwise show up as latency spikes.
        gc.collect()
        gc.freeze()
        thresholds = gc.get_threshold()
        gc.set_threshold(*GC_THRESHOLDS)
        try:
            yield
        finally:
            gc.set_threshold(*thresholds)
            if metrics_server is not None:
                metrics_server.shutdown()
                metrics_server.server_close()
            prometheus.process_exited()  # its in-flight gauge no longer counts
            await app.state.event_hub.close()
            if app.state.rate_limiter is not None:
                await app.state.rate_limiter.aclose()
            await app.state.redis.aclose()
            await app.state.gateway.aclose()
            await app.state.due_bell.aclose()
            await app.state.pg.close()
            await engine.dispose()

    app = FastAPI(
        title="Trainyard",
        version=VERSION,
        summary="Run and track reinforcement-learning fine-tuning of LLM agents.",
        lifespan=lifespan,
        # Unless asked for, no request looks for OpenTelemetry providers that are not there.
        telemetry={
            "tracing": settings.opentelemetry,
            "metrics": settings.opentelemetry,
            "logs": settings.opentelemetry,
        },
    )
    install_error_handlers(app)
    # Routes are matched in the order they are included (each router's, one after another):
    # the hottest first, a harness's model calls, then runs (a GET of a run ~5% faster).
    app.include_router(gateway_openai_router)  # OpenAI's routes, OpenAI's errors
    app.include_router(runs_router, responses=problem_responses(429))
    app.include_router(health_router)
    app.include_router(ui_router)  # the dashboard: no key to load it, none in /openapi.json
    app.mount("/ui/static", ui_static, name="ui-static")
    # Every other route needs a key, and any keyed request may be rate-limited.
    for router in (
        auth_router,
        events_router,
        metrics_router,
        checkpoints_router,
        inputs_router,
        trajectories_router,
        datasets_router,
        webhooks_router,
        catalog_router,
        gateway_router,
    ):
        app.include_router(router, responses=problem_responses(429))
    # Access lines and request metrics are handled a batch at a time (app/core/logs.py).
    requests = RequestBatch(prometheus.RequestMetrics() if settings.metrics_enabled else None)
    if settings.metrics_enabled and settings.metrics_port is None:
        app.include_router(prometheus.metrics_router(settings.metrics_token, requests.flush))
    install_openapi(app, settings)  # links, exact parameters, the page size cap
    # Innermost: a poller's 304 from what the event hub knows, before routing.
    app.state.answered = Answered()
    app.add_middleware(NotModified, answered=app.state.answered)
    if settings.rate_limit_per_second > 0:
        app.add_middleware(RateLimitHeaders)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_body_bytes,
        # Uploads stream past the JSON limit; the route counts the file against its own.
        routes={
            ("POST", "/datasets"): max(
                settings.max_body_bytes, settings.max_dataset_bytes + MULTIPART_ENVELOPE_BYTES
            )
        },
    )
    # Outermost: every request gets its id, its access line and its metrics (the limits'
    # answers included), from one layer.
    app.add_middleware(RequestLog, batch=requests)

    return app
