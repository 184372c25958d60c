"""Deterministic synthetic workloads: token-id prompts of exact input length, seeded."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """Input/output lengths and the seed that fixes every prompt."""

    input_len: int = 512
    output_len: int = 64
    seed: int = 0
    vocab_low: int = 100  # keeps clear of special tokens
    vocab_high: int = 4000


def prompt_ids(workload: Workload, index: int) -> list[int]:
    """The ``index``-th prompt of ``workload`` as token ids; same inputs give the same ids.

    Token ids rather than text make the input length exact whatever the tokenizer, and the
    OpenAI completions API takes them as ``prompt``.
    """
    rng = random.Random(f"{workload.seed}:{index}")
    low, high = workload.vocab_low, workload.vocab_high
    return [rng.randrange(low, high) for _ in range(workload.input_len)]


def completion_body(model: str, workload: Workload, index: int, stream: bool = True) -> dict:
    """An OpenAI ``/v1/completions`` body producing exactly ``output_len`` tokens."""
    body = {
        "model": model,
        "prompt": prompt_ids(workload, index),
        "max_tokens": workload.output_len,
        # ignore_eos alone fixes the length; min_tokens would break the one-token prefill
        # leg of P/D proxies that forward it (vLLM rejects min_tokens > max_tokens).
        "ignore_eos": True,
        "temperature": 0.0,
        # Random-weight test models can emit special tokens; shown as text they still
        # count as the content tokens TTFT is measured from.
        "skip_special_tokens": False,
        "stream": stream,
    }
    if stream:
        body["stream_options"] = {"include_usage": True}
    return body
