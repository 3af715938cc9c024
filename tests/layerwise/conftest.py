from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest


def _streamer_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("sgl-pd-layer")]


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every test stops the streamers it started."""
    assert _streamer_threads() == [], "a previous test leaked a streamer thread"
    yield
    for thread in _streamer_threads():
        thread.join(2.0)  # seconds: stop() returned, the thread is on its way out
    assert _streamer_threads() == []
