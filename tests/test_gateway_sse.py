"""Splitting an engine's SSE stream into events (services/gateway/engines.py: SSEEvents):
events across reads and several in one read, what one read brought handed over at once, a
last event without its blank line, and an event that never ends. The stream is a fake: the
parsing is what is under test, the relay's real-engine tests cover the rest."""

from __future__ import annotations

from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import aiohttp
import pytest

from kvpush.common.runtime import run
from kvpush.services.gateway.engines import MAX_EVENT_BYTES, EngineFailed, sse_events


def _resp(*chunks: bytes | Exception) -> Any:
    async def iter_any() -> AsyncIterator[bytes]:
        for c in chunks:
            if isinstance(c, Exception):
                raise c
            yield c

    return SimpleNamespace(content=SimpleNamespace(iter_any=iter_any))


def test_events_split_across_reads_and_several_in_one() -> None:
    async def main() -> None:
        ev = sse_events(_resp(b"data: 1\n", b"\ndata: 2\n\ndata: 3\n\nda", b"ta: 4\n\n",
                              b"data: 5"), "d")
        assert await anext(ev) == b"data: 1\n\n"  # completed by the second read
        assert ev.ready() == [b"data: 2\n\n", b"data: 3\n\n"]  # what it also brought
        assert ev.ready() == []
        assert await anext(ev) == b"data: 4\n\n"
        assert ev.ready() == []
        # The stream's end completes its last event.
        assert [x async for x in ev] == [b"data: 5\n\n"]
        assert await anext(ev, b"") == b""

    run(main())


@pytest.mark.parametrize("broken", ["endless", "error"])
def test_a_broken_stream_is_an_engine_failure(broken: str) -> None:
    async def main() -> None:
        cause = b"x" * (MAX_EVENT_BYTES + 1) if broken == "endless" else \
            aiohttp.ClientPayloadError("cut")
        ev = sse_events(_resp(b"data: 1\n\n", cause), "d")
        assert await anext(ev) == b"data: 1\n\n"
        with pytest.raises(EngineFailed):
            await anext(ev)
        assert await anext(ev, b"") == b""  # and it stays ended

    run(main())
