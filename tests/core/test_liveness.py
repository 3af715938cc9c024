"""Peer liveness: pings at the interval, a silent peer is declared dead once, after the
timeout and not before."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_pd.core.clock import ManualClock
from sgl_pd.core.errors import StateError
from sgl_pd.core.liveness import PeerLiveness


def _tracker(clock: ManualClock) -> PeerLiveness:
    return PeerLiveness(clock, interval_s=0.25, timeout_s=1.0)


def test_an_answering_peer_is_pinged_at_the_interval_and_never_dead() -> None:
    clock = ManualClock()
    live = _tracker(clock)
    pings = []
    for _ in range(40):  # 10 s
        tick = live.tick(["a"])
        assert tick.dead == ()
        for endpoint, _seq in tick.pings:
            live.heard(endpoint)
        pings += tick.pings
        clock.advance(0.25)
    assert [seq for _, seq in pings] == list(range(1, 41))


def test_a_silent_peer_is_dead_after_the_timeout_once() -> None:
    clock = ManualClock()
    live = _tracker(clock)
    assert live.tick(["a", "b"]).pings == (("a", 1), ("b", 1))
    clock.advance(0.9)
    live.heard("b")
    assert live.tick(["a", "b"]).dead == ()
    clock.advance(0.2)  # a: silent 1.1 s; b: 0.2 s
    assert live.tick(["a", "b"]).dead == ("a",)
    assert live.tick(["a", "b"]).dead == ()  # a is watched afresh, with a full timeout
    clock.advance(1.01)
    assert set(live.tick(["a", "b"]).dead) == {"a", "b"}


def test_peers_no_longer_active_are_forgotten() -> None:
    clock = ManualClock()
    live = _tracker(clock)
    live.tick(["a"])
    clock.advance(5.0)
    assert live.tick([]).dead == ()
    assert live.silence_s("a") is None
    assert live.tick(["a"]).dead == ()  # back again: a new grace period


def test_answers_from_unwatched_peers_are_ignored() -> None:
    clock = ManualClock()
    live = _tracker(clock)
    live.heard("x")
    assert live.silence_s("x") is None


@given(st.lists(st.tuples(st.floats(0.01, 0.6), st.booleans()), min_size=1, max_size=60))
def test_dead_exactly_when_silent_longer_than_the_timeout(steps: list[tuple[float, bool]]) -> None:
    clock = ManualClock()
    live = _tracker(clock)
    live.tick(["a"])
    last_heard = 0.0
    for dt, answers in steps:
        clock.advance(dt)
        tick = live.tick(["a"])
        silent = clock.monotonic() - last_heard
        assert (tick.dead == ("a",)) == (silent > 1.0)
        if tick.dead:
            last_heard = clock.monotonic()  # watched afresh
        elif answers:
            live.heard("a")
            last_heard = clock.monotonic()


def test_interval_must_be_below_the_timeout() -> None:
    with pytest.raises(StateError):
        PeerLiveness(ManualClock(), interval_s=1.0, timeout_s=1.0)
