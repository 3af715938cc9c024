"""Control messages that are not lost while their peer lives: sent until acknowledged,
handed to the receiver once.

A `Link` hands a message to ZMQ or gives up after its send timeout (ZMQ_IMMEDIATE: nothing
is queued for a peer it is not connected to, and ZMTP heartbeats drop a connection silent
for 10 s), and ZMQ itself drops what is queued on a connection that breaks. A decoder
paused for 12 s, well under the hang timeout, would so lose the notices that seal its
requests' counts, and a prefill rank the Abort that stops it writing into pages the
decoder is about to free. So every guarded message (`core.wire.Guarded`) goes in a
`Sequenced` envelope numbered per sending process:

- `ReliableSender` keeps it until the receiver's `Delivered` names it, and sends it again
  every `resend_interval_s`, backing off to `resend_max_interval_s`. It stops only when
  acknowledged, when its peer is declared lost (`forget_peer`: liveness says it is gone or
  hung, and every request it had here fails anyway), or `give_up_s` after the first send
  (past the hang timeout and the transfer timeout: its request has ended on both sides).
- `ReliableReceiver` answers every copy with `Delivered` (the answer may be lost too) and
  hands the message on only the first time: it remembers (sender, instance, seq) for
  `window_s`, longer than any sender resends, so a duplicate can never come after it
  forgot. Handlers so see each guarded message exactly once while both peers live.

`ControlFaults` drops envelopes and acknowledgements on purpose, for fault campaigns
(`--pd-inject-control-drop-rate`).
"""

from __future__ import annotations

import itertools
import logging
import random
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

from sgl_pd.core.bounds import TimingBounds
from sgl_pd.core.clock import Clock
from sgl_pd.core.wire import Delivered, Guarded, Sequenced
from sgl_pd.log_limits import LogLimiter, peer_text
from sgl_pd.messenger.outbox import Outbox

logger = logging.getLogger(__name__)
_log = LogLimiter(logger)

MAX_PENDING = 65536  # unacknowledged messages kept; past it the oldest is given up
MAX_REMEMBERED = 1 << 20  # (instance, seq) pairs a receiver remembers, whatever the window


class ControlFaults:
    """Drops control frames with probability `drop_rate` (fault campaigns only)."""

    def __init__(self, drop_rate: float = 0.0, seed: int | None = None) -> None:
        if not 0 <= drop_rate < 1:
            raise ValueError(f"control drop rate must be within [0, 1), got {drop_rate}")
        self.drop_rate = drop_rate
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.dropped = 0

    @property
    def active(self) -> bool:
        return self.drop_rate > 0

    def drop(self) -> bool:
        if not self.drop_rate:
            return False
        with self._lock:
            hit = self._rng.random() < self.drop_rate
            self.dropped += hit
            return hit


@dataclass
class _Pending:
    endpoint: str
    envelope: Sequenced
    first_s: float
    next_s: float
    interval_s: float


class ReliableSender:
    def __init__(
        self,
        outbox: Outbox,
        my_inbox: str,
        instance: int,
        bounds: TimingBounds,
        clock: Clock,
        *,
        faults: ControlFaults | None = None,
        name: str = "",
        start_thread: bool = True,
    ) -> None:
        """`start_thread`: resend from a thread of its own (tests call `resend_due`)."""
        self._outbox = outbox
        self._me = my_inbox
        self._instance = instance
        self._bounds = bounds
        self._clock = clock
        self.faults = faults if faults is not None else ControlFaults()
        self._seqs = itertools.count(1)
        # re-entrant: an outbox that delivers at once (in-process peers) may bring the
        # acknowledgement back while the message is being queued under it
        self._lock = threading.RLock()
        self._pending: OrderedDict[int, _Pending] = OrderedDict()  # seq -> pending
        self.resent = 0
        self.given_up = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if start_thread:
            self._thread = threading.Thread(
                target=self._run, name=f"sgl-pd-resend-{name}", daemon=True
            )
            self._thread.start()

    def send(self, endpoint: str, message: Guarded) -> bool:
        """Sends `message` to `endpoint` until it is acknowledged; never blocks."""
        now = self._clock.monotonic()
        with self._lock:
            seq = next(self._seqs)
            envelope = Sequenced(sender=self._me, instance=self._instance, seq=seq, message=message)
            interval = self._bounds.resend_interval_s
            self._pending[seq] = _Pending(endpoint, envelope, now, now + interval, interval)
            if len(self._pending) > MAX_PENDING:
                _, oldest = self._pending.popitem(last=False)
                self._give_up(oldest, "too many unacknowledged messages")
            self._transmit(endpoint, envelope)  # (queued in order: see `withdraw`)
        return True

    def withdraw(self, endpoint: str, match: Callable[[Guarded], bool]) -> int:
        """Stops resending the messages to `endpoint` that `match`: a message that went
        stale (a request's TransferRequest once it is aborted). Every copy already queued
        goes out before anything sent after this call (one queue per peer, filled under
        this sender's lock), so a copy can never overtake what follows, e.g. the Abort."""
        with self._lock:
            seqs = [
                s
                for s, p in self._pending.items()
                if p.endpoint == endpoint and match(p.envelope.message)
            ]
            for seq in seqs:
                del self._pending[seq]
        return len(seqs)

    def on_delivered(self, ack: Delivered) -> None:
        if ack.instance != self._instance:
            return  # for an earlier process of this rank
        with self._lock:
            for seq in ack.seqs:
                pending = self._pending.get(seq)
                if pending is not None and pending.endpoint == ack.receiver:
                    del self._pending[seq]

    def forget_peer(self, endpoint: str) -> int:
        """`endpoint` was declared lost: its requests fail, nothing more is resent to it."""
        with self._lock:
            seqs = [s for s, p in self._pending.items() if p.endpoint == endpoint]
            for seq in seqs:
                del self._pending[seq]
        return len(seqs)

    @property
    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def resend_due(self) -> int:
        """Sends again what is due; gives up what is past `give_up_s`. Returns how many
        were sent."""
        now = self._clock.monotonic()
        due: list[_Pending] = []
        with self._lock:
            for seq, pending in list(self._pending.items()):
                if now - pending.first_s > self._bounds.give_up_s:
                    del self._pending[seq]
                    self._give_up(pending, f"unacknowledged for {now - pending.first_s:.0f} s")
                elif now >= pending.next_s:
                    pending.interval_s = min(
                        2 * pending.interval_s, self._bounds.resend_max_interval_s
                    )
                    pending.next_s = now + pending.interval_s
                    due.append(pending)
            self.resent += len(due)
            for pending in due:
                self._transmit(pending.endpoint, pending.envelope)
        return len(due)

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        tick_s = self._bounds.resend_interval_s / 2
        while not self._stop.wait(tick_s):
            try:
                self.resend_due()
            except Exception:  # a bug; the next tick tries again
                why = "resending control messages failed"
                _log.log(logging.ERROR, "resend", why, exc_info=True)

    def _transmit(self, endpoint: str, envelope: Sequenced) -> None:
        """Lock held: copies reach the peer's queue in the order they were sent."""
        if self.faults.drop():
            return
        self._outbox.send(endpoint, envelope)

    def _give_up(self, pending: _Pending, why: str) -> None:
        """Lock held."""
        self.given_up += 1
        _log.warning(
            "give_up",
            "gave up sending %s of request %d to %s: %s",
            type(pending.envelope.message).__name__,
            pending.envelope.message.request_id or 0,
            peer_text(pending.endpoint),
            why,
        )


class ReliableReceiver:
    def __init__(
        self,
        outbox: Outbox,
        my_inbox: str,
        bounds: TimingBounds,
        clock: Clock,
        *,
        faults: ControlFaults | None = None,
    ) -> None:
        self._outbox = outbox
        self._me = my_inbox
        self._clock = clock
        self.faults = faults if faults is not None else ControlFaults()
        # longer than any sender resends a message: a copy never outlives its record
        self.window_s = bounds.delivery_memory_s
        self._lock = threading.Lock()
        # (sender inbox, instance, seq) -> first seen at
        self._seen: OrderedDict[tuple[str, int, int], float] = OrderedDict()
        self.duplicates = 0

    def accept(self, envelope: Sequenced) -> Guarded | None:
        """Acknowledges `envelope`; its message the first time, None for a copy."""
        if not self.faults.drop():
            self._outbox.send(
                envelope.sender,
                Delivered(receiver=self._me, instance=envelope.instance, seqs=(envelope.seq,)),
            )
        key = (envelope.sender, envelope.instance, envelope.seq)
        now = self._clock.monotonic()
        with self._lock:
            self._forget_old(now)
            if key in self._seen:
                self.duplicates += 1
                return None
            self._seen[key] = now
        return envelope.message

    def remembered(self) -> int:
        """Deliveries remembered (to tell copies from new messages): those of the last
        `window_s`, so none once traffic stopped that long ago."""
        with self._lock:
            self._forget_old(self._clock.monotonic())
            return len(self._seen)

    def _forget_old(self, now: float) -> None:
        while self._seen:
            oldest_key, seen_s = next(iter(self._seen.items()))
            if now - seen_s <= self.window_s and len(self._seen) < MAX_REMEMBERED:
                break
            del self._seen[oldest_key]
