"""A real model answers in real language through P/D: ``kvpush eval``'s questions, asked of
SmolLM2-135M-Instruct through a kvpush P/D stack and of one engine alone, are all answered
right both ways, every P/D answer over pushed KV.

It boots a stack of its own: no other test serves the real model (the suite's stacks serve
the random-weight ``tiny``, which boots and answers faster but says nothing checkable).
One engine alone is the stack's decode engine asked directly, without the push: it then
computes the prompt itself, as a colocated engine does.

What it does not assert: that every answer is the same text both ways. Decode computes the
last prompt token itself over the pushed KV, where one engine alone computed it inside the
prompt's forward pass, so near-tied tokens can go either way; the
count of equal answers is printed with the run (docs/openai-api.md says why).
"""

from __future__ import annotations

import httpx
import pytest

from kvpush.loadtest.eval_set import QUESTIONS
from kvpush.loadtest.evaluate import compare, run, score
from kvpush.services.engine.status import metric_sum, scrape
from kvpush.services.local.stack import LocalStack, engine_settings, stack_settings
from tests.e2e_util import free_port_pair

MODEL = "smollm2-135m"


@pytest.mark.slow
def test_every_question_is_answered_right_through_pd_as_by_one_engine(tmp_path, redis_url):
    settings = stack_settings(connector="kvpush", model=MODEL, port=free_port_pair(),
                              prefill_port=free_port_pair(),
                              decode_port=free_port_pair()).model_copy(
        update={"redis_url": redis_url, "run_dir": tmp_path / "run"})
    with LocalStack(settings, engine_settings=engine_settings(kv_cache_gib=0.5)) as stack:
        assert stack.prefill is not None
        assert httpx.get(f"{stack.url}/v1/models").json()["data"][0]["id"] == MODEL
        pushes = metric_sum(scrape(stack.prefill.url), "kvpush_kv_transfers_total",
                            outcome="ok")
        through_pd = run(stack.url, MODEL)
        pushed = metric_sum(scrape(stack.prefill.url), "kvpush_kv_transfers_total",
                            outcome="ok") - pushes
        alone = run(stack.decode.url, MODEL, api_key=stack.engine_api_key)
    cmp = compare(through_pd, alone)
    print(f"P/D {score(through_pd)}/{len(QUESTIONS)}, one engine {score(alone)}/"
          f"{len(QUESTIONS)}; equal answers {cmp.equal_answers}; largest logprob "
          f"difference {cmp.max_logprob_diff:.3g} over {cmp.compared_tokens} tokens")
    wrong = [(a.question, a.text) for a in through_pd if not a.correct]
    assert not wrong, wrong
    assert score(alone) == len(QUESTIONS), [(a.question, a.text) for a in alone
                                            if not a.correct]
    # Every answer through P/D came over pushed KV, not from prefill or decode alone.
    assert pushed >= len(QUESTIONS), pushed
