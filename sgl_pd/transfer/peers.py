"""Bounded first contact with a peer.

Mooncake opens a peer's segment (the P2P handshake) on the first write to it, inside the
engine's segment lock, and waits about 60 s for an answer. A peer that accepts TCP but
never answers would stall every transfer of the engine, to every peer, for that long.
So before the first write to a peer the gate sends Mooncake's probe (no lock held) from a
helper thread and waits at most `timeout_s` for it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field

from sgl_pd.transfer.errors import PeerUnreachable


@dataclass(eq=False)
class _Probe:
    done: threading.Event = field(default_factory=threading.Event)
    rc: int | None = None  # the probe's return code, 0 = the peer answered


class PeerGate:
    """Remembers peers that answered a probe; probes new ones with a bounded wait."""

    def __init__(self, probe: Callable[[str], int], timeout_s: float) -> None:
        self._probe_fn = probe
        self._timeout_s = timeout_s  # seconds a caller waits for one probe
        self._lock = threading.Lock()
        self._reachable: set[str] = set()
        self._inflight: dict[str, _Probe] = {}

    def ensure(self, peer: str) -> None:
        """Returns if `peer` answered a probe before or answers one within the timeout;
        raises `PeerUnreachable` otherwise."""
        if peer in self._reachable:  # hot path: one set lookup
            return
        rc = self.probe(peer)
        if rc is None:
            raise PeerUnreachable(
                peer,
                f"no handshake answer within {self._timeout_s:g} s; check that the peer "
                "process is alive and that this session id is its current one",
            )
        if rc != 0:
            raise PeerUnreachable(
                peer, f"Mooncake's probe returned {rc} (connection refused or reset?)"
            )

    def probe(self, peer: str) -> int | None:
        """Probes `peer` now (joining a probe already in flight); returns the probe's code,
        or None when it did not return within the timeout. Updates the reachable set."""
        with self._lock:
            pr = self._inflight.get(peer)
            if pr is None:
                pr = _Probe()
                self._inflight[peer] = pr
                # The native call cannot be interrupted: the thread ends when Mooncake's own
                # handshake timeout (about 60 s) fires, so it is a daemon thread.
                threading.Thread(
                    target=self._run, args=(peer, pr), name=f"sgl-pd-probe-{peer}", daemon=True
                ).start()
        if not pr.done.wait(self._timeout_s):
            return None
        return pr.rc

    def forget(self, peer: str) -> None:
        """Makes the next use of `peer` probe it again (after a failed batch)."""
        with self._lock:
            self._reachable.discard(peer)

    def _run(self, peer: str, pr: _Probe) -> None:
        try:
            rc = int(self._probe_fn(peer))
        except Exception:  # a binding error must not leave waiters hanging
            rc = -1
        with self._lock:
            if rc == 0:
                self._reachable.add(peer)
            else:
                self._reachable.discard(peer)
            self._inflight.pop(peer, None)
        pr.rc = rc
        pr.done.set()
