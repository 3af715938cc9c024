"""A transfer engine that delays or fails writes on purpose, for fault campaigns.

It wraps the real engine (Mooncake in a served cluster) and changes only `write`: a
delay before each data batch holds a request's transfer window open long enough to
abort it mid-way, and failed batches exercise the failure paths with real pages and a
real peer. Completion words (one 8-byte write) are never delayed or failed, so a
failure always falls on data, the way a broken link would show.
"""

from __future__ import annotations

import logging
import random
import threading
import time
from dataclasses import dataclass

import numpy as np

from sgl_pd.transfer.engine import (
    BatchHandle,
    BatchStatus,
    MetadataWrites,
    TransferEngine,
    Writes,
)
from sgl_pd.transfer.errors import TransferFailed

logger = logging.getLogger("sgl_pd.faults")


@dataclass(frozen=True)
class WriteFaults:
    delay_s: float = 0.0  # added before every data batch
    failure_rate: float = 0.0  # probability that a data batch fails
    # probability that a data batch lands, then has 8 bytes overwritten with others
    corruption_rate: float = 0.0
    seed: int = 0

    @property
    def active(self) -> bool:
        return self.delay_s > 0 or self.failure_rate > 0 or self.corruption_rate > 0


class FaultInjectingEngine:
    def __init__(self, inner: TransferEngine, faults: WriteFaults) -> None:
        self._inner = inner
        self._faults = faults
        self._rng = random.Random(faults.seed)
        self._lock = threading.Lock()
        self.failed_batches = 0
        self.corrupted_batches = 0
        # the bytes a corruption writes (registered like any source; a pattern no KV
        # write of ours would carry by chance)
        self._garbage = np.frombuffer(b"\xa5\x5a\xc3\x3c\x96\x69\x0f\xf0", dtype=np.uint8).copy()
        if faults.corruption_rate:
            inner.register(int(self._garbage.ctypes.data), self._garbage.nbytes)

    @property
    def session_id(self) -> str:
        return self._inner.session_id

    def register(self, addr: int, nbytes: int, *, location: str = "*") -> None:
        self._inner.register(addr, nbytes, location=location)

    def unregister(self, addr: int) -> None:
        self._inner.unregister(addr)

    def write(self, peer: str, writes: Writes) -> None:
        if writes.total_bytes > 8 * len(writes):  # data, not completion words
            if self._faults.delay_s:
                time.sleep(self._faults.delay_s)
            with self._lock:
                fail = self._rng.random() < self._faults.failure_rate
                self.failed_batches += fail
            if fail:
                raise TransferFailed(  # before anything was posted
                    peer, len(writes), writes.total_bytes, "injected failure", may_still_land=False
                )
            self._inner.write(peer, writes)
            if not isinstance(writes, MetadataWrites):  # (the KV checksums cover KV only)
                self._maybe_corrupt(peer, writes)
            return
        self._inner.write(peer, writes)

    def _maybe_corrupt(self, peer: str, writes: Writes) -> None:
        """After a data batch landed (before its count word goes out), overwrite 8 bytes
        of one of its writes: what --pd-kv-checksum must find."""
        wide = np.flatnonzero(writes.nbytes >= self._garbage.nbytes)
        with self._lock:
            corrupt = bool(len(wide)) and self._rng.random() < self._faults.corruption_rate
            self.corrupted_batches += corrupt
            pick = int(wide[self._rng.randrange(len(wide))]) if corrupt else 0
        if not corrupt:
            return
        logger.warning("injected corruption: 8 bytes of a KV write to %s overwritten", peer)
        target = int(writes.dst[pick]) + (int(writes.nbytes[pick]) - 8) // 2
        self._inner.write(peer, Writes.of([int(self._garbage.ctypes.data)], [target], [8]))

    def submit(self, peer: str, writes: Writes) -> BatchHandle:
        return self._inner.submit(peer, writes)

    def poll(self, handle: BatchHandle) -> BatchStatus:
        return self._inner.poll(handle)

    def close(self) -> None:
        self._inner.close()
