"""The history cost model (common/history_cost.py) and the prefill's meter of its inputs
(services/engine/cost_meter.py, read from a real exposition by the heartbeat's parser)."""

from __future__ import annotations

import pytest

from kvpush.common.history_cost import HistoryChoice, choose
from kvpush.services.engine.cost_meter import CostMeter, Counters
from kvpush.services.engine.status import parse_metrics, read_counters


@pytest.mark.parametrize(("tokens", "rate", "wait", "explore", "choice"), [
    (1000, 2000.0, 100.0, False, HistoryChoice.PUSH),  # 500 ms of compute saved
    (1000, 20_000.0, 100.0, False, HistoryChoice.SLOWER),  # 50 ms: the wait is longer
    (1000, 20_000.0, 100.0, True, HistoryChoice.EXPLORE),
    (1000, 0.0, 100.0, False, HistoryChoice.UNMEASURED),
    (1000, 2000.0, 0.0, False, HistoryChoice.UNMEASURED),
    (100, 2000.0, 10.0, False, HistoryChoice.SHORT),  # under the floor: never pushed
    (0, 2000.0, 10.0, True, HistoryChoice.SHORT),
])
def test_a_history_is_pushed_when_its_compute_outlasts_the_wait(
        tokens: int, rate: float, wait: float, explore: bool, choice: HistoryChoice) -> None:
    cost = choose(tokens, least_tokens=256, prefill_tok_s=rate, wait_ms=wait, explore=explore)
    assert cost.choice is choice
    assert cost.choice.pushes == (choice in (HistoryChoice.PUSH, HistoryChoice.UNMEASURED,
                                             HistoryChoice.EXPLORE))
    assert cost.recompute_ms == (round(tokens / rate * 1000, 3) if rate else 0.0)
    assert cost.wait_ms == wait and cost.tokens == tokens


def _fed(points: list[tuple[int, float, int]]) -> CostMeter:
    """A meter fed cumulative counters growing by (requests, tokens per request, seconds
    per request) per heartbeat."""
    m = CostMeter()
    c = Counters()
    m.feed(c)
    for n, tokens, seconds in points:
        c = Counters(c.prefill_requests + n, c.prefill_tokens + n * tokens,
                     c.prefill_s + n * seconds)
        m.feed(c)
    return m


def test_the_prefill_rate_is_the_marginal_one_not_the_mean() -> None:
    # 20 ms per request plus 1 ms per 10 tokens: 10,000 tokens/s past the step's fixed cost.
    shapes = [(100, 0.03), (2000, 0.22), (300, 0.05), (1500, 0.17)]
    m = _fed([(2, t, s) for t, s in shapes * 3])
    assert m.prefill_tok_s == 10_000
    # Tails of one length only: no slope to fit, the mean rate (an understatement).
    assert _fed([(1, 100, 0.03)] * 5).prefill_tok_s == round(100 / 0.03)
    assert CostMeter().prefill_tok_s == 0 and _fed([]).prefill_tok_s == 0


def test_a_restart_starts_the_measure_again_and_waits_are_smoothed() -> None:
    m = _fed([(1, 1000, 0.5)] * 3)
    assert m.prefill_tok_s == 2000
    m.feed(Counters())  # the engine restarted: its counters went back to 0
    assert m.prefill_tok_s == 0
    m = CostMeter()
    m.feed(Counters())
    m.feed(Counters(history_receives=2, history_wait_s=0.2))  # 100 ms each
    assert m.history_wait_ms == 100
    m.feed(Counters(history_receives=3, history_wait_s=0.6))  # one of 400 ms
    assert m.history_wait_ms == 190  # 0.7 * 100 + 0.3 * 400
    m.feed(Counters(history_receives=3, history_wait_s=0.6))  # none since: unchanged
    assert m.history_wait_ms == 190


METRICS = """\
# TYPE vllm:request_prefill_time_seconds histogram
vllm:request_prefill_time_seconds_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:request_prefill_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:request_prefill_time_seconds_sum{engine="0",model_name="m"} 0.8
# TYPE vllm:request_prefill_kv_computed_tokens histogram
vllm:request_prefill_kv_computed_tokens_bucket{engine="0",le="+Inf",model_name="m"} 4.0
vllm:request_prefill_kv_computed_tokens_count{engine="0",model_name="m"} 4.0
vllm:request_prefill_kv_computed_tokens_sum{engine="0",model_name="m"} 1600.0
# TYPE kvpush_kv_history_wait_seconds histogram
kvpush_kv_history_wait_seconds_bucket{engine="0",le="+Inf",model_name="m"} 2.0
kvpush_kv_history_wait_seconds_count{engine="0",model_name="m"} 2.0
kvpush_kv_history_wait_seconds_sum{engine="0",model_name="m"} 0.3
"""


def test_the_counters_come_from_the_engines_series() -> None:
    assert read_counters(parse_metrics(METRICS)) == Counters(4.0, 1600.0, 0.8, 2.0, 0.3)
    assert read_counters([]) == Counters()
