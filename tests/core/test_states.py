"""Request state machines: the transition tables, illegal moves, clock-driven timeouts."""

from __future__ import annotations

import pytest

from sgl_pd.core.clock import ManualClock, SystemClock
from sgl_pd.core.errors import (
    ClockError,
    DuplicateRequest,
    IllegalTransition,
    StateError,
    UnknownRequest,
)
from sgl_pd.core.states import (
    DECODE_TABLE,
    PREFILL_TABLE,
    DecodeState,
    PrefillState,
    RequestTracker,
    S,
    TransitionTable,
)

D, P = DecodeState, PrefillState


def _check_table(table: TransitionTable[S], enum_cls: type[S], fails: set[S]) -> None:
    assert set(table.allowed) == set(enum_cls)
    for state, nexts in table.allowed.items():
        if not table.is_final(state):
            assert fails <= nexts
    assert all(table.is_final(f) for f in fails)


def test_tables_are_complete_and_failures_reach_from_every_live_state() -> None:
    _check_table(DECODE_TABLE, D, {D.FAILED, D.ABORTED, D.TIMED_OUT})
    _check_table(PREFILL_TABLE, P, {P.FAILED, P.ABORTED, P.TIMED_OUT})


def test_decode_happy_path_and_illegal_moves() -> None:
    t = RequestTracker(DECODE_TABLE, {}, ManualClock())
    t.add(7)
    for s in (D.REQUESTED, D.TRANSFERRING, D.COMPLETE, D.HANDED_OFF):
        t.transition(7, s)
    assert t.state(7) is D.HANDED_OFF
    with pytest.raises(IllegalTransition, match="final"):
        t.transition(7, D.FAILED)
    t.add(8)
    with pytest.raises(IllegalTransition, match="ALLOCATED -> COMPLETE"):
        t.transition(8, D.COMPLETE)
    with pytest.raises(DuplicateRequest):
        t.add(8)
    assert t.forget(7) is D.HANDED_OFF and 7 not in t and len(t) == 1
    with pytest.raises(UnknownRequest):
        t.state(7)


def test_prefill_happy_path_and_no_way_back() -> None:
    t = RequestTracker(PREFILL_TABLE, {}, ManualClock())
    t.add(1)
    for s in (P.READY, P.SENDING, P.DONE):
        t.transition(1, s)
    t.add(2)
    t.transition(2, P.ABORTED)
    with pytest.raises(IllegalTransition):
        t.transition(2, P.READY)


def test_timeouts_follow_the_injected_clock() -> None:
    clock = ManualClock(100.0)
    t = RequestTracker(DECODE_TABLE, {D.REQUESTED: 5.0, D.TRANSFERRING: 2.0}, clock)
    for rid in (1, 2, 3):
        t.add(rid)
    t.transition(1, D.REQUESTED)
    t.transition(2, D.REQUESTED)
    clock.advance(4.0)
    t.transition(2, D.TRANSFERRING)  # entering a state restarts its deadline
    assert t.poll_timeouts() == []
    clock.advance(2.5)
    expired = t.poll_timeouts()
    assert [(e.request_id, e.state) for e in expired] == [(1, D.REQUESTED), (2, D.TRANSFERRING)]
    assert expired[0].waited_s == pytest.approx(6.5)
    assert t.state(1) is D.TIMED_OUT and t.state(3) is D.ALLOCATED  # no deadline there
    assert t.poll_timeouts() == []  # reported once


def test_bad_deadlines_and_clocks() -> None:
    with pytest.raises(StateError):
        RequestTracker(DECODE_TABLE, {D.HANDED_OFF: 1.0}, ManualClock())
    with pytest.raises(StateError):
        RequestTracker(DECODE_TABLE, {D.REQUESTED: 0.0}, ManualClock())
    with pytest.raises(ClockError):
        ManualClock().advance(-1)
    a = SystemClock().monotonic()
    assert SystemClock().monotonic() >= a
