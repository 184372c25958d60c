"""Scheduler-side transfer state machines: every order of events, aborts and deadlines."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvpush.connector.state import (
    Action,
    DecodeState,
    DecodeTransfer,
    PrefillState,
    PrefillTransfer,
)

# Events that can reach the prefill scheduler side from outside, in any order and
# any number of times, except `finished`, which vLLM calls exactly once.
PREFILL_EVENTS = ["target", "cancel", "deadline"]


def _apply_prefill(m: PrefillTransfer, event: str, log: list[tuple[str, object]]) -> None:
    if event == "target":
        out = m.on_target()
    elif event == "cancel":
        out = m.on_cancel()
    elif event == "deadline":
        out = m.on_deadline()
    elif event == "finished_ok":
        out = m.on_finished(ok=True)
    elif event == "finished_abort":
        out = m.on_finished(ok=False)
    else:
        raise AssertionError(event)
    log.append((event, out))


def _worker_would_finish(actions: set[Action]) -> bool:
    """The worker reports a held request done once told to push, cancel or release."""
    return bool(actions & {Action.SEND_TARGET, Action.CANCEL_PUSH, Action.RELEASE_BLOCKS})


def _run_prefill(events: list[str]) -> tuple[PrefillTransfer, list[tuple[str, object]]]:
    m = PrefillTransfer()
    log: list[tuple[str, object]] = []
    for e in events:
        _apply_prefill(m, e, log)
    return m, log


@st.composite
def prefill_sequences(draw: st.DrawFn) -> list[str]:
    others = draw(st.lists(st.sampled_from(PREFILL_EVENTS), max_size=6))
    pos = draw(st.integers(0, len(others)))
    finish = draw(st.sampled_from(["finished_ok", "finished_abort"]))
    return [*others[:pos], finish, *others[pos:]]


@settings(max_examples=400, deadline=None)
@given(prefill_sequences())
def test_prefill_never_leaks_blocks_in_any_order(events: list[str]) -> None:
    # A deadline always comes eventually; it must leave no held block without a way out.
    m, log = _run_prefill([*events, "deadline"])
    actions = {a for _, out in log for a in out.actions}
    held = [out.hold_blocks for e, out in log if e.startswith("finished")]
    assert len(held) == 1
    if held[0]:
        assert m.holds_blocks
        assert _worker_would_finish(actions), (events, m.history)
        assert m.on_worker_done().state is PrefillState.DONE
    else:
        assert m.state.terminal
        assert not m.holds_blocks


@settings(max_examples=400, deadline=None)
@given(prefill_sequences())
def test_prefill_target_sent_at_most_once_and_never_after_cancel(events: list[str]) -> None:
    _, log = _run_prefill(events)
    sent = [i for i, (_, out) in enumerate(log) if Action.SEND_TARGET in out.actions]
    assert len(sent) <= 1
    stops = [i for i, (e, _) in enumerate(log) if e in ("cancel", "deadline")]
    if sent and stops:
        assert sent[0] < stops[0]
    aborts = [i for i, (e, _) in enumerate(log) if e == "finished_abort"]
    if sent and aborts:
        assert sent[0] < aborts[0]


def test_prefill_all_permutations_of_one_each() -> None:
    """Exhaustive: each event once, in every order, with both kinds of finish."""
    for finish in ("finished_ok", "finished_abort"):
        for perm in itertools.permutations([*PREFILL_EVENTS, finish]):
            _, log = _run_prefill(list(perm))
            fin = next(out for e, out in log if e.startswith("finished"))
            actions = {a for _, out in log for a in out.actions}
            if fin.hold_blocks:
                assert _worker_would_finish(actions), perm
            # Deadline before the target arrives: nothing is ever pushed.
            if perm.index("deadline") < perm.index("target"):
                assert Action.SEND_TARGET not in actions


def test_prefill_target_then_finish_pushes_and_holds() -> None:
    m = PrefillTransfer()
    assert m.on_target().actions == (Action.SEND_TARGET,)
    out = m.on_finished(ok=True)
    assert out.hold_blocks and out.state is PrefillState.DRAINING
    assert m.on_worker_done().state is PrefillState.DONE
    # Late events after completion change nothing.
    assert m.on_deadline().actions == () and m.on_cancel().actions == ()
    assert m.state is PrefillState.DONE


def test_prefill_finish_before_target_holds_until_target() -> None:
    m = PrefillTransfer()
    out = m.on_finished(ok=True)
    assert out.hold_blocks and out.state is PrefillState.HELD
    out = m.on_target()
    assert out.actions == (Action.SEND_TARGET,) and out.state is PrefillState.DRAINING


def test_prefill_held_past_deadline_releases_blocks() -> None:
    m = PrefillTransfer()
    m.on_finished(ok=True)
    out = m.on_deadline()
    assert out.actions == (Action.RELEASE_BLOCKS,)
    assert m.on_target().actions == ()  # too late: never pushed


def test_prefill_expired_while_running_frees_at_finish() -> None:
    m = PrefillTransfer()
    assert m.on_deadline().state is PrefillState.EXPIRED
    out = m.on_finished(ok=True)
    assert not out.hold_blocks and m.state is PrefillState.EXPIRED


def test_prefill_abort_while_pushing_cancels_and_holds_for_inflight_writes() -> None:
    m = PrefillTransfer()
    m.on_target()
    out = m.on_finished(ok=False)
    assert out.hold_blocks and Action.CANCEL_PUSH in out.actions


def test_prefill_abort_before_target_frees_at_once() -> None:
    m = PrefillTransfer()
    out = m.on_finished(ok=False)
    assert not out.hold_blocks and out.state is PrefillState.ABORTED


def test_prefill_finished_twice_logs_and_keeps_the_blocks_held(
        caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's scheduler dies on any exception: a second finish is absorbed, and the
    blocks the worker may still be reading stay held."""
    m = PrefillTransfer()
    m.on_target()
    m.on_finished(ok=True)
    out = m.on_finished(ok=True)
    assert out.state is PrefillState.DRAINING and out.hold_blocks and out.actions == ()
    assert "request_finished twice" in caplog.text
    assert m.on_worker_done().state is PrefillState.DONE


# -- decode -------------------------------------------------------------------------------

DECODE_EVENTS = ["allocated", "recv_ok", "recv_fail", "finished"]


def _apply_decode(m: DecodeTransfer, event: str) -> tuple[Action, ...]:
    if event == "allocated":
        return m.on_allocated().actions
    if event == "recv_ok":
        return m.on_recv_done(ok=True).actions
    if event == "recv_fail":
        return m.on_recv_done(ok=False).actions
    if event == "finished":
        return m.on_finished().actions
    raise AssertionError(event)


@st.composite
def decode_sequences(draw: st.DrawFn) -> list[str]:
    """vLLM's order: allocation (maybe), at most one receive result, one finish."""
    allocated = draw(st.booleans())
    seq = ["allocated"] if allocated else []
    recv = draw(st.sampled_from([None, "recv_ok", "recv_fail"])) if allocated else None
    recv_after_finish = draw(st.booleans())
    if recv and not recv_after_finish:
        seq.append(recv)
    seq.append("finished")
    if recv and recv_after_finish:
        seq.append(recv)
    # Noise: duplicates from racing threads must be absorbed.
    noise = draw(st.lists(st.sampled_from(DECODE_EVENTS[:3]), max_size=3))
    return seq + noise


@settings(max_examples=400, deadline=None)
@given(decode_sequences())
def test_decode_reservation_released_exactly_once(events: list[str]) -> None:
    m = DecodeTransfer()
    actions: list[Action] = []
    for e in events:
        actions.extend(_apply_decode(m, e))
    assert actions.count(Action.RELEASE_RESERVATION) == 1
    allocated_first = "allocated" in events and events.index("allocated") < events.index(
        "finished"
    )
    assert actions.count(Action.PUBLISH_TARGET) == (1 if allocated_first else 0)
    # Prefill is told to stop whenever decode ends without the KV.
    got_kv = "recv_ok" in events and events.index("recv_ok") < events.index("finished")
    if not got_kv:
        assert Action.PUBLISH_CANCEL in actions


def test_decode_abort_while_receiving_waits_for_push_to_stop() -> None:
    m = DecodeTransfer()
    m.on_allocated()
    out = m.on_finished()
    assert out.state is DecodeState.ABANDONED
    assert Action.ABANDON_RECV in out.actions and Action.PUBLISH_CANCEL in out.actions
    assert m.on_recv_done(ok=True).state is DecodeState.DONE


def test_decode_happy_path() -> None:
    m = DecodeTransfer()
    assert m.on_allocated().actions == (Action.PUBLISH_TARGET,)
    assert m.on_recv_done(ok=True).state is DecodeState.RECEIVED
    assert m.on_finished().actions == (Action.RELEASE_RESERVATION,)
    assert m.state.terminal


def test_decode_failed_push_tells_prefill_and_releases() -> None:
    m = DecodeTransfer()
    m.on_allocated()
    assert m.on_recv_done(ok=False).actions == (Action.PUBLISH_CANCEL,)
    assert m.on_finished().actions == (Action.RELEASE_RESERVATION,)
