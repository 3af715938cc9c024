"""Time as an injected dependency, so timeouts are tested by advancing a clock, not sleeping."""

from __future__ import annotations

import time
from typing import Protocol

from sgl_pd.core.errors import ClockError


class Clock(Protocol):
    def monotonic(self) -> float:
        """Seconds from an arbitrary origin; never goes backwards."""
        ...


class SystemClock:
    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def monotonic(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ClockError(f"a monotonic clock cannot go back ({seconds} s)")
        self._now += seconds
