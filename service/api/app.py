"""The FastAPI app factory. Lifespan: load the artifact (unless given), place the model, start the worker,
warm up, then report ready; on shutdown stop the worker. Loading happens in the background so /health and
/ready answer meanwhile."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from starlette.middleware.cors import CORSMiddleware

from service.api.middleware import (
    DOC_PATHS,
    PROBE_PATHS,
    ApiKeyMiddleware,
    AvailabilityMiddleware,
    PayloadLimitMiddleware,
    RequestContextMiddleware,
)
from service.api.routes import chat, embed, generate, meta, openai, tokenize
from service.api.state import ServiceState, package_version
from service.errors import install_error_handlers
from service.observability.tracing import Tracing, TracingMiddleware
from service.settings import Settings

# Every router, mounted when this module is imported (routes depend on service.api.state, never on this module).
ROUTERS: tuple[APIRouter, ...] = tuple(module.router for module in (generate, embed, openai, chat, meta, tokenize))

log = logging.getLogger("service.app")


def route_paths(app: FastAPI, routers: tuple[APIRouter, ...]) -> frozenset[str]:
    """Every path the app serves. The included routers' own route lists are read: this FastAPI keeps an
    included router as one lazily expanded entry of `app.routes`, which has no `path`, so `app.routes`
    alone names only the docs routes (and requests refused before routing were labelled "unmatched")."""
    routes = [*app.routes, *(route for router in routers for route in router.routes)]
    return frozenset(path for route in routes if (path := getattr(route, "path", None)))


def create_app(settings: Settings | None = None, artifact: Any = None, tracing: Tracing | None = None) -> FastAPI:
    """Build the app; `artifact` (an already loaded export.Artifact) skips loading in the lifespan; `tracing`
    (default: as the OTEL_* variables say, service/observability/tracing.py) makes OpenTelemetry spans of each
    request."""
    settings = settings or Settings()  # type: ignore[call-arg]  # values come from the environment
    tracing = tracing if tracing is not None else Tracing.from_environment()
    state = ServiceState(settings)

    async def boot() -> None:
        try:
            await asyncio.to_thread(state.load, artifact)
            assert state.engine is not None
            while not state.engine.ready.is_set() and state.engine.alive:
                await asyncio.to_thread(state.engine.ready.wait, 0.5)
            if state.ready:
                log.info("ready: serving %s on %s with %s", state.model_id, state.device, state.backend_name)
        except Exception as exc:
            state.load_error = str(exc)
            log.critical("loading the model failed: %s", exc, exc_info=exc)
            state.on_fatal(exc)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(boot())
        try:
            yield
        finally:
            state.draining = True
            task.cancel()
            if state.engine is not None:
                await asyncio.to_thread(state.engine.stop)
            state.tokenizing.shutdown()
            if state.grammars is not None:
                state.grammars.close()
            await asyncio.to_thread(tracing.shutdown)

    app = FastAPI(
        title="reformer-serve",
        version=package_version(),
        description="Text generation (TGI-style), embeddings (TEI-style) and OpenAI-compatible routes for a "
        "Reformer language model.",
        lifespan=lifespan,
    )
    app.state.service = state
    install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    known_paths = route_paths(app, ROUTERS)
    state.metrics.init_request_series(
        (route.path, [int(code) for code in route.responses if str(code).isdigit()])
        for router in ROUTERS for route in router.routes
        if isinstance(route, APIRoute) and route.path not in PROBE_PATHS | DOC_PATHS
    )
    # add_middleware wraps: the last added is the outermost.
    app.add_middleware(AvailabilityMiddleware, state=state)  # reserves a queue place once the body is in
    app.add_middleware(PayloadLimitMiddleware, max_bytes=settings.max_payload_bytes,
                       timeout_s=settings.body_timeout_s)  # reads the body first, under its deadline
    keys = settings.api_keys()
    if keys is not None:
        app.add_middleware(ApiKeyMiddleware, keys=keys.by_key, protect_probes=settings.api_key_on_probes)
    if settings.cors_origins:
        app.add_middleware(CORSMiddleware, allow_origins=settings.cors_origins, allow_methods=["GET", "POST"],
                           allow_headers=["authorization", "content-type", "x-request-id"])
    app.add_middleware(RequestContextMiddleware, metrics=state.metrics, inflight=state.count_inflight,
                       known_paths=known_paths)
    app.add_middleware(TracingMiddleware, tracing=tracing)  # outermost: the request span covers everything
    return app
