"""Completion words: how a receiver learns that a batch landed without a message (D10).

Mooncake has no receiver-side counter (RDMA immediates are not exposed), and its notify is a
message sent after the fact. So each source, once its data batch has *completed*, writes one
8-byte word into the receiver's registered memory: in sgl_pd its own count of finished
groups for the request (`sgl_pd.core.counting`), which only grows. The receiver polls its
own memory and reads counts; it never waits for a message.

Ordering argument. The completion word is issued only after the data batch reported success
to the sender, and it is a separate batch:
- TCP (Mooncake's TCP transport): the peer's server thread copies each write into its memory
  and then acknowledges it; the sender's batch completes only after every acknowledgement.
  So when the word is sent, the payload already sits in the receiver's memory, and the
  receiver's read of the word cannot overtake it.
- RDMA RC (ConnectX): a write completion at the sender means the remote NIC acknowledged the
  write, after placing it in the target memory; a later write (the word) cannot be seen
  before it on host memory. For GPU memory the argument rests on the NIC's PCIe writes
  staying in order (no relaxed ordering on the KV registration): the decoder's host
  thread sees the word, and only then does the scheduler launch the kernels that read
  the KV, so no explicit fence is issued. That is unverified on GPUs here; a fabric or
  setting that reorders PCIe writes needs one (as EFA does, below).
- EFA (SRD, unordered): upstream reports that a send completion does not by itself prove
  the payload is visible in GPU memory. There the word alone is not enough: the receiver
  must also fence (or the sender must use delivery-complete semantics) before trusting the
  payload. Treat EFA as unproven until measured.

Staging slots. A word's value must sit in registered local memory while its write is in
flight, so `CompletionWordWriter` owns a registered array of slots. A slot goes back to the
free list when its write completed. When the write failed (or timed out) the engine may
still read the slot later, so it rests in quarantine for `quarantine_s` seconds (default
twice Mooncake's 30 s transfer timeout) and is reclaimed lazily, the next time slots are
asked for: a dead decoder costs a few slots for a minute, never the writer for good.
"""

from __future__ import annotations

import threading
import time
from collections import deque

import numpy as np

from sgl_pd.core.clock import Clock, SystemClock
from sgl_pd.transfer.engine import TransferEngine, Writes
from sgl_pd.transfer.errors import TransferError

WORD_BYTES = 8  # bytes per completion word (one little-endian uint64)
# Seconds a slot rests after a failed word write: twice Mooncake's 30 s transfer timeout,
# after which the engine no longer reads a timed-out batch's source.
QUARANTINE_S = 60.0


def write_with_completion(
    engine: TransferEngine, peer: str, writes: Writes, completion: Writes
) -> None:
    """Writes `writes`, waits for all of them to complete, then writes `completion` (the
    word; its source must stay unchanged until this returns).

    If the data batch fails, the word is never sent and the error propagates: a receiver
    that counts words cannot mistake a failed batch for a finished one. Safe to call from
    any thread; it blocks that thread (the GIL is released inside the native calls).
    """
    engine.write(peer, writes)
    engine.write(peer, completion)


class CompletionWordWriter:
    """Owns a registered array of word slots that hold completion values while in flight.

    Each `send` takes its own slots, so several threads may send at once. A slot whose word
    write failed is quarantined for `quarantine_s` seconds of `clock` before it is reused:
    the engine may still read it until the failed batch's transfer timeout has passed, and
    a slot reused too early would deliver a new value to an old destination.
    """

    def __init__(
        self,
        engine: TransferEngine,
        slots: int = 256,
        wait_s: float = 5.0,
        *,
        quarantine_s: float = QUARANTINE_S,
        clock: Clock | None = None,
    ) -> None:
        if slots <= 0:
            raise ValueError(f"slots must be > 0, got {slots}")
        if quarantine_s < 0:
            raise ValueError(f"quarantine_s must be >= 0, got {quarantine_s}")
        self._engine = engine
        self._wait_s = wait_s  # seconds a sender waits for free slots
        self._quarantine_s = quarantine_s  # seconds of `clock` a failed slot rests
        self._clock: Clock = clock if clock is not None else SystemClock()
        self._words = np.zeros(slots, dtype=np.uint64)  # (slots,) staged values
        self._base = int(self._words.ctypes.data)  # address of slot 0
        engine.register(self._base, self._words.nbytes)
        self._cond = threading.Condition()
        self._free: deque[int] = deque(range(slots))
        self._quarantine: deque[tuple[float, list[int]]] = deque()  # (free again at, slots)
        self._closed = False

    @property
    def free_slots(self) -> int:
        """Slots a sender could take now (quarantined ones whose time is up included)."""
        with self._cond:
            self._reclaim()
            return len(self._free)

    @property
    def quarantined_slots(self) -> int:
        """Slots resting after a failed word write, not yet free again."""
        with self._cond:
            self._reclaim()
            return sum(len(slots) for _, slots in self._quarantine)

    def send(self, peer: str, writes: Writes, word_addr: int, value: int) -> None:
        """Writes `writes`, waits for them, then writes `value` as a uint64 into the peer at
        `word_addr` (the same contract as `write_with_completion`)."""
        self.send_many(peer, writes, [(word_addr, value)])

    def send_many(self, peer: str, writes: Writes, words: list[tuple[int, int]]) -> None:
        """Writes `writes`, waits for them, then every (peer address, value) word in one
        batch: the words of several groups cost one round trip, not one each."""
        if len(words) > self._words.shape[0]:
            raise TransferError(
                f"{len(words)} completion words in one batch, the writer has "
                f"{self._words.shape[0]} slots"
            )
        if len(writes):
            self._engine.write(peer, writes)  # raises: no word is sent
        if not words:
            return
        slots = self._take(len(words))
        for slot, (_, value) in zip(slots, words, strict=True):
            self._words[slot] = value
        batch = Writes.of(
            [self._base + slot * WORD_BYTES for slot in slots],
            [addr for addr, _ in words],
            WORD_BYTES,
        )
        try:
            self._engine.write(peer, batch)
        except BaseException:
            with self._cond:  # the engine may still read them: rest, then reuse
                self._quarantine.append((self._clock.monotonic() + self._quarantine_s, slots))
            raise
        with self._cond:
            self._free.extend(slots)
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._engine.unregister(self._base)

    def _take(self, n: int) -> list[int]:
        """`n` free slots at once (never some: two senders must not hold part each), waiting
        up to `wait_s` real seconds; a quarantine ending meanwhile wakes the wait."""
        deadline = time.monotonic() + self._wait_s
        with self._cond:
            while True:
                self._reclaim()
                if len(self._free) >= n:
                    return [self._free.popleft() for _ in range(n)]
                left = deadline - time.monotonic()  # seconds
                if left <= 0:
                    resting = sum(len(slots) for _, slots in self._quarantine)
                    raise TransferError(
                        f"no {n} free completion-word slots within {self._wait_s:g} s "
                        f"({self._words.shape[0]} slots, {resting} quarantined for up to "
                        f"{self._quarantine_s:g} s after failed word writes)"
                    )
                if self._quarantine:
                    left = min(left, max(self._quarantine[0][0] - self._clock.monotonic(), 0.0))
                self._cond.wait(left)

    def _reclaim(self) -> None:
        """Frees the quarantined slots whose time is up; the caller holds `_cond`."""
        now = self._clock.monotonic()
        while self._quarantine and self._quarantine[0][0] <= now:
            self._free.extend(self._quarantine.popleft()[1])
