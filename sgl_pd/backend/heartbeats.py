"""The liveness thread of one rank: pings the peers its messenger has requests with,
answers their pings, and declares silent peers lost within `timeout_s` (D2's "failures
never strand a request": a killed prefiller fails its decode requests in seconds, a
killed decoder stops the writes into it).

It also gives the messenger a steady tick for deadlines and bounded memory.
"""

from __future__ import annotations

import logging
import threading
from typing import Protocol

from sgl_pd.core.clock import Clock
from sgl_pd.core.liveness import PeerLiveness
from sgl_pd.core.wire import Heartbeat, HeartbeatAck
from sgl_pd.errors import SglPdError
from sgl_pd.log_limits import LogLimiter, peer_text
from sgl_pd.messenger.outbox import Outbox
from sgl_pd.messenger.probe import listener_gone

logger = logging.getLogger("sgl_pd.liveness")

PINGS_PER_TIMEOUT = 6  # pings sent to a silent peer before it is declared lost
# Pings are answered only from peers this rank had requests with in the last ANSWER_GRACE_S:
# a peer pings only while it has requests here, and answering strangers would let anyone
# make this rank open connections to endpoints of their choosing.
ANSWER_GRACE_S = 60.0


class Watched(Protocol):
    """What a role's messenger offers the liveness thread."""

    def active_peers(self) -> set[str]: ...

    def peer_lost(self, inbox: str, why: str, gone: bool) -> None:
        """`inbox` stopped answering; `gone`: its port refuses connections, so the
        process is dead and can write nothing more (else it may only be slow)."""

    def housekeeping(self) -> None: ...


class Heartbeats:
    def __init__(
        self,
        my_inbox: str,
        outbox: Outbox,
        watched: Watched,
        *,
        timeout_s: float,
        clock: Clock,
        name: str,
    ) -> None:
        self._me = my_inbox
        self._outbox = outbox
        self._watched = watched
        self._clock = clock
        self._lock = threading.Lock()  # guards the tracker: the inbox thread reports answers
        self._liveness = PeerLiveness(
            clock, interval_s=timeout_s / PINGS_PER_TIMEOUT, timeout_s=timeout_s
        )
        self._peers: dict[str, float] = {}  # peer inbox -> last time it was active
        self.unanswered = 0  # pings from peers this rank has no requests with
        self._log = LogLimiter(logger)
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name=f"sgl-pd-liveness-{name}", daemon=True
        )
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # -- inbox thread -------------------------------------------------------------------

    def on_heartbeat(self, ping: Heartbeat) -> None:
        with self._lock:
            known = ping.sender in self._peers
            self.unanswered += not known
        if not known:
            self._log.warning(
                "stranger",
                "unanswered ping from %s, which has no requests here (%d so far)",
                peer_text(ping.sender),
                self.unanswered,
            )
            return
        self._outbox.send(
            ping.sender, HeartbeatAck(sender=self._me, seq=ping.seq, time_s=ping.time_s)
        )

    def on_ack(self, ack: HeartbeatAck) -> None:
        with self._lock:
            self._liveness.heard(ack.sender)

    # -- its own thread -----------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self._liveness.interval_s / 2):
            for step in (self._tick, self._watched.housekeeping):
                try:
                    step()
                except Exception:  # a bug; the next tick tries again
                    self._log.log(
                        logging.ERROR,
                        step.__name__,
                        "liveness: %s failed",
                        step.__name__,
                        exc_info=True,
                    )

    def _tick(self) -> None:
        active = self._watched.active_peers()
        now = self._clock.monotonic()
        with self._lock:
            tick = self._liveness.tick(active)
            self._peers.update(dict.fromkeys(active, now))
            for peer in [p for p, t in self._peers.items() if now - t > ANSWER_GRACE_S]:
                del self._peers[peer]
        for endpoint, seq in tick.pings:
            self._outbox.send(endpoint, Heartbeat(sender=self._me, seq=seq, time_s=now))
        for endpoint in tick.dead:
            try:
                gone = listener_gone(endpoint)
            except SglPdError:  # not an address we can probe: nothing proves it gone
                gone = False
            why = (
                f"peer {endpoint} did not answer heartbeats for {self._liveness.timeout_s:g} s"
                + (" (its process is gone)" if gone else " (busy, frozen or unreachable)")
            )
            self._watched.peer_lost(endpoint, why, gone)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)
