"""End to end: two real vLLM CPU engines with stock NixlConnector (pull) behind the pd proxy.

Template for the other P/D paths: swap the connector and the proxy mode, keep the checks
(greedy output equals one colocated engine's; decode took the whole prompt from a KV
transfer; engines heartbeat to Redis while up and withdraw on stop).
"""

from __future__ import annotations

import time

import pytest
import redis

from kvpush.common.keys import RedisKeys
from kvpush.services.engine.cpus import thread_affinities
from kvpush.services.local.stack import engine_rows
from tests.e2e_util import (
    engine_cpus,
    external_kv_tokens,
    greedy_text,
    metric,
    prompt_tokens,
    proxy_for,
    start_pair,
    stream_completion,
)

pytestmark = pytest.mark.slow

# Several 128-token KV blocks plus a partial one; mixed text so the output is not trivial.
PROMPT = "".join(
    f"class Handler{i}(Base):\n    def run(self, item_{i}):\n        return item_{i} + {i * 7}\n"
    for i in range(20)
)
MAX_TOKENS = 24


def _wait_for_change(url: str, before: float, timeout_s: float = 10.0) -> float:
    # The engine publishes its counters asynchronously from the request's end.
    deadline = time.monotonic() + timeout_s
    value = external_kv_tokens(url)
    while value == before and time.monotonic() < deadline:
        time.sleep(0.2)
        value = external_kv_tokens(url)
    return value


def test_stock_pull_matches_single_engine(tmp_path, redis_url):
    keys = RedisKeys()
    client = redis.Redis.from_url(redis_url)
    with start_pair(tmp_path, "nixl-pull", redis_url=redis_url) as pair:
        # Both engines heartbeat as the contract says.
        rows = {r["engine_id"]: r for r in engine_rows(redis_url)}
        assert rows[pair.prefill.engine_id]["role"] == "prefill"
        assert rows[pair.decode.engine_id]["role"] == "decode"
        assert rows[pair.decode.engine_id]["free_blocks"] > 0
        assert rows[pair.decode.engine_id]["connector"] == "nixl-pull"

        # Each engine's threads stay on its own core, despite the stock NIXL worker
        # moving its compute thread to the machine's last core.
        p_cpus, d_cpus = engine_cpus()
        if p_cpus is not None:
            assert {frozenset(a) for a in thread_affinities(pair.prefill.pid).values()} == {
                frozenset({int(p_cpus)})
            }
            assert {frozenset(a) for a in thread_affinities(pair.decode.pid).values()} == {
                frozenset({int(d_cpus)})
            }

        n_prompt = prompt_tokens(pair.decode.url, PROMPT)
        assert n_prompt > 3 * 128
        with proxy_for(pair, "nixl-pull") as url:
            before = external_kv_tokens(pair.decode.url)
            disagg = greedy_text(url, PROMPT, MAX_TOKENS)
            after = _wait_for_change(pair.decode.url, before)
            assert after - before == n_prompt
            # Decode really read KV over NIXL: whole blocks of 2 KiB/token.
            nixl_bytes = metric(pair.decode.url, "vllm:nixl_bytes_transferred_sum")
            assert nixl_bytes == -(-n_prompt // 128) * 128 * 2048

            # Streaming through the proxy gives the same tokens.
            streamed = stream_completion(
                url, {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS,
                      "temperature": 0.0}
            )
            assert streamed.text == disagg
            assert streamed.completion_tokens == MAX_TOKENS

        # The reference: one engine computing prompt and answer itself (prefill's, asked
        # without kv_transfer_params; a third engine costs a boot on 2 cores).
        assert greedy_text(pair.prefill.url, PROMPT, MAX_TOKENS) == disagg
        assert external_kv_tokens(pair.prefill.url) == 0
    assert len(disagg) > 0

    # A clean stop withdraws both statuses at once (no waiting for the TTL).
    assert client.zcard(keys.engines()) == 0
    assert not client.exists(keys.engine(pair.decode.engine_id))
    client.close()
