"""Peer liveness in seconds: which peers to ping now, and which stopped answering.

A rank watches only the peers it has requests with (decode: the prefill ranks writing
its pages; prefill: the decode ranks it writes to). Every `interval_s` it pings each of
them; the peer answers from its inbox thread. A peer not heard from for `timeout_s` is
declared dead once: its requests fail and nothing waits for it any more. A peer that
comes back publishes a new inbox endpoint (a new process binds a new port), so it is a
new peer here, never a resurrected one.

Pure bookkeeping: time comes from the injected clock, messages are sent by the caller.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sgl_pd.core.clock import Clock
from sgl_pd.core.errors import StateError


@dataclass(frozen=True)
class LivenessTick:
    pings: tuple[tuple[str, int], ...]  # (peer endpoint, sequence number) to send now
    dead: tuple[str, ...]  # peers silent for longer than the timeout, reported once


@dataclass
class _Peer:
    watched_since_s: float
    last_heard_s: float
    last_ping_s: float | None = None
    seq: int = 0


class PeerLiveness:
    def __init__(self, clock: Clock, *, interval_s: float, timeout_s: float) -> None:
        if not 0 < interval_s < timeout_s:
            raise StateError(
                f"ping interval {interval_s} s must be > 0 and below the timeout {timeout_s} s"
            )
        self._clock = clock
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self._peers: dict[str, _Peer] = {}

    def tick(self, active: Iterable[str]) -> LivenessTick:
        """`active`: the peers this rank has requests with now. Peers no longer active
        are forgotten; new ones get a full timeout before they can be declared dead."""
        now = self._clock.monotonic()
        active_set = set(active)
        for gone in set(self._peers) - active_set:
            del self._peers[gone]
        pings: list[tuple[str, int]] = []
        dead: list[str] = []
        for endpoint in sorted(active_set):
            peer = self._peers.get(endpoint)
            if peer is None:
                peer = self._peers[endpoint] = _Peer(now, now)
            if now - peer.last_heard_s > self.timeout_s:
                dead.append(endpoint)
                # still active: watched afresh, declared dead again only after a full timeout
                self._peers[endpoint] = _Peer(now, now)
                continue
            if peer.last_ping_s is None or now - peer.last_ping_s >= self.interval_s:
                peer.seq += 1
                peer.last_ping_s = now
                pings.append((endpoint, peer.seq))
        return LivenessTick(tuple(pings), tuple(dead))

    def heard(self, endpoint: str) -> None:
        """An answer (or any sign of life) from `endpoint`; ignored for unwatched peers."""
        peer = self._peers.get(endpoint)
        if peer is not None:
            peer.last_heard_s = self._clock.monotonic()

    def silence_s(self, endpoint: str) -> float | None:
        """Seconds since `endpoint` was last heard, or None when it is not watched."""
        peer = self._peers.get(endpoint)
        return None if peer is None else self._clock.monotonic() - peer.last_heard_s
