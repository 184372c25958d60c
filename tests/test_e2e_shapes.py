"""End to end on the model shapes P/D fleets serve: MLA (DeepSeek-V2), sliding/full hybrid
(Gemma-2), all-sliding (Mistral), and prefill TP != decode TP (2 -> 1 and 1 -> 2), each
through two real vLLM CPU engines with KVPushConnector, real Redis and real NIXL, every
push checksummed end to end.

Each model shape boots its own pair once (a module fixture per configuration); the two TP
pairings share one TP1 and one TP2 engine that take both roles (``tp_engines``). Prompts
are tagged by configuration, so no engine finds another configuration's prompt cached.
The reference output is the same model colocated at batch size 1: the prefill engine's own
answer to the prompt without ``kv_transfer_params``; with different TP sizes none exists,
and the checksums carry the claim (see ``_answers_as_colocated``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import redis

from kvpush.common.keys import RedisKeys
from kvpush.common.wire import AgentInfo, KVLayout, decode
from kvpush.connector.groups import push_skips
from kvpush.connector.transport import head_bytes
from kvpush.services.local.local_redis import LocalRedis
from kvpush.services.local.models import mla_backend
from tests.e2e_util import (
    EnginePair,
    code_prompt,
    complete,
    disaggregated,
    external_kv_tokens,
    prompt_tokens,
    start_pair,
)

pytestmark = pytest.mark.slow

CHUNK = 160  # prefill's --max-num-batched-tokens where vLLM allows chunked prefill


@dataclass
class Shape:
    """One configuration and what vLLM's CPU backend does with it."""

    model: str
    block: int  # tokens per block
    chunked: bool  # vLLM's CPU backend allows chunked prefill and prefix caching
    windows: tuple[int, ...]  # sliding window per KV cache group (0: full attention)
    prefill_tp: int = 1
    decode_tp: int = 1


SHAPES = {
    # vLLM's MLA backend on this CPU decides the block size and chunking (see _shape).
    "mla": Shape("mla", 16, False, (0,)),
    # Gemma-2: vLLM's hybrid KV cache manager keeps a full and a sliding group.
    "hybrid": Shape("hybrid", 32, True, (0, 128)),
    "sliding": Shape("sliding", 32, True, (128,)),
    # Two prefill ranks each write their KV head into one decode rank's page, and back.
    "tp2-1": Shape("tiny", 32, True, (0,), prefill_tp=2),
    "tp1-2": Shape("tiny", 32, True, (0,), decode_tp=2),
}


def _stats(logs: Path, name: str) -> dict[str, Any]:
    """Connector settings of an engine that pushes: its stats file, every push checksummed."""
    return {"stats_file": str(logs / f"{name}-stats.jsonl"), "verify_kv": 1.0}


@pytest.fixture(scope="module")
def tp_engines(tmp_path_factory: pytest.TempPathFactory, redis_server: LocalRedis
               ) -> Iterator[tuple[EnginePair, Path]]:
    """The two heterogeneous-TP configurations on one TP1 and one TP2 engine of the tiny
    model, each taking both roles: 2 -> 1 pushes from the TP2 engine into the TP1 engine,
    1 -> 2 the other way (two boots instead of four). The TP2 engine's ranks share core 1:
    a decode engine waiting for KV keeps its engine loop and its TP workers' broadcast
    readers spinning, and spread over both cores a TP2 decode starved the prefill it
    waited for (a minute per request on this 2-core host)."""
    logs = tmp_path_factory.mktemp("e2e-tp")
    shape = SHAPES["tp2-1"]
    with start_pair(
        logs, "kvpush", model=shape.model, redis_url=redis_server.url,
        block_size=shape.block, kv_cache_gib=0.25, role="both",
        extra_args=["--max-num-batched-tokens", str(CHUNK)],
        prefill_kw={"extra_config": _stats(logs, "tp2"), "tp": 2, "cpus": "1"},
        decode_kw={"extra_config": _stats(logs, "tp1"), "tp": 1, "cpus": "0"},
    ) as both:
        yield both, logs


def _shape(name: str) -> Shape:
    """The configuration as this machine serves it: vLLM's AMX_MLA backend (a CPU with AMX)
    takes blocks of 32 with prefix caching and chunked prefill on, CPU_MLA forces blocks of
    16 with both off."""
    shape = SHAPES[name]
    if shape.model == "mla":
        backend = mla_backend()
        shape = replace(shape, block=backend.block_size, chunked=backend.chunked_prefill)
    return shape


@pytest.fixture(scope="module", params=list(SHAPES))
def shaped(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
           redis_server: LocalRedis) -> Iterator[dict[str, Any]]:
    """A prefill and a decode engine of one configuration, every push verified."""
    shape = _shape(request.param)
    base = {"shape": shape, "name": request.param, "redis_url": redis_server.url}
    if shape.prefill_tp != shape.decode_tp:
        both, logs = request.getfixturevalue("tp_engines")
        tp2, tp1 = both.prefill, both.decode
        prefill, decode = (tp2, tp1) if shape.prefill_tp == 2 else (tp1, tp2)
        stats = {role: logs / f"tp{e.spec.tp}-stats.jsonl"
                 for role, e in (("prefill", prefill), ("decode", decode))}
        yield {**base, "pair": EnginePair(prefill, decode), "stats": stats}
        return
    logs = tmp_path_factory.mktemp(f"e2e-{request.param}")
    chunk = ["--max-num-batched-tokens", str(CHUNK)] if shape.chunked else []
    with start_pair(
        logs, "kvpush", model=shape.model, redis_url=redis_server.url,
        block_size=shape.block, kv_cache_gib=0.25,
        prefill_kw={"extra_config": _stats(logs, "prefill"), "extra_args": chunk},
        decode_kw={"extra_config": {"stats_file": str(logs / "decode-stats.jsonl")}},
    ) as pair:
        stats = {"prefill": logs / "prefill-stats.jsonl", "decode": logs / "decode-stats.jsonl"}
        yield {**base, "pair": pair, "stats": stats}


def _body(model: str, prompt: str, max_tokens: int = 12) -> dict[str, Any]:
    return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}


def _answers_as_colocated(shaped: dict[str, Any], prompt: str, text: str) -> None:
    """Assert ``text`` (the disaggregated answer) is the same model's colocated answer at
    batch size 1: the prefill engine's own, without ``kv_transfer_params``.

    Between different TP sizes no colocated engine computes what P/D does: the pushed KV
    is prefill's TP split's (which sums the projections feeding every layer past the first
    in another order), attended by decode's split. On random weights a near-tied greedy
    token then flips in about one run in ten, as it did against decode's own answer, so
    there the exact claim is the KV's, verified byte for byte on every rank by ``_pd``'s
    checksums, and the text is only required to be there."""
    pair: EnginePair = shaped["pair"]
    shape: Shape = shaped["shape"]
    assert text
    if shape.prefill_tp == shape.decode_tp:
        assert text == complete(pair.prefill.url, _body(shape.model, prompt)
                                )["choices"][0]["text"]


def _layout(shaped: dict[str, Any], rank: int = 0) -> KVLayout:
    r = redis.Redis.from_url(shaped["redis_url"])
    pair: EnginePair = shaped["pair"]
    return decode(r.get(RedisKeys().agent(pair.prefill.engine_id, rank)), AgentInfo).layout


def _pushed_bytes(shaped: dict[str, Any], n_tokens: int, prefix_blocks: int = 0) -> int:
    """Bytes a push of ``n_tokens`` writes over all ranks: each layer's group from its own
    skip on, every KV head once."""
    shape: Shape = shaped["shape"]
    layout = _layout(shaped)
    total = -(-n_tokens // shape.block)
    skips = push_skips(n_tokens, prefix_blocks, shape.windows, shape.block)
    groups = layout.layer_groups or [0] * len(layout.layer_names)
    return sum(total - skips[g] for g in groups) * head_bytes(layout) * layout.total_kv_heads


def _rows(path: Path, rid: str, kind: str, n: int, timeout_s: float = 30) -> list[dict]:
    """The ``n`` stats records of ``rid`` (one per rank), waiting for them."""
    deadline = time.monotonic() + timeout_s
    rows: list[dict] = []
    while time.monotonic() < deadline:
        if path.exists():
            rows = [r for r in map(json.loads, path.read_text().splitlines())
                    if r["rid"] == rid and r["kind"] == kind]
            if len(rows) >= n:
                return sorted(rows, key=lambda r: r["rank"])
        time.sleep(0.1)
    raise AssertionError(f"{len(rows)} {kind} records of {rid}, want {n}")


def _pd(shaped: dict[str, Any], prompt: str, **kw: Any
        ) -> tuple[str, list[dict], list[dict]]:
    """One disaggregated request: (text, prefill's push records, decode's receives), one
    record per rank."""
    pair: EnginePair = shaped["pair"]
    shape: Shape = shaped["shape"]
    rid, text = disaggregated(pair, prompt, max_tokens=12, model=shape.model, **kw)
    pushes = _rows(shaped["stats"]["prefill"], rid, "push", shape.prefill_tp)
    recvs = _rows(shaped["stats"]["decode"], rid, "recv", shape.decode_tp)
    assert all(p["ok"] and p["verified"] is True for p in pushes), pushes
    assert all(r["ok"] and r["verified"] is True for r in recvs), recvs
    assert sum(p["bytes"] for p in pushes) == sum(r["bytes"] for r in recvs)
    return text, pushes, recvs


def test_a_prompt_longer_than_the_window_is_pushed_verified_and_answers_as_colocated(
        shaped: dict[str, Any]) -> None:
    """Output equals the colocated engine's, decode took every prompt token from the
    push, every rank's part was checksummed on both sides, every KV head was written
    once, and a sliding group pushed only its window (fewer bytes than promoting every
    layer to full attention would)."""
    pair: EnginePair = shaped["pair"]
    shape: Shape = shaped["shape"]
    prompt = code_prompt(f"{shaped['name']}-long", 14)
    n_tokens = prompt_tokens(pair.decode.url, prompt, model=shape.model)
    assert n_tokens > 2 * 128 and n_tokens % shape.block
    layout = _layout(shaped)
    assert len(set(layout.layer_groups or [0])) == len(shape.windows)  # HMA kept on
    assert layout.page == ("latent" if shape.model == "mla" else "heads")
    assert layout.tp_size == shape.prefill_tp
    ext_before = external_kv_tokens(pair.decode.url)
    text, pushes, _recvs = _pd(shaped, prompt)
    assert external_kv_tokens(pair.decode.url) - ext_before == n_tokens
    pushed = sum(p["bytes"] for p in pushes)
    assert pushed == _pushed_bytes(shaped, n_tokens)
    every_block = (-(-n_tokens // shape.block) * len(layout.layer_names)
                   * head_bytes(layout) * layout.total_kv_heads)
    assert pushed < every_block if any(shape.windows) else pushed == every_block
    _answers_as_colocated(shaped, prompt, text)


def test_decode_prefix_hit_and_chunked_prefill(shaped: dict[str, Any]) -> None:
    """Decode holds the prompt's prefix: only the rest is pushed, and prefill computes it
    in chunks smaller than the prompt. vLLM's CPU_MLA backend (a CPU without AMX) turns
    prefix caching and chunked prefill off, so there the MLA engines serve the prompt
    whole."""
    pair: EnginePair = shaped["pair"]
    shape: Shape = shaped["shape"]
    prefix = code_prompt(f"{shaped['name']}-shared", 12)
    prompt = prefix + "\n# then\n" + code_prompt(f"{shaped['name']}-tail", 6)
    complete(pair.decode.url, _body(shape.model, prefix, 1))
    n_tokens = prompt_tokens(pair.decode.url, prompt, model=shape.model)
    ext_before = external_kv_tokens(pair.decode.url)
    text, pushes, _recvs = _pd(shaped, prompt, decode_first=True)
    cached = n_tokens - (external_kv_tokens(pair.decode.url) - ext_before)
    pushed = sum(p["bytes"] for p in pushes)
    if shape.chunked:
        assert n_tokens > 2 * CHUNK
        assert 0 < cached < n_tokens and cached % shape.block == 0
        assert pushed == _pushed_bytes(shaped, n_tokens, int(cached) // shape.block)
        # Each chunk wrote the blocks it completed, layer by layer, as it went.
        assert all(p["layerwise_xfers"] > 0 for p in pushes)
    else:
        assert cached == 0 and pushed == _pushed_bytes(shaped, n_tokens)
    _answers_as_colocated(shaped, prompt, text)
