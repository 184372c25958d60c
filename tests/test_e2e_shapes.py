"""End to end on the model shapes P/D fleets serve: MLA (DeepSeek-V2), sliding/full hybrid
(Gemma-2) and all-sliding (Mistral), each through two real vLLM CPU engines with
KVPushConnector, real Redis and real NIXL, every push checksummed end to end.

Each shape boots its own pair once (a module fixture per shape): the engines serve one model
each. The reference output is the prefill engine's own answer to the same prompt without
``kv_transfer_params`` (the same model, colocated, batch size 1).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.wire import AgentInfo, decode
from kvpush.connector.groups import push_skips
from kvpush.services.local.local_redis import LocalRedis
from tests.e2e_util import EnginePair, complete, external_kv_tokens, prompt_tokens, start_pair
from tests.test_e2e_push import _prompt, _wait_records, disaggregated

pytestmark = pytest.mark.slow

CHUNK = 160  # prefill's --max-num-batched-tokens where vLLM allows chunked prefill


@dataclass
class Shape:
    """One model shape and what vLLM's CPU backend does with it."""

    model: str
    block: int  # tokens per block (vLLM's CPU MLA backend forces 16)
    chunked: bool  # vLLM's CPU backend allows chunked prefill and prefix caching
    windows: tuple[int, ...]  # sliding window per KV cache group (0: full attention)


SHAPES = {
    "mla": Shape("mla", 16, False, (0,)),
    # Gemma-2: vLLM's hybrid KV cache manager keeps a full and a sliding group.
    "hybrid": Shape("hybrid", 32, True, (0, 128)),
    "sliding": Shape("sliding", 32, True, (128,)),
}


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           redis_server: LocalRedis) -> Iterator[dict[str, Any]]:
    """A prefill and a decode engine of one shape, every push verified (checksums)."""
    shape = SHAPES[request.param]
    logs = tmp_path_factory.mktemp(f"e2e-{shape.model}")
    stats = {"prefill": logs / "prefill-stats.jsonl", "decode": logs / "decode-stats.jsonl"}
    chunk = ["--max-num-batched-tokens", str(CHUNK)] if shape.chunked else []
    with start_pair(
        logs, "kvpush", model=shape.model, redis_url=redis_server.url,
        block_size=shape.block, kv_cache_gib=0.25,
        prefill_kw={"extra_config": {"stats_file": str(stats["prefill"]), "verify_kv": 1.0},
                    "extra_args": chunk},
        decode_kw={"extra_config": {"stats_file": str(stats["decode"])}},
    ) as pair:
        yield {"pair": pair, "shape": shape, "stats": stats, "redis_url": redis_server.url}


def _body(model: str, prompt: str, max_tokens: int = 12) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}


def _colocated(pair: EnginePair, model: str, prompt: str) -> str:
    return complete(pair.prefill.url, _body(model, prompt))["choices"][0]["text"]


def _layout(shaped: dict[str, Any]) -> Any:
    r = redis.Redis.from_url(shaped["redis_url"])
    pair: EnginePair = shaped["pair"]
    return decode(r.get(RedisKeys().agent(pair.prefill.engine_id, 0)), AgentInfo).layout


def _pushed_bytes(shaped: dict[str, Any], n_tokens: int, prefix_blocks: int = 0) -> int:
    """Bytes a push of ``n_tokens`` writes: each layer's group from its own skip on."""
    shape: Shape = shaped["shape"]
    layout = _layout(shaped)
    total = -(-n_tokens // shape.block)
    skips = push_skips(n_tokens, prefix_blocks, shape.windows, shape.block)
    groups = layout.layer_groups or [0] * len(layout.layer_names)
    return sum(total - skips[g] for g in groups) * layout.block_len


def _pd(shaped: dict[str, Any], prompt: str, **kw: Any) -> tuple[str, str, dict, dict]:
    """One disaggregated request: (rid, text, prefill's push record, decode's receive)."""
    pair: EnginePair = shaped["pair"]
    shape: Shape = shaped["shape"]
    rid, text = disaggregated(pair, prompt, max_tokens=12, model=shape.model, **kw)
    push = _wait_records(shaped["stats"]["prefill"], rid, "push")[0]
    recv = _wait_records(shaped["stats"]["decode"], rid, "recv")[0]
    return rid, text, push, recv


def test_a_prompt_longer_than_the_window_is_pushed_verified_and_answers_as_colocated(
        shaped: dict[str, Any]) -> None:
    """Output equals the colocated engine's, decode took every prompt token from the
    push, both sides checksummed the same bytes, and a sliding group pushed only its
    window (fewer bytes than promoting every layer to full attention would)."""
    pair: EnginePair = shaped["pair"]
    shape: Shape = shaped["shape"]
    prompt = _prompt(f"{shape.model}-long", 14)
    n_tokens = prompt_tokens(pair.decode.url, prompt, model=shape.model)
    assert n_tokens > 2 * 128 and n_tokens % shape.block
    layout = _layout(shaped)
    groups = set(layout.layer_groups or [0])
    assert len(groups) == len(shape.windows)  # vLLM kept its hybrid KV cache manager on
    assert layout.page == ("latent" if shape.model == "mla" else "heads")
    ext_before = external_kv_tokens(pair.decode.url)
    _rid, text, push, recv = _pd(shaped, prompt)
    assert external_kv_tokens(pair.decode.url) - ext_before == n_tokens
    assert push["ok"] and recv["ok"]
    assert push["verified"] is True and recv["verified"] is True
    assert push["bytes"] == recv["bytes"] == _pushed_bytes(shaped, n_tokens)
    every_block = -(-n_tokens // shape.block) * layout.block_len * len(layout.layer_names)
    if any(shape.windows):
        assert push["bytes"] < every_block
    else:
        assert push["bytes"] == every_block
    assert text == _colocated(pair, shape.model, prompt) and text


def test_decode_prefix_hit_and_chunked_prefill(shaped: dict[str, Any]) -> None:
    """Decode holds the prompt's prefix: only the rest is pushed, and prefill computes it
    in chunks smaller than the prompt. vLLM's CPU MLA backend turns prefix caching and
    chunked prefill off, so the MLA engines serve the same prompt whole."""
    pair: EnginePair = shaped["pair"]
    shape: Shape = shaped["shape"]
    prefix = _prompt(f"{shape.model}-shared", 12)
    prompt = prefix + "\n# then\n" + _prompt(f"{shape.model}-tail", 6)
    complete(pair.decode.url, _body(shape.model, prefix, 1))
    n_tokens = prompt_tokens(pair.decode.url, prompt, model=shape.model)
    ext_before = external_kv_tokens(pair.decode.url)
    _rid, text, push, recv = _pd(shaped, prompt, decode_first=True)
    pushed_tokens = external_kv_tokens(pair.decode.url) - ext_before
    cached = n_tokens - pushed_tokens
    assert push["ok"] and recv["ok"] and push["verified"] and recv["verified"]
    if shape.chunked:
        assert n_tokens > 2 * CHUNK
        assert 0 < cached < n_tokens and cached % shape.block == 0
        assert push["bytes"] == _pushed_bytes(shaped, n_tokens, int(cached) // shape.block)
        # Each chunk wrote the blocks it completed, layer by layer, as it went.
        assert push["layerwise_xfers"] > 0
    else:
        assert cached == 0 and push["bytes"] == _pushed_bytes(shaped, n_tokens)
    assert text == _colocated(pair, shape.model, prompt) and text
