"""``kvpush eval``: short questions with checkable answers, asked of any OpenAI endpoint
with greedy sampling; with ``--against`` a second endpoint answers the same questions and
the two are compared answer for answer and logprob for logprob.

An operator runs it against their own fleet (P/D through its gateway against one
colocated engine); the suite runs it through kvpush's P/D against a colocated engine of
the same model. A score counts answers that contain an accepted answer as a word
(case-insensitive), so phrasing is free but the fact must be there.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvpush.loadtest.eval_set import QUESTIONS, Question


class EvalFailed(RuntimeError):
    """An endpoint did not answer a question (HTTP error, malformed body)."""


@dataclass
class Answer:
    """One endpoint's answer to one question."""

    question: str
    text: str
    correct: bool
    tokens: list[str] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)


@dataclass
class Comparison:
    """Two endpoints' answers side by side."""

    equal_answers: int
    differing: list[tuple[str, str, str]]  # (question, this answer, the other's)
    max_logprob_diff: float  # over the tokens both generated alike, from the start
    compared_tokens: int


def is_correct(text: str, accepted: tuple[str, ...]) -> bool:
    """Whether ``text`` holds one of ``accepted`` as a whole word or phrase."""
    return any(re.search(rf"(?<!\w){re.escape(a)}(?!\w)", text, re.IGNORECASE)
               for a in accepted)


def ask(client: httpx.Client, url: str, model: str, q: Question, max_tokens: int,
        api_key: str | None = None, stream: bool = False) -> Answer:
    """Ask one question (chat, greedy, with the generated tokens' logprobs), streamed or
    not."""
    body = {"model": model, "messages": [{"role": "user", "content": q.text}],
            "max_tokens": max_tokens, "temperature": 0, "logprobs": True, "stream": stream}
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        with client.stream("POST", f"{url}/v1/chat/completions", json=body,
                           headers=headers) as resp:
            if resp.status_code != 200:
                raise EvalFailed(f"{url} answered {resp.status_code}: "
                                 f"{resp.read()[:300]!r}")
            if stream:
                parts = _streamed(resp)
            else:
                resp.read()
                parts = [resp.json()]
    except (httpx.HTTPError, ValueError) as exc:
        raise EvalFailed(f"{url}: {exc}") from exc
    text, tokens, logprobs = "", [], []
    try:
        for part in parts:
            for choice in part["choices"]:
                msg = choice["delta"] if stream else choice["message"]
                text += msg.get("content") or ""
                content = (choice.get("logprobs") or {}).get("content") or []
                tokens += [str(t["token"]) for t in content]
                logprobs += [float(t["logprob"]) for t in content]
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise EvalFailed(f"{url}: malformed answer: {exc}") from exc
    return Answer(q.text, text, is_correct(text, q.accepted), tokens, logprobs)


def _streamed(resp: httpx.Response) -> list[dict[str, Any]]:
    """The chunks of an SSE answer up to [DONE]."""
    chunks = []
    for line in resp.iter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return chunks
        chunk = json.loads(line[6:])
        if "error" in chunk:
            raise EvalFailed(f"error event: {line[:300]}")
        chunks.append(chunk)
    raise EvalFailed("the stream ended without [DONE]")


def run(url: str, model: str, questions: tuple[Question, ...] = QUESTIONS,
        max_tokens: int = 24, concurrency: int = 1, timeout_s: float = 120.0,
        api_key: str | None = None, stream: bool = False) -> list[Answer]:
    """Every question's answer from ``url``, in question order. One at a time by default:
    a batch's composition changes an engine's numerics, so two endpoints compare alike
    only when each answers alone."""
    with httpx.Client(timeout=timeout_s) as client, ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(
            lambda q: ask(client, url, model, q, max_tokens, api_key, stream), questions))


def compare(ours: list[Answer], theirs: list[Answer]) -> Comparison:
    """Answers compared one for one; logprobs over each pair's common leading tokens."""
    differing = [(a.question, a.text, b.text) for a, b in zip(ours, theirs, strict=True)
                 if a.text != b.text]
    worst, n = 0.0, 0
    for a, b in zip(ours, theirs, strict=True):
        for ta, tb, la, lb in zip(a.tokens, b.tokens, a.logprobs, b.logprobs, strict=False):
            if ta != tb:
                break
            worst = max(worst, abs(la - lb))
            n += 1
    return Comparison(len(ours) - len(differing), differing, worst, n)


def score(answers: list[Answer]) -> int:
    """Correct answers."""
    return sum(a.correct for a in answers)


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Flags of ``kvpush eval``."""
    p.add_argument("--url", required=True, help="the endpoint to evaluate (OpenAI API)")
    p.add_argument("--model", required=True, help="model name the endpoint serves")
    p.add_argument("--against", default=None,
                   help="a second endpoint serving the same model (e.g. one colocated "
                        "engine): answers and logprobs are compared")
    p.add_argument("--api-key", default=None, help="bearer token for --url")
    p.add_argument("--against-api-key", default=None, help="bearer token for --against")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--stream", action="store_true", help="ask with stream: true")
    p.add_argument("--concurrency", type=int, default=1,
                   help="questions in flight at once (1: comparable answers)")
    p.add_argument("--logprob-tol", type=float, default=1e-6,
                   help="largest logprob difference accepted between the endpoints")
    p.add_argument("--json", type=Path, default=None, help="write every answer here")


def run_from_args(args: argparse.Namespace) -> int:
    """Entry of ``kvpush eval``: 0 when every answer was got (and, with ``--against``,
    both endpoints answered alike within the tolerance), 1 otherwise, 2 on an error."""
    try:
        ours = run(args.url, args.model, max_tokens=args.max_tokens,
                   concurrency=args.concurrency, api_key=args.api_key, stream=args.stream)
        theirs = (run(args.against, args.model, max_tokens=args.max_tokens,
                      concurrency=args.concurrency, api_key=args.against_api_key)
                  if args.against else None)
    except EvalFailed as exc:
        print(f"kvpush eval: {exc}", file=sys.stderr)
        return 2
    print(f"{args.url}: {score(ours)}/{len(ours)} correct")
    report: dict[str, Any] = {"url": args.url, "score": score(ours),
                              "answers": [asdict(a) for a in ours]}
    ok = True
    if theirs is not None:
        cmp = compare(ours, theirs)
        print(f"{args.against}: {score(theirs)}/{len(theirs)} correct")
        print(f"equal answers {cmp.equal_answers}/{len(ours)}; largest logprob difference "
              f"{cmp.max_logprob_diff:.3g} over {cmp.compared_tokens} tokens")
        for q, a, b in cmp.differing:
            print(f"  differs: {q!r}: {a!r} / {b!r}")
        report["against"] = {"url": args.against, "score": score(theirs),
                             "answers": [asdict(a) for a in theirs],
                             "comparison": asdict(cmp)}
        ok = (not cmp.differing and score(ours) == score(theirs)
              and cmp.max_logprob_diff <= args.logprob_tol)
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1))
    return 0 if ok else 1
