"""OpenAI-compatible front for the stock NIXL connectors: sequential pull and concurrent push."""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

logger = logging.getLogger(__name__)

MODES = ("nixl-pull", "nixl-push", "none")


class ProxyConfigError(ValueError):
    """The proxy was given an unknown mode or an incomplete engine description."""


class PrefillFailed(RuntimeError):
    """The prefill engine refused or failed the prefill leg of a request."""


@dataclass(frozen=True)
class Backend:
    """One engine as the proxy sees it."""

    url: str
    engine_id: str
    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill leg: one token, no streaming, KV kept for a remote decode."""
    req = dict(body)
    req["max_tokens"] = 1
    if "max_completion_tokens" in req:
        req["max_completion_tokens"] = 1
    req["stream"] = False
    req.pop("stream_options", None)
    # A client's min_tokens would exceed the one-token leg, which vLLM rejects.
    req.pop("min_tokens", None)
    req["kv_transfer_params"] = {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }
    return req


def pull_decode_body(body: dict[str, Any], prefill_response: dict[str, Any]) -> dict[str, Any]:
    """The decode leg of pull: the original request plus prefill's transfer params."""
    params = prefill_response.get("kv_transfer_params")
    if not params:
        raise PrefillFailed("prefill returned no kv_transfer_params")
    req = dict(body)
    req["kv_transfer_params"] = params
    return req


def push_decode_body(body: dict[str, Any], prefill: Backend, request_id: str) -> dict[str, Any]:
    """The decode leg of stock push: where prefill's side channel is, known before it runs."""
    req = dict(body)
    req["kv_transfer_params"] = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": prefill.engine_id,
        "remote_host": prefill.side_channel_host,
        "remote_port": prefill.side_channel_port,
        "remote_request_id": request_id,
        "tp_size": 1,
        "pp_size": 1,
    }
    return req


class PDProxy:
    """Dispatches each request to a prefill and a decode engine the way the stock connector wants.

    ``nixl-pull`` runs prefill first, then decode with the block ids prefill returned.
    ``nixl-push`` sends both legs at once, paired by the same ``X-Request-Id``; decode
    registers its blocks with prefill, which WRITEs into them when it finishes.
    ``none`` forwards to a single engine.
    """

    def __init__(
        self, mode: str, prefill: Backend | None, decode: Backend, timeout_s: float = 300.0,
        engine_api_key: str | None = None,
    ) -> None:
        if mode not in MODES:
            raise ProxyConfigError(f"mode must be one of {MODES}, not {mode!r}")
        if mode != "none" and prefill is None:
            raise ProxyConfigError(f"mode {mode} needs a prefill engine")
        if mode == "nixl-push" and not prefill.side_channel_port:  # type: ignore[union-attr]
            raise ProxyConfigError("nixl-push needs the prefill engine's side-channel port")
        self.mode = mode
        self.prefill = prefill
        self.decode = decode
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            headers={"Authorization": f"Bearer {engine_api_key}"} if engine_api_key else None)

    async def close(self) -> None:
        """Close the HTTP client."""
        await self.client.aclose()

    async def _prefill(self, path: str, body: dict[str, Any], rid: str) -> dict[str, Any]:
        assert self.prefill is not None
        resp = await self.client.post(
            f"{self.prefill.url}{path}", json=prefill_body(body), headers={"X-Request-Id": rid}
        )
        if resp.status_code != 200:
            raise PrefillFailed(f"prefill answered {resp.status_code}: {resp.text[:500]}")
        return resp.json()

    async def handle(self, path: str, body: dict[str, Any]) -> Response:
        """Serve one completion or chat completion request."""
        rid = f"cmpl-{uuid.uuid4().hex}"
        headers = {"X-Request-Id": rid}
        push_task: asyncio.Task[dict[str, Any]] | None = None
        try:
            if self.mode == "nixl-pull":
                decode_req = pull_decode_body(body, await self._prefill(path, body, rid))
            elif self.mode == "nixl-push":
                assert self.prefill is not None
                # Concurrent dispatch: decode allocates and registers while prefill computes.
                push_task = asyncio.create_task(self._prefill(path, body, rid))
                decode_req = push_decode_body(body, self.prefill, rid)
            else:
                decode_req = dict(body)
        except PrefillFailed as exc:
            logger.warning("request %s: %s", rid, exc)
            return JSONResponse({"error": {"message": str(exc), "type": "prefill_failed"}}, 502)

        url = f"{self.decode.url}{path}"
        if body.get("stream"):
            return StreamingResponse(
                self._stream(url, decode_req, headers, push_task),
                media_type="text/event-stream",
                headers={"X-Request-Id": rid},
            )
        resp = await self.client.post(url, json=decode_req, headers=headers)
        await self._reap(push_task, rid)
        return Response(
            resp.content,
            status_code=resp.status_code,
            media_type=resp.headers.get("content-type", "application/json"),
            headers={"X-Request-Id": rid},
        )

    async def _stream(
        self,
        url: str,
        body: dict[str, Any],
        headers: dict[str, str],
        push_task: asyncio.Task[dict[str, Any]] | None,
    ) -> AsyncIterator[bytes]:
        try:
            async with self.client.stream("POST", url, json=body, headers=headers) as resp:
                async for chunk in resp.aiter_raw():
                    yield chunk
        finally:
            await self._reap(push_task, headers["X-Request-Id"])

    async def _reap(self, task: asyncio.Task[dict[str, Any]] | None, rid: str) -> None:
        if task is None:
            return
        try:
            await task
        except (PrefillFailed, httpx.HTTPError) as exc:
            logger.warning("request %s: prefill leg failed: %s", rid, exc)

    async def models(self) -> Response:
        """Decode's model list."""
        resp = await self.client.get(f"{self.decode.url}/v1/models")
        return Response(resp.content, resp.status_code, media_type="application/json")

    async def healthy(self) -> bool:
        """True when every engine answers /health."""
        urls = [self.decode.url] + ([self.prefill.url] if self.prefill else [])
        try:
            codes = await asyncio.gather(*(self.client.get(f"{u}/health") for u in urls))
        except httpx.HTTPError:
            return False
        return all(r.status_code == 200 for r in codes)


def create_app(proxy: PDProxy) -> FastAPI:
    """The FastAPI app of the proxy."""

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        await proxy.close()

    app = FastAPI(title="kvpush pd-proxy", lifespan=lifespan)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await proxy.handle("/v1/completions", await _json(request))

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await proxy.handle("/v1/chat/completions", await _json(request))

    @app.get("/v1/models")
    async def models() -> Response:
        return await proxy.models()

    @app.get("/health")
    async def health() -> Response:
        ok = await proxy.healthy()
        return JSONResponse({"ok": ok, "mode": proxy.mode}, status_code=200 if ok else 503)

    return app


async def _json(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except json.JSONDecodeError as exc:
        raise ProxyConfigError(f"request body is not JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise ProxyConfigError("request body must be a JSON object")
    return body
