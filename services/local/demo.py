"""``kvpush demo``: a local P/D stack, a few chat questions answered through it as they
stream, each with its TTFT, TPOT and KV bytes pushed and whether one engine alone answers
the same; teardown."""

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


# Chat questions a small instruction-tuned model answers; on a random-weight model the
# answers are noise, and the figures are still the point.
DEMO_QUESTIONS = [
    "What is the capital of France?",
    "How many days are in a week?",
    "Write a haiku about the sea.",
    "Explain in one sentence why the sky is blue.",
]


def stream_chat(url: str, model: str, question: str, max_tokens: int,
                echo: Any = None, timeout_s: float = 300.0) -> StreamResult:
    """Ask ``question`` (greedy) and read the answer as it streams, handing each piece of
    text to ``echo`` as it arrives."""
    body = {"model": model, "messages": [{"role": "user", "content": question}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    out = StreamResult()
    start = time.perf_counter()
    with httpx.Client(timeout=timeout_s) as client, client.stream(
            "POST", f"{url}/v1/chat/completions", json=body) as resp:
        if resp.status_code != 200:
            resp.read()
            raise CompletionFailed(f"{resp.status_code}: {resp.text[:500]}")
        for line in resp.iter_lines():
            if not line.startswith("data:") or line.strip() == "data: [DONE]":
                continue
            msg = json.loads(line[5:])
            if "error" in msg:
                raise CompletionFailed(f"error event in the stream: {msg['error']}")
            usage = msg.get("usage") or {}
            out.completion_tokens = usage.get("completion_tokens", out.completion_tokens)
            out.prompt_tokens = usage.get("prompt_tokens", out.prompt_tokens)
            for choice in msg.get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    if not out.text:
                        out.ttft_s = time.perf_counter() - start
                    out.text += piece
                    out.chunks += 1
                    if echo is not None:
                        echo(piece)
    out.total_s = time.perf_counter() - start
    return out


def ask_engine(url: str, model: str, question: str, max_tokens: int, api_key: str | None,
               timeout_s: float = 300.0) -> str:
    """The same question answered by one engine alone (colocated: it computes the prompt
    itself), greedy and unary."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.post(f"{url}/v1/chat/completions", headers=headers, timeout=timeout_s, json={
        "model": model, "messages": [{"role": "user", "content": question}],
        "max_tokens": max_tokens, "temperature": 0})
    if resp.status_code != 200:
        raise CompletionFailed(f"{resp.status_code}: {resp.text[:500]}")
    return str(resp.json()["choices"][0]["message"]["content"] or "")


def _pushed_bytes(prefill_url: str | None) -> float:
    """Bytes of KV (whole blocks) the prefill engine pushed so far: kvpush's counter, or
    the NIXL byte histogram the stock connectors and kvpush both export."""
    from kvpush.services.engine.status import metric_sum, scrape

    if not prefill_url:
        return 0.0
    p = scrape(prefill_url)
    return max(metric_sum(p, "kvpush_kv_bytes_pushed_total"),
               metric_sum(p, "vllm:nixl_bytes_transferred_sum"))


def run_demo(
    connector: str | None = None,
    requests: int = len(DEMO_QUESTIONS),
    max_tokens: int = 48,
    settings: Any = None,
) -> int:
    """Bring the stack up, ask a few chat questions through P/D and stream the answers,
    each with its figures and whether one colocated engine answers the same; stop."""
    from kvpush.services.local.models import MODELS
    from kvpush.services.local.stack import LocalStack, stack_settings

    # Unset: the stack's own default (the kvpush push path, or KVPUSH_STACK_CONNECTOR).
    settings = settings or stack_settings(connector=connector)
    spec = MODELS.get(settings.stack_model)
    what = f"{settings.stack_model} ({spec.origin})" if spec else settings.stack_model
    print(f"kvpush demo: starting a local P/D stack ({settings.stack_connector}, model "
          f"{what}); engines take about half a minute to boot on CPU", flush=True)
    t0 = time.monotonic()
    failures = 0
    with LocalStack(settings) as stack:
        prefill_url = stack.prefill.url if stack.prefill else None
        model = stack.decode.spec.served_model_name
        print(f"stack up in {time.monotonic() - t0:.0f} s: {stack.url} (prefill "
              f"{prefill_url}, decode {stack.decode.url}, connector {stack.connector})\n")
        for i in range(requests):
            question = DEMO_QUESTIONS[i % len(DEMO_QUESTIONS)]
            print(f"Q: {question}\nA: ", end="", flush=True)
            before = _pushed_bytes(prefill_url)
            try:
                res = stream_chat(stack.url, model, question, max_tokens,
                                  echo=lambda piece: print(piece, end="", flush=True))
                alone = ask_engine(stack.decode.url, model, question, max_tokens,
                                   stack.engine_api_key)
            except (CompletionFailed, httpx.HTTPError) as exc:
                failures += 1
                print(f"\n   request failed: {exc}\n")
                continue
            # The engine publishes its counters asynchronously: give them a moment.
            pushed = before
            for _ in range(20):
                pushed = _pushed_bytes(prefill_url)
                if pushed != before or stack.connector == "none":
                    break
                time.sleep(0.25)
            same = ("the same answer as one engine alone" if alone == res.text
                    else f"one engine alone answers: {json.dumps(alone[:60])}")
            print(f"\n   TTFT {res.ttft_s * 1000:.0f} ms, TPOT {res.tpot_s * 1000:.1f} ms, "
                  f"{res.prompt_tokens} prompt tokens, {(pushed - before) / 1e6:.2f} MB of KV "
                  f"pushed (whole blocks); {same}\n", flush=True)
    print("stack stopped")
    return 1 if failures else 0
