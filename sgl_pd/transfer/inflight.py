"""A cap on the writes in flight to each peer, shared by every thread of one engine.

Mooncake's TCP transport fails writes beyond a per-peer queue (1024 queued + about 1024
waiting for admission, by default) instead of holding them back, so the engine holds them
back itself: a batch takes one credit per write before it is handed to Mooncake.
"""

from __future__ import annotations

import threading
from collections import defaultdict


class InflightLimiter:
    def __init__(self, cap: int) -> None:
        self.cap = cap  # writes in flight per peer
        self._cond = threading.Condition()
        self._used: defaultdict[str, int] = defaultdict(int)  # peer -> writes in flight

    def try_acquire(self, peer: str, n: int) -> bool:
        with self._cond:
            if self._used[peer] + n > self.cap:
                return False
            self._used[peer] += n
            return True

    def acquire(self, peer: str, n: int, timeout_s: float) -> bool:
        """Waits up to `timeout_s` seconds for `n` credits; False if they did not free up."""
        if n > self.cap:
            raise ValueError(f"{n} writes can never fit a cap of {self.cap}")
        with self._cond:
            ok = self._cond.wait_for(lambda: self._used[peer] + n <= self.cap, timeout_s)
            if ok:
                self._used[peer] += n
            return ok

    def release(self, peer: str, n: int) -> None:
        with self._cond:
            left = self._used[peer] - n
            assert left >= 0, f"released more credits than taken for {peer}"
            if left:
                self._used[peer] = left
            else:
                del self._used[peer]
            self._cond.notify_all()
