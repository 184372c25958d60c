"""The FastAPI app (routes, lifespan, extra background tasks) and the ``kvpush gateway`` server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from contextlib import asynccontextmanager
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from redis.exceptions import RedisError
from starlette.types import ASGIApp, Receive, Scope, Send

from kvpush.common.settings import GatewaySettings
from kvpush.services.gateway import tokenize
from kvpush.services.gateway.conversations import serve_stored
from kvpush.services.gateway.edge import HeaderLimit, server_config
from kvpush.services.gateway.handler import handle
from kvpush.services.gateway.metrics import metrics_app, metrics_route
from kvpush.services.gateway.openai_api import CHAT, COMPLETIONS, RESPONSES
from kvpush.services.gateway.state import Gateway

logger = logging.getLogger(__name__)

BackgroundTask = Callable[[], Coroutine[Any, Any, None]]
"""A coroutine factory the app runs beside the gateway for its whole lifespan."""


def create_app(settings: GatewaySettings | None = None, gateway: Gateway | None = None,
               background: Sequence[BackgroundTask] = (), freeze_heap: bool = False
               ) -> FastAPI:
    """The FastAPI app; the gateway starts and stops with the app's lifespan.

    ``freeze_heap``: the process serves this app and nothing else (``kvpush gateway``,
    ``kvpush up``), so what the gateway loaded to start is frozen out of the garbage
    collector's scans (:func:`~kvpush.common.runtime.freeze_startup_heap`).

    Each of ``background`` runs as a task in the app's event loop from before the gateway
    starts until after it stops (``kvpush up`` runs its push scheduler this way; real
    deployments run ``kvpush scheduler`` separately).
    """
    gw = gateway or Gateway(settings or GatewaySettings())
    gw.freeze_heap = freeze_heap
    s = gw.s
    # The background tasks, which /health reports on: a stopped one (the in-process
    # scheduler of ``kvpush up`` died) makes the whole process unhealthy.
    running: list[asyncio.Task[None]] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        tasks = [asyncio.create_task(fn(), name=f"kvpush-gateway-background-{i}")
                 for i, fn in enumerate(background)]
        running.extend(tasks)
        try:
            await gw.start()
            try:
                yield
            finally:
                await gw.stop()
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError):
                    await t

    docs = s.gateway_expose_docs
    app = FastAPI(title="kvpush gateway", lifespan=lifespan,
                  docs_url="/docs" if docs else None, redoc_url="/redoc" if docs else None,
                  openapi_url="/openapi.json" if docs else None)
    app.state.gateway = gw
    app.add_middleware(OpenAIRoutes, gateway=gw)
    app.add_middleware(HeaderLimit, max_bytes=s.gateway_max_header_bytes)

    @app.post(COMPLETIONS)
    async def completions(request: Request) -> Response:
        return await handle(gw, request, COMPLETIONS)

    @app.post(CHAT)
    async def chat(request: Request) -> Response:
        return await handle(gw, request, CHAT)

    @app.post(RESPONSES)
    async def responses(request: Request) -> Response:
        return await handle(gw, request, RESPONSES)

    @app.get(RESPONSES + "/{response_id}")
    async def stored_response(request: Request, response_id: str) -> Response:
        return await serve_stored(gw, request, response_id)

    @app.delete(RESPONSES + "/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        return await serve_stored(gw, request, response_id, delete=True)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> Response:
        return await tokenize.forward(gw, request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> Response:
        return await tokenize.forward(gw, request, "/detokenize")

    @app.get("/v1/models")
    async def models() -> Response:
        names = [gw.model] if gw.model else await gw.engine_models()
        return JSONResponse({"object": "list", "data": [
            {"id": n, "object": "model", "created": 0, "owned_by": "kvpush"} for n in names]})

    @app.get("/health")
    async def health() -> Response:
        try:
            await gw.redis.ping()
        except RedisError as exc:
            logger.warning("health: Redis ping failed: %s", exc)
            return JSONResponse({"status": "error", "detail": "Redis unreachable"}, 503)
        if not gw.waiter.running:
            return JSONResponse({"status": "error", "detail": "assignment reader stopped"}, 503)
        stopped = [t.get_name() for t in running if t.done()]
        if stopped:
            return JSONResponse({"status": "error",
                                 "detail": f"background task stopped: {', '.join(stopped)}"},
                                503)
        return JSONResponse({"status": "ok", "gateway_id": gw.gateway_id})

    if s.gateway_expose_metrics:
        app.router.routes.append(metrics_route(gw.metrics.registry))
    return app


class OpenAIRoutes:
    """ASGI middleware: a POST to an OpenAI endpoint goes to :func:`handle` directly.

    FastAPI's router, request handler and exception middleware each wrap every ``send`` of
    a response, a few microseconds per relayed token; the OpenAI routes need none of them
    (:func:`handle` answers every failure itself, and an unexpected exception still meets
    the server error middleware outside this one). Everything else goes on to FastAPI,
    where the same routes stay declared (a GET there is a 405)."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gw = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path") if scope["type"] == "http" else None
        if path in _OPENAI_POSTS and scope["method"] == "POST":
            response = await handle(self.gw, Request(scope, receive), path)
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


_OPENAI_POSTS = frozenset({COMPLETIONS, CHAT, RESPONSES})


def uvicorn_server(settings: GatewaySettings, app: FastAPI | None = None) -> uvicorn.Server:
    """A uvicorn server for the gateway app, with the settings' connection and size bounds."""
    return uvicorn.Server(server_config(app or create_app(settings), settings))


async def serve_gateway(settings: GatewaySettings | None = None) -> None:
    """Serve the gateway until the server stops (for ``kvpush gateway``); with
    ``gateway_metrics_port``, ``/metrics`` on a listener of its own too."""
    settings = settings or GatewaySettings()
    app = create_app(settings, freeze_heap=True)
    server = uvicorn_server(settings, app)
    logger.info("gateway on http://%s:%d", settings.gateway_host, settings.gateway_port)
    if settings.gateway_metrics_port is None:
        await server.serve()
        return
    mserver = uvicorn.Server(server_config(
        metrics_app(app.state.gateway.metrics.registry), settings,
        settings.gateway_metrics_port))
    logger.info("gateway metrics on http://%s:%d/metrics", settings.gateway_host,
                settings.gateway_metrics_port)
    # Signals belong to the API server; the metrics listener stops when it does.
    mserver.capture_signals = contextlib.nullcontext  # type: ignore[method-assign]
    mtask = asyncio.create_task(mserver.serve(), name="kvpush-gateway-metrics")
    try:
        await server.serve()
    finally:
        mserver.should_exit = True
        await mtask


def main() -> None:
    """``kvpush gateway``: serve the OpenAI API in this process on uvloop."""
    from kvpush.common.log import setup_logging
    from kvpush.common.runtime import run

    settings = GatewaySettings()
    setup_logging(settings.log_level)
    with contextlib.suppress(KeyboardInterrupt):
        run(serve_gateway(settings))
