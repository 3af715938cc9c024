"""The liveness thread of one rank: pings the peers its messenger has requests with,
answers their pings, and tells dead peers from busy ones (D2's "failures never strand a
request", without failing healthy ones).

- Dead: a peer silent for `SUSPECT_AFTER_S` is probed. When its inbox *and* its transfer
  engine's listener both refuse connections, its kernel closed them: the process is gone
  and can write nothing more, so its requests fail at once (well within 2 s of a crash).
  Both must refuse: an inbox thread that died in a live process refuses too, while its
  engine may still be writing.
- Busy: a live process that misses pings (GIL held, CPU oversubscribed, a short SIGSTOP)
  still accepts connections, so nothing fails before the hang timeout.
- Hung: silent past `hang_timeout_s` (reachable or not), its requests fail; a decoder
  keeps the pages until the prefill rank acks the abort or SGLang's deferred release
  gives up on it.
- Frozen itself: when this thread wakes after a gap close to the hang timeout, this
  process was stopped while its peers gave up on it; the messenger fails what it still
  holds before any writer may write again (`FreezeWatch`; a writer that finds the beat
  stale fails its request itself). A freeze that falls between a writer's check and its
  post to the engine lets that one batch go out on waking; decoders keep a hung
  prefiller's pages until SGLang's deferred release gives up (`core.bounds`: past the
  hang timeout and the engine's), so only a freeze longer than that could land it in
  pages given to another request.

It also gives the messenger a steady tick for deadlines and bounded memory.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from typing import Protocol

from sgl_pd.core.clock import Clock
from sgl_pd.core.liveness import FreezeWatch, PeerLiveness
from sgl_pd.core.wire import Heartbeat, HeartbeatAck
from sgl_pd.errors import SglPdError
from sgl_pd.log_limits import LogLimiter, peer_text
from sgl_pd.messenger.outbox import Outbox
from sgl_pd.messenger.probe import listener_gone

logger = logging.getLogger("sgl_pd.liveness")

PING_INTERVAL_S = 0.25  # seconds between pings to each watched peer
SUSPECT_AFTER_S = 0.75  # seconds of silence after which a peer's connections are probed
# Suspects are probed in parallel, and a tick waits this long for them at most (a probe
# of an unreachable host gets no answer): a partition never stalls the pings to others.
PROBE_BUDGET_S = 1.2
MAX_PARALLEL_PROBES = 8
# Pings are answered only from peers this rank had requests with in the last ANSWER_GRACE_S:
# a peer pings only while it has requests here, and answering strangers would let anyone
# make this rank open connections to endpoints of their choosing.
ANSWER_GRACE_S = 60.0


class Watched(Protocol):
    """What a role's messenger offers the liveness thread."""

    def active_peers(self) -> dict[str, str | None]:
        """Inbox -> transfer session ("host:port" of its engine, None if unknown) of every
        peer this rank has requests with."""
        ...

    def peer_lost(self, inbox: str, why: str, gone: bool) -> None:
        """`inbox` is lost; `gone`: its connections are refused, so the process is dead
        and can write nothing more (else it hung: it may still write)."""

    def resumed_after_freeze(self, frozen_s: float) -> None:
        """This process did not run for `frozen_s` seconds, past the hang timeout."""

    def housekeeping(self) -> None: ...

    def tables(self) -> dict[str, int]:
        """The role's tables and their entries (a soak watches them return to 0)."""
        ...


def peer_gone(inbox: str, session: str | None) -> bool:
    """True only when the peer's inbox refuses connections and so does its transfer
    engine's listener (or it has none we can probe)."""
    try:
        if not listener_gone(inbox):
            return False
    except SglPdError:  # not an address we can probe: nothing proves it gone
        return False
    if session is None:
        return True
    try:
        return listener_gone(f"tcp://{session}")
    except SglPdError:
        return True


class Heartbeats:
    def __init__(
        self,
        my_inbox: str,
        outbox: Outbox,
        watched: Watched,
        *,
        hang_timeout_s: float,
        clock: Clock,
        name: str,
        freeze: FreezeWatch | None = None,
        on_lost: Callable[[str], None] | None = None,
    ) -> None:
        """`on_lost(kind)`: told of each loss, kind "gone", "hung" or "frozen" (this
        process), for the liveness-loss counter."""
        self._me = my_inbox
        self._on_lost = on_lost if on_lost is not None else (lambda _kind: None)
        self._outbox = outbox
        self._watched = watched
        self._clock = clock
        self._lock = threading.Lock()  # guards the tracker: the inbox thread reports answers
        interval_s = min(PING_INTERVAL_S, hang_timeout_s / 8)
        self._liveness = PeerLiveness(
            clock,
            interval_s=interval_s,
            suspect_after_s=min(SUSPECT_AFTER_S, hang_timeout_s / 2),
            hang_timeout_s=hang_timeout_s,
        )
        self.freeze = freeze if freeze is not None else FreezeWatch(clock, hang_timeout_s)
        self._peers: dict[str, float] = {}  # peer inbox -> last time it was active
        self.unanswered = 0  # pings from peers this rank has no requests with
        self._log = LogLimiter(logger)
        self._stop = threading.Event()
        self._probes = ThreadPoolExecutor(MAX_PARALLEL_PROBES, f"sgl-pd-probe-{name}")
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
            # INFO: a healthy peer pings a rank that has just let go of their last
            # request, or not yet taken their next; a stranger is counted all the same
            self._log.log(
                logging.INFO,
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
        self.freeze.beat()  # the time this process took to start is not a freeze
        while not self._stop.wait(self._liveness.interval_s / 2):
            for step in (self._check_freeze, self._tick, self._watched.housekeeping):
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
            # Requests first, beat after: a writer that wakes from a freeze before this
            # thread sees the old beat and fails its request (`FreezeWatch.frozen`). A
            # freeze inside this loop, after its check, is hidden by this beat; the
            # writers' own check covers it (a second check here would count the loop's
            # work - a probe waits up to PROBE_BUDGET_S - as a freeze).
            self.freeze.beat()

    def _check_freeze(self) -> None:
        gap_s = self.freeze.gap_s()
        if gap_s > self.freeze.limit_s:
            logger.error(
                "this process did not run for %.1f s, past the hang timeout (%g s): its "
                "peers have given up on its requests",
                gap_s,
                self._liveness.hang_timeout_s,
            )
            with self._lock:  # every silence so far is ours, not the peers'
                for endpoint in list(self._peers):
                    self._liveness.heard(endpoint)
            self._on_lost("frozen")
            self._watched.resumed_after_freeze(gap_s)
            self.freeze.beat()  # what it held has failed: this gap is reported once

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
        probes = {
            endpoint: self._probes.submit(peer_gone, endpoint, active.get(endpoint))
            for endpoint in tick.suspects
            if endpoint not in tick.hung
        }
        wait(probes.values(), timeout=PROBE_BUDGET_S)
        for endpoint, probe in probes.items():
            if probe.done() and probe.exception() is None and probe.result():
                with self._lock:
                    silent_s = self._liveness.silence_s(endpoint) or 0.0
                    self._liveness.lost(endpoint)
                why = (
                    f"peer {endpoint} is gone: silent for {silent_s:.1f} s and its "
                    "connections are refused (the process exited or was killed)"
                )
                self._on_lost("gone")
                self._watched.peer_lost(endpoint, why, True)
        for endpoint in tick.hung:
            why = (
                f"peer {endpoint} hung: no answer to heartbeats for "
                f"{self._liveness.hang_timeout_s:g} s though it accepts connections, or it "
                "is unreachable (raise --pd-hang-timeout if it was only busy)"
            )
            self._on_lost("hung")
            self._watched.peer_lost(endpoint, why, False)

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        self._thread.join(timeout=timeout_s)
        self._probes.shutdown(wait=False, cancel_futures=True)
