"""Logging what peers send without letting them flood or forge the log.

Peer-supplied text (error messages, abort details, addresses) goes through `peer_text`:
truncated and escaped, so a 64 KiB string or a newline cannot fake log lines. Repeated
warnings about peer input go through `LogLimiter`: one line per kind per interval, with
the count of lines held back.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

PEER_TEXT_CHARS = 160  # longest peer string we log, in characters


def peer_text(value: object, limit: int = PEER_TEXT_CHARS) -> str:
    """`value` as one quoted, escaped line of at most about `limit` characters."""
    text = value if isinstance(value, str) else str(value)
    cut = len(text) - limit
    shown = repr(text[:limit]) if cut > 0 else repr(text)
    return f"{shown}...(+{cut} chars)" if cut > 0 else shown


class LogLimiter:
    """At most one log line per key per `interval_s`; thread-safe."""

    def __init__(
        self,
        logger: logging.Logger,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}  # key -> when it was last logged
        self._held: dict[str, int] = {}  # key -> lines not logged since

    def log(self, level: int, key: str, msg: str, *args: object, exc_info: bool = False) -> bool:
        """Logs `msg % args` unless `key` was logged within the interval; True if logged."""
        now = self._clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last < self._interval_s:
                self._held[key] = self._held.get(key, 0) + 1
                return False
            self._last[key] = now
            held = self._held.pop(key, 0)
            if len(self._last) > 1024:  # keys are a few kinds; bound them anyway
                self._last = {key: now}
        suffix = f" ({held} more like this not logged)" if held else ""
        self._logger.log(level, msg + suffix, *args, exc_info=exc_info)
        return True

    def warning(self, key: str, msg: str, *args: object) -> bool:
        return self.log(logging.WARNING, key, msg, *args)
