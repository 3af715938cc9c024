"""Peer liveness: pings at the interval; a silent peer is a suspect (probed, at most once
per interval) after `suspect_after_s` and hung, once, after the hang timeout and not
before; a frozen process notices its own gap."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_pd.core.clock import ManualClock
from sgl_pd.core.errors import StateError
from sgl_pd.core.liveness import FreezeWatch, PeerLiveness


def _tracker(clock: ManualClock) -> PeerLiveness:
    return PeerLiveness(clock, interval_s=0.25, suspect_after_s=0.5, hang_timeout_s=4.0)


def test_an_answering_peer_is_pinged_at_the_interval_and_never_suspect() -> None:
    clock = ManualClock()
    live = _tracker(clock)
    pings = []
    for _ in range(40):  # 10 s
        tick = live.tick(["a"])
        assert tick.hung == () and tick.suspects == ()
        for endpoint, _seq in tick.pings:
            live.heard(endpoint)
        pings += tick.pings
        clock.advance(0.25)
    assert [seq for _, seq in pings] == list(range(1, 41))


def test_a_silent_peer_is_probed_once_per_interval_then_hung_once() -> None:
    clock = ManualClock()
    live = _tracker(clock)
    assert live.tick(["a", "b"]).pings == (("a", 1), ("b", 1))
    clock.advance(0.4)
    assert live.tick(["a", "b"]).suspects == ()
    clock.advance(0.2)  # silent 0.6 s: both suspects
    assert live.tick(["a", "b"]).suspects == ("a", "b")
    live.heard("b")
    clock.advance(0.1)
    assert live.tick(["a", "b"]).suspects == ()  # a was probed 0.1 s ago, b answered
    clock.advance(0.15)
    assert live.tick(["a", "b"]).suspects == ("a",)
    clock.advance(3.5)  # a: silent 4.35 s
    tick = live.tick(["a"])
    assert tick.hung == ("a",) and tick.suspects == ()
    assert live.tick(["a"]).hung == ()  # watched afresh, with a full timeout
    clock.advance(4.01)
    assert live.tick(["a"]).hung == ("a",)


def test_a_peer_declared_lost_is_watched_afresh() -> None:
    clock = ManualClock()
    live = _tracker(clock)
    live.tick(["a"])
    clock.advance(1.0)
    assert live.tick(["a"]).suspects == ("a",)
    live.lost("a")
    assert live.silence_s("a") == 0.0
    clock.advance(0.3)
    assert live.tick(["a"]).suspects == ()


def test_peers_no_longer_active_are_forgotten() -> None:
    clock = ManualClock()
    live = _tracker(clock)
    live.tick(["a"])
    clock.advance(5.0)
    assert live.tick([]).hung == ()
    assert live.silence_s("a") is None
    assert live.tick(["a"]).hung == ()  # back again: a new grace period


def test_answers_from_unwatched_peers_are_ignored() -> None:
    clock = ManualClock()
    live = _tracker(clock)
    live.heard("x")
    assert live.silence_s("x") is None


@given(st.lists(st.tuples(st.floats(0.01, 1.5), st.booleans()), min_size=1, max_size=60))
def test_hung_exactly_when_silent_longer_than_the_timeout(steps: list[tuple[float, bool]]) -> None:
    clock = ManualClock()
    live = _tracker(clock)
    live.tick(["a"])
    last_heard = 0.0
    for dt, answers in steps:
        clock.advance(dt)
        tick = live.tick(["a"])
        silent = clock.monotonic() - last_heard
        assert (tick.hung == ("a",)) == (silent > 4.0)
        if tick.suspects:
            assert silent > 0.5
        if tick.hung:
            last_heard = clock.monotonic()  # watched afresh
        elif answers:
            live.heard("a")
            last_heard = clock.monotonic()


def test_thresholds_must_be_ordered() -> None:
    with pytest.raises(StateError):
        PeerLiveness(ManualClock(), interval_s=1.0, suspect_after_s=0.5, hang_timeout_s=4.0)
    with pytest.raises(StateError):
        PeerLiveness(ManualClock(), interval_s=0.25, suspect_after_s=4.0, hang_timeout_s=4.0)


def test_a_gap_between_beats_close_to_the_hang_timeout_is_a_freeze() -> None:
    """A peer times this process's silence from an answer that may precede the last beat,
    so the freeze counts a margin before the hang timeout (never before half of it)."""
    clock = ManualClock()
    watch = FreezeWatch(clock, hang_timeout_s=20.0, margin_s=1.5)
    assert watch.limit_s == 18.5
    clock.advance(18.4)
    assert not watch.frozen()
    watch.beat()
    clock.advance(18.6)  # SIGSTOP: nothing beat
    assert watch.frozen() and watch.gap_s() == pytest.approx(18.6)
    watch.beat()
    assert not watch.frozen()
    assert FreezeWatch(clock, hang_timeout_s=2.0, margin_s=1.5).limit_s == 1.0
