from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest


def _ours() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("sgl-pd-")]


@pytest.fixture(autouse=True)
def no_leaked_threads() -> Iterator[None]:
    """Every test closes what it opened: no messenger thread outlives it."""
    assert _ours() == [], "a previous test leaked threads"
    yield
    end = time.monotonic() + 2.0
    while _ours() and time.monotonic() < end:
        time.sleep(0.01)
    assert _ours() == []
