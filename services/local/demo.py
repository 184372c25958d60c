"""``kvpush demo``: a local P/D stack, a few streamed requests with TTFT/TPOT/KV bytes, teardown."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from kvpush.loadtest.sse_metrics import consume_sse

logger = logging.getLogger(__name__)


class CompletionFailed(RuntimeError):
    """The server answered a completion request with an error."""


@dataclass
class StreamResult:
    """One streamed completion as the client saw it."""

    text: str = ""
    chunks: int = 0
    ttft_s: float = 0.0
    total_s: float = 0.0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reason: str | None = None
    events: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first."""
        n = max(self.completion_tokens, self.chunks)
        return (self.total_s - self.ttft_s) / (n - 1) if n > 1 else 0.0


def stream_completion(
    url: str, body: dict[str, Any], timeout_s: float = 300.0, path: str = "/v1/completions"
) -> StreamResult:
    """POST ``body`` with ``stream: true`` and read the SSE stream to the end."""
    req = {**body, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    with httpx.Client(timeout=timeout_s) as client, client.stream(
        "POST", f"{url}{path}", json=req
    ) as resp:
        if resp.status_code != 200:
            resp.read()
            raise CompletionFailed(f"{resp.status_code}: {resp.text[:500]}")
        t = consume_sse(resp.iter_lines(), start)
    if t.error is not None:
        raise CompletionFailed(f"error event in the stream: {t.error}")
    return StreamResult(
        text=t.text, chunks=t.chunks, ttft_s=t.ttft or 0.0, total_s=(t.end or start) - start,
        completion_tokens=t.output_tokens,
        prompt_tokens=t.prompt_tokens, finish_reason=t.finish_reason, events=t.events,
    )


def complete(url: str, body: dict[str, Any], timeout_s: float = 300.0) -> dict[str, Any]:
    """POST a non-streaming ``/v1/completions`` request and return the JSON answer."""
    resp = httpx.post(f"{url}/v1/completions", json={**body, "stream": False}, timeout=timeout_s)
    if resp.status_code != 200:
        raise CompletionFailed(f"{resp.status_code}: {resp.text[:500]}")
    return resp.json()


DEMO_PROMPTS = [
    "def fibonacci(n):\n    ",
    "class Stack:\n    def __init__(self):\n        ",
    " ".join(f"import module_{i}" for i in range(60)) + "\n\ndef main():\n    ",
]


@dataclass
class TransferFigures:
    """KV that reached the decode engine over NIXL during one request."""

    external_tokens: int
    nixl_bytes: int | None
    """Bytes from the NIXL byte histogram on the engine that posted the transfer, if any."""
    estimated_bytes: int
    """``external_tokens`` x the model's KV bytes per token."""


def _transfer_counters(decode_url: str, prefill_url: str | None) -> tuple[float, float]:
    from kvpush.services.engine.status import metric_sum, scrape

    d = scrape(decode_url)
    tokens = metric_sum(d, "vllm:prompt_tokens_by_source_total", source="external_kv_transfer")
    # Pull posts READs on decode, stock push and kvpush post WRITEs on prefill: count all.
    nixl = metric_sum(d, "vllm:nixl_bytes_transferred_sum")
    if prefill_url:
        p = scrape(prefill_url)
        nixl += metric_sum(p, "vllm:nixl_bytes_transferred_sum")
        nixl += metric_sum(p, "kvpush_kv_bytes_pushed_total")
    return tokens, nixl


def run_demo(
    connector: str | None = None,
    requests: int = 3,
    max_tokens: int = 32,
    settings: Any = None,
) -> int:
    """Bring the stack up, stream ``requests`` completions, print the figures, stop."""
    from kvpush.services.local.models import model_spec
    from kvpush.services.local.stack import LocalStack, stack_settings

    # Unset: the stack's own default (the kvpush push path, or KVPUSH_STACK_CONNECTOR).
    settings = settings or stack_settings(connector=connector)
    kv_per_token = model_spec(settings.stack_model).kv_bytes_per_token
    print(f"kvpush demo: starting a local stack ({settings.stack_connector}, "
          f"model {settings.stack_model}); engines take ~1 min to boot on CPU", flush=True)
    t0 = time.monotonic()
    with LocalStack(settings) as stack:
        prefill_url = stack.prefill.url if stack.prefill else None
        print(f"stack up in {time.monotonic() - t0:.0f}s: {stack.url} "
              f"(prefill {prefill_url}, decode {stack.decode.url}, connector {stack.connector})")
        print(f"{'#':>2} {'prompt tok':>10} {'out tok':>7} {'TTFT ms':>8} {'TPOT ms':>8} "
              f"{'KV tokens in':>12} {'NIXL bytes':>11}  text")
        failures = 0
        for i in range(requests):
            prompt = DEMO_PROMPTS[i % len(DEMO_PROMPTS)]
            before = _transfer_counters(stack.decode.url, prefill_url)
            try:
                res = stream_completion(stack.url, {
                    "model": stack.decode.spec.served_model_name, "prompt": prompt,
                    "max_tokens": max_tokens, "temperature": 0.0,
                })
            except (CompletionFailed, httpx.HTTPError) as exc:
                failures += 1
                print(f"{i:>2} request failed: {exc}")
                continue
            # Metrics are published asynchronously by the engine; give them a moment.
            after = before
            for _ in range(20):
                after = _transfer_counters(stack.decode.url, prefill_url)
                if after != before or stack.connector == "none":
                    break
                time.sleep(0.25)
            fig = TransferFigures(
                external_tokens=int(after[0] - before[0]),
                nixl_bytes=int(after[1] - before[1]) if after[1] > before[1] else None,
                estimated_bytes=int(after[0] - before[0]) * kv_per_token,
            )
            if fig.nixl_bytes is not None:
                nixl = f"{fig.nixl_bytes:>11d}"
            else:
                # No NIXL byte counter on this path (kvpush): tokens x KV bytes per token.
                nixl = f"{'~' + str(fig.estimated_bytes):>11s}"
            print(f"{i:>2} {res.prompt_tokens:>10d} {res.completion_tokens:>7d} "
                  f"{res.ttft_s * 1000:>8.1f} {res.tpot_s * 1000:>8.2f} "
                  f"{fig.external_tokens:>12d} {nixl}  {json.dumps(res.text[:40])}")
        print(f"NIXL bytes: vllm:nixl_bytes_transferred_sum (stock) or "
              f"kvpush_kv_bytes_pushed_total (kvpush) on the engines, whole KV blocks; "
              f"'~N' = KV tokens x {kv_per_token} B/token where no byte counter exists.")
    print("stack stopped")
    return 1 if failures else 0
