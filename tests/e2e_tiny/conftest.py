"""One pair of tiny push engines for the package: the engine-level push tests and the
gateway tests run on the same prefill and decode (each configuration boots once).

The pair has a Redis of its own (the session Redis is flushed by other tests, and the
engines' NIXL agent keys and heartbeats must survive), exports every span to a real
OTLP/HTTP receiver, checksums every push on both sides (``verify_kv``), writes each
side's per-transfer stats file, and prefill runs chunked (``--max-num-batched-tokens``
below the longer prompts, not a multiple of the block size). ``test_e2e_gateway`` runs
first (files in name order): ``test_e2e_push`` starts and kills a spare decode, whose
heartbeat would otherwise be seen by the gateway's scheduler for a few seconds.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from kvpush.loadtest.otlp_receiver import OTLPReceiver
from kvpush.services.local.local_redis import LocalRedis
from tests.e2e_util import start_pair

BLOCK = 32  # small blocks: several per prompt, chunk ends fall inside blocks
CHUNK = 200  # prefill's --max-num-batched-tokens (not a multiple of BLOCK)
# Decode's bound on holding a given-up receive's blocks: the tests whose prefill never hears
# of the request (so never fences it) wait this long, not the default minute.
QUARANTINE_S = 5.0
# How long prefill waits for a history push before it computes the history itself.
HISTORY_DEADLINE_S = 4.0


@pytest.fixture(scope="package")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A prefill and a decode engine with the push connector, a Redis and a span receiver."""
    logs = tmp_path_factory.mktemp("e2e-tiny")
    stats = {"prefill": logs / "prefill-stats.jsonl", "decode": logs / "decode-stats.jsonl"}
    server = LocalRedis(logs / "redis").start()
    try:
        with OTLPReceiver() as otlp:
            common = {"redis_url": server.url, "block_size": BLOCK, "kv_cache_gib": 0.25,
                      "otlp_endpoint": otlp.endpoint}
            with start_pair(
                logs, "kvpush",
                prefill_kw={"extra_config": {"stats_file": str(stats["prefill"]),
                                             "verify_kv": 1.0,
                                             "quarantine_max_s": QUARANTINE_S,
                                             "history_deadline_s": HISTORY_DEADLINE_S},
                            "extra_args": ["--max-num-batched-tokens", str(CHUNK)]},
                decode_kw={"extra_config": {"stats_file": str(stats["decode"]),
                                            "verify_kv": 1.0,
                                            "quarantine_max_s": QUARANTINE_S}},
                **common,
            ) as pair:
                yield {"pair": pair, "stats": stats, "redis_url": server.url, "logs": logs,
                       "common": common, "otlp": otlp}
    finally:
        server.stop()
