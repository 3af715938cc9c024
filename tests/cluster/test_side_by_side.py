"""Servers started side by side: what each yields, in order, and every one that started
stopped by the stack - also when another failed to start."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import pytest

from sgl_pd.cluster.local import start_side_by_side


def test_each_starts_in_its_own_thread_and_all_stop_with_the_stack() -> None:
    both_started = threading.Barrier(2, timeout=5)  # each start waits for the other
    events: list[str] = []

    @contextlib.contextmanager
    def server(name: str) -> Iterator[str]:
        both_started.wait()
        events.append(f"start {name}")
        yield name
        events.append(f"stop {name}")

    with contextlib.ExitStack() as stack:
        assert start_side_by_side(stack, server("a"), server("b")) == ["a", "b"]
        assert not any(e.startswith("stop") for e in events)
    assert sorted(events) == ["start a", "start b", "stop a", "stop b"]


def test_a_failed_start_stops_the_others_and_is_raised() -> None:
    stopped: list[str] = []

    @contextlib.contextmanager
    def good() -> Iterator[str]:
        try:
            yield "good"
        finally:  # (as every server context stops what it started)
            stopped.append("good")

    @contextlib.contextmanager
    def bad() -> Iterator[str]:
        raise RuntimeError("exited before it served")
        yield "never"

    with pytest.raises(RuntimeError, match="exited"), contextlib.ExitStack() as stack:
        start_side_by_side(stack, good(), bad())
    assert stopped == ["good"]
