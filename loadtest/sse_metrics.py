"""Per-request latency facts from an OpenAI SSE stream: TTFT, TPOT, ITL, end-to-end."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field


@dataclass
class StreamTimings:
    """What one streamed completion measured, in seconds (monotonic, local only)."""

    start: float
    first_token: float | None = None
    end: float | None = None
    token_times: list[float] = field(default_factory=list)
    chunks: int = 0
    output_tokens: int = 0
    prompt_tokens: int = 0
    text: str = ""
    finish_reason: str | None = None
    error: str | None = None
    events: list[dict] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Time to the first content token."""
        return None if self.first_token is None else self.first_token - self.start

    @property
    def e2e(self) -> float | None:
        """Time to the end of the stream."""
        return None if self.end is None else self.end - self.start

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        if self.first_token is None or self.end is None or self.output_tokens < 2:
            return None
        return (self.end - self.first_token) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Gaps between consecutive content chunks."""
        return [b - a for a, b in itertools.pairwise(self.token_times)]


def consume_sse(lines: Iterable[bytes | str], start: float) -> StreamTimings:
    """Read ``data:`` lines of an OpenAI stream as they arrive, stamping each on arrival."""
    return consume_timed_sse(((time.perf_counter(), line) for line in lines), start)


def consume_timed_sse(lines: Iterable[tuple[float, bytes | str]], start: float) -> StreamTimings:
    """Time every content chunk of an OpenAI stream given ``(arrival, line)`` pairs."""
    timings = StreamTimings(start=start)
    chunks = 0
    last = start
    for now, raw in lines:
        last = now
        line = raw.decode() if isinstance(raw, bytes) else raw
        line = line.strip()
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            break
        event = json.loads(data)
        timings.events.append(event)
        if "error" in event:
            timings.error = str(event["error"])
            break
        for choice in event.get("choices") or ():
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or {}).get("content")
            if piece:
                if timings.first_token is None:
                    timings.first_token = now
                timings.token_times.append(now)
                timings.text += piece
                chunks += 1
            if choice.get("finish_reason"):
                timings.finish_reason = choice["finish_reason"]
        usage = event.get("usage")
        if usage:
            timings.output_tokens = int(usage.get("completion_tokens") or 0)
            timings.prompt_tokens = int(usage.get("prompt_tokens") or 0)
    timings.end = last
    timings.chunks = chunks
    if not timings.output_tokens:
        timings.output_tokens = chunks
    return timings
