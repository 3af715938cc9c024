"""Peer liveness in seconds: which peers to ping now, which to probe, which hung.

A rank watches only the peers it has requests with (decode: the prefill ranks writing
its pages; prefill: the decode ranks it writes to). Every `interval_s` it pings each of
them; the peer answers from its inbox thread.

Silence alone cannot tell a dead peer from a busy one: on an oversubscribed host a live
process can miss pings for seconds, and failing its requests then is a false failure.
So silence has two thresholds:

- past `suspect_after_s` the peer is a *suspect*: the caller probes its connections
  (`messenger.probe`), at most once per interval. A refused connection is the kernel's
  word that the process is gone; only that ends it quickly.
- past `hang_timeout_s` it is *hung*: alive or not, it has not answered for longer than
  any healthy pause, and its requests fail. Reported once; a peer still watched after
  that is watched afresh.

A peer that comes back publishes a new inbox endpoint (a new process binds a new port),
so it is a new peer here, never a resurrected one.

Pure bookkeeping: time comes from the injected clock, messages and probes are the
caller's.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from sgl_pd.core.bounds import FREEZE_MARGIN_S, freeze_limit_s
from sgl_pd.core.clock import Clock
from sgl_pd.core.errors import StateError


@dataclass(frozen=True)
class LivenessTick:
    pings: tuple[tuple[str, int], ...]  # (peer endpoint, sequence number) to send now
    suspects: tuple[str, ...]  # silent past suspect_after_s, due a connection probe
    hung: tuple[str, ...]  # silent past hang_timeout_s, reported once


@dataclass
class _Peer:
    watched_since_s: float
    last_heard_s: float
    last_ping_s: float | None = None
    last_probe_s: float | None = None
    seq: int = 0


class PeerLiveness:
    def __init__(
        self, clock: Clock, *, interval_s: float, suspect_after_s: float, hang_timeout_s: float
    ) -> None:
        if not 0 < interval_s <= suspect_after_s < hang_timeout_s:
            raise StateError(
                f"need 0 < ping interval ({interval_s} s) <= suspect after "
                f"({suspect_after_s} s) < hang timeout ({hang_timeout_s} s)"
            )
        self._clock = clock
        self.interval_s = interval_s
        self.suspect_after_s = suspect_after_s
        self.hang_timeout_s = hang_timeout_s
        self._peers: dict[str, _Peer] = {}

    def tick(self, active: Iterable[str]) -> LivenessTick:
        """`active`: the peers this rank has requests with now. Peers no longer active
        are forgotten; new ones get a full timeout before they can be declared hung."""
        now = self._clock.monotonic()
        active_set = set(active)
        for gone in set(self._peers) - active_set:
            del self._peers[gone]
        pings: list[tuple[str, int]] = []
        suspects: list[str] = []
        hung: list[str] = []
        for endpoint in sorted(active_set):
            peer = self._peers.get(endpoint)
            if peer is None:
                peer = self._peers[endpoint] = _Peer(now, now)
            silent_s = now - peer.last_heard_s
            if silent_s > self.hang_timeout_s:
                hung.append(endpoint)
                self.lost(endpoint)
                continue
            if silent_s > self.suspect_after_s and (
                peer.last_probe_s is None or now - peer.last_probe_s >= self.interval_s
            ):
                peer.last_probe_s = now
                suspects.append(endpoint)
            if peer.last_ping_s is None or now - peer.last_ping_s >= self.interval_s:
                peer.seq += 1
                peer.last_ping_s = now
                pings.append((endpoint, peer.seq))
        return LivenessTick(tuple(pings), tuple(suspects), tuple(hung))

    def heard(self, endpoint: str) -> None:
        """An answer (or any sign of life) from `endpoint`; ignored for unwatched peers."""
        peer = self._peers.get(endpoint)
        if peer is not None:
            peer.last_heard_s = self._clock.monotonic()

    def lost(self, endpoint: str) -> None:
        """The caller declared `endpoint` lost: if still active it is watched afresh, and
        reported again only after a full silence of its own."""
        if endpoint in self._peers:
            now = self._clock.monotonic()
            self._peers[endpoint] = _Peer(now, now)

    def silence_s(self, endpoint: str) -> float | None:
        """Seconds since `endpoint` was last heard, or None when it is not watched."""
        peer = self._peers.get(endpoint)
        return None if peer is None else self._clock.monotonic() - peer.last_heard_s


class FreezeWatch:
    """Did this process stop running for about the hang timeout (SIGSTOP, a VM paused, a
    swap storm)? Its peers have then declared it hung and may have freed the pages its
    writes go to, so on waking it must not write for the requests it held.

    The liveness thread beats at the end of every loop, so the gap it finds when it wakes
    measures its sleep, not its own work. A peer times this process's silence from the
    last answer it got, which may precede the last beat by a ping interval and the
    answer's way; so a gap counts as a freeze `margin_s` before the hang timeout
    (`limit_s`). Writer threads ask `frozen` before each job: true while the last beat is
    older than that, i.e. after a freeze until the liveness thread, which fails the
    requests before it beats, has run again.
    """

    def __init__(
        self, clock: Clock, hang_timeout_s: float, margin_s: float = FREEZE_MARGIN_S
    ) -> None:
        self._clock = clock
        self.hang_timeout_s = hang_timeout_s
        self.limit_s = freeze_limit_s(hang_timeout_s, margin_s)
        self._last_beat_s = clock.monotonic()

    def gap_s(self) -> float:
        """Seconds since the last beat."""
        return self._clock.monotonic() - self._last_beat_s

    def frozen(self) -> bool:
        return self.gap_s() > self.limit_s

    def beat(self) -> None:
        self._last_beat_s = self._clock.monotonic()
