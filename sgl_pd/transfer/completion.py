"""Completion words: how a receiver learns that a batch landed without a message (D10).

Mooncake has no receiver-side counter (RDMA immediates are not exposed), and its notify is a
message sent after the fact. So each source, once its data batch has *completed*, writes one
small word (a sequence number or counter value) into the receiver's registered memory. The
receiver polls its own memory and counts words; it never waits for a message.

Ordering argument. The completion word is issued only after the data batch reported success
to the sender, and it is a separate batch:
- TCP (Mooncake's TCP transport): the peer's server thread copies each write into its memory
  and then acknowledges it; the sender's batch completes only after every acknowledgement.
  So when the word is sent, the payload already sits in the receiver's memory, and the
  receiver's read of the word cannot overtake it.
- RDMA RC (ConnectX): a write completion at the sender means the remote NIC acknowledged the
  write, after placing it in the target memory; a later write (the word) cannot be seen
  before it on host memory. For GPU memory the NIC's PCIe writes are ordered too, and the
  reader must load the word and then the payload (the decoder fences before reading KV).
- EFA (SRD, unordered): upstream reports that a send completion does not by itself prove
  the payload is visible in GPU memory. There the word alone is not enough: the receiver
  must also fence (or the sender must use delivery-complete semantics) before trusting the
  payload. Treat EFA as unproven until measured.
"""

from __future__ import annotations

import queue
import threading

import numpy as np

from sgl_pd.transfer.engine import TransferEngine, Writes
from sgl_pd.transfer.errors import TransferError

WORD_BYTES = 8  # bytes per completion word (one little-endian uint64)


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

    Each `send` takes its own slot, so several threads may send at once. A slot whose word
    write failed is never reused: the engine may still read it later (a timed-out batch can
    be in flight), and a reused slot would deliver a new value to an old destination.
    """

    def __init__(self, engine: TransferEngine, slots: int = 256, wait_s: float = 5.0) -> None:
        if slots <= 0:
            raise ValueError(f"slots must be > 0, got {slots}")
        self._engine = engine
        self._wait_s = wait_s  # seconds a sender waits for a free slot
        self._words = np.zeros(slots, dtype=np.uint64)  # (slots,) staged values
        self._base = int(self._words.ctypes.data)  # address of slot 0
        engine.register(self._base, self._words.nbytes)
        self._free: queue.Queue[int] = queue.Queue()
        for i in range(slots):
            self._free.put(i)
        self._lock = threading.Lock()
        self._closed = False

    @property
    def free_slots(self) -> int:
        return self._free.qsize()

    def send(self, peer: str, writes: Writes, word_addr: int, value: int) -> None:
        """Writes `writes`, waits for them, then writes `value` as a uint64 into the peer at
        `word_addr` (the same contract as `write_with_completion`)."""
        self.send_many(peer, writes, [(word_addr, value)])

    def send_many(self, peer: str, writes: Writes, words: list[tuple[int, int]]) -> None:
        """Writes `writes`, waits for them, then every (peer address, value) word in one
        batch: the words of several groups cost one round trip, not one each."""
        if len(writes):
            self._engine.write(peer, writes)  # raises: no word is sent
        slots: list[int] = []
        try:
            for _ in words:
                slots.append(self._free.get(timeout=self._wait_s))
        except queue.Empty as e:
            for slot in slots:
                self._free.put(slot)
            raise TransferError(
                f"no free completion-word slot within {self._wait_s:g} s "
                f"({self._words.shape[0]} slots; failed word writes retire theirs)"
            ) from e
        for slot, (_, value) in zip(slots, words, strict=True):
            self._words[slot] = value
        batch = Writes.of(
            [self._base + slot * WORD_BYTES for slot in slots],
            [addr for addr, _ in words],
            WORD_BYTES,
        )
        self._engine.write(peer, batch)  # on failure the slots stay retired
        for slot in slots:
            self._free.put(slot)

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._engine.unregister(self._base)
