"""The engine's API guard: which ``kv_transfer_params`` it refuses, as pure logic.

The same guard in front of real engines is exercised end to end in ``test_e2e_push``.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from kvpush.connector.api_guard import KVParamsGuard, kv_params_error


@pytest.mark.parametrize("params", [
    {"kvpush": "prefill", "request_id": "r1", "decode_engine": "d0", "deadline_ms": 1},
    {"kvpush": "decode", "request_id": "r1", "prefill_engine": "p0", "reservation_id": "x",
     "fencing_token": 3, "traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"},
    {"do_remote_decode": True},  # another connector's params pass through
    None,
])
def test_good_or_foreign_params_pass(params: Any) -> None:
    body = {"prompt": "x"} if params is None else {"prompt": "x", "kv_transfer_params": params}
    assert kv_params_error(json.dumps(body).encode()) is None


@pytest.mark.parametrize("params", [
    {"kvpush": "decode", "request_id": "r1"},
    {"kvpush": "prefill", "request_id": "r1", "deadline_ms": float("inf")},
    {"kvpush": "decode", "request_id": "r1", "prefill_engine": "a b"},
    {"kvpush": 1, "request_id": "r1"},
    "not an object",
])
def test_bad_kvpush_params_are_refused(params: Any) -> None:
    assert kv_params_error(json.dumps({"kv_transfer_params": params}).encode())


def test_the_guard_answers_400_and_replays_good_bodies() -> None:
    seen: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        msg = await receive()
        seen.append(msg["body"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    async def call(body: dict[str, Any]) -> int:
        sent: list[dict[str, Any]] = []
        chunks = [{"type": "http.request", "body": json.dumps(body).encode(),
                   "more_body": False}]

        async def receive() -> dict[str, Any]:
            return chunks.pop(0)

        async def send(msg: dict[str, Any]) -> None:
            sent.append(msg)

        scope = {"type": "http", "method": "POST", "path": "/v1/completions"}
        await KVParamsGuard(app)(scope, receive, send)
        return sent[0]["status"]

    good = {"prompt": "hi", "kv_transfer_params": {"kvpush": "prefill", "request_id": "r"}}
    assert asyncio.run(call(good)) == 200 and json.loads(seen[0]) == good
    bad = {"prompt": "hi", "kv_transfer_params": {"kvpush": "decode", "request_id": "r"}}
    assert asyncio.run(call(bad)) == 400 and len(seen) == 1
