"""An in-process `TransferEngine` for unit tests: copies bytes between registered buffers.

Engines find each other through a shared `FakeFabric`. Checks match the Mooncake backend:
sources must lie in this engine's registered memory, destinations in the peer's. Register
only real memory (numpy or ctypes buffers): the fake copies with `ctypes.memmove`.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from dataclasses import dataclass

from sgl_pd.transfer.engine import BatchHandle, BatchStatus, Writes
from sgl_pd.transfer.errors import (
    EngineClosed,
    InvalidWrites,
    PeerUnreachable,
    TransferFailed,
    UnknownBatch,
)
from sgl_pd.transfer.regions import RegionTable


class FakeFabric:
    """The set of fake engines that can reach each other, and which of them are down."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._engines: dict[str, FakeTransferEngine] = {}
        self._down: set[str] = set()
        self._ports = itertools.count(1)

    def attach(self, engine: FakeTransferEngine) -> str:
        with self._lock:
            session = f"fake:{next(self._ports)}"
            self._engines[session] = engine
            return session

    def detach(self, session: str) -> None:
        with self._lock:
            self._engines.pop(session, None)

    def set_down(self, session: str, down: bool = True) -> None:
        """A down peer is unreachable until set up again."""
        with self._lock:
            if down:
                self._down.add(session)
            else:
                self._down.discard(session)

    def lookup(self, session: str) -> FakeTransferEngine:
        with self._lock:
            engine = self._engines.get(session)
            if engine is None or session in self._down:
                raise PeerUnreachable(session, "no fake engine is attached there, or it is down")
            return engine


@dataclass(frozen=True, slots=True)
class _Pending:
    handle: BatchHandle
    writes: Writes


class FakeTransferEngine:
    """`auto_complete=False` keeps submitted batches PENDING until `deliver()` runs them,
    so tests can look at the states in between."""

    def __init__(self, fabric: FakeFabric, *, auto_complete: bool = True) -> None:
        self._fabric = fabric
        self._auto = auto_complete
        self._regions = RegionTable()
        self._lock = threading.Lock()
        self._status: dict[int, BatchStatus] = {}
        self._pending: list[_Pending] = []
        self._ids = itertools.count(1)
        self._fail_next = 0  # batches still to fail on purpose
        self._closed = False
        self._session_id = fabric.attach(self)
        self.writes_done = 0  # writes copied so far, for tests

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def regions(self) -> RegionTable:
        return self._regions

    def register(self, addr: int, nbytes: int, *, location: str = "*") -> None:
        self._check_open()
        self._regions.add(addr, nbytes)

    def unregister(self, addr: int) -> None:
        self._check_open()
        self._regions.remove(addr)

    def fail_next(self, n: int = 1) -> None:
        """Makes the next `n` batches fail without writing anything."""
        with self._lock:
            self._fail_next += n

    def write(self, peer: str, writes: Writes) -> None:
        self._check_open()
        target = self._check(peer, writes)
        self._copy(peer, target, writes)

    def submit(self, peer: str, writes: Writes) -> BatchHandle:
        self._check_open()
        self._check(peer, writes)
        handle = BatchHandle(next(self._ids), peer, len(writes), writes.total_bytes)
        with self._lock:
            self._status[handle.id] = BatchStatus.PENDING
            self._pending.append(_Pending(handle, writes))
        if self._auto:
            self.deliver()
        return handle

    def deliver(self) -> int:
        """Runs every pending batch in submission order; returns how many ran."""
        with self._lock:
            batches, self._pending = self._pending, []
        for p in batches:
            try:
                self._copy(p.handle.peer, self._fabric.lookup(p.handle.peer), p.writes)
                status = BatchStatus.DONE
            except (PeerUnreachable, TransferFailed):
                status = BatchStatus.FAILED
            with self._lock:
                if p.handle.id in self._status:
                    self._status[p.handle.id] = status
        return len(batches)

    def poll(self, handle: BatchHandle) -> BatchStatus:
        with self._lock:
            status = self._status.get(handle.id)
            if status is None:
                raise UnknownBatch(f"batch {handle.id} unknown or already reported")
            if status is not BatchStatus.PENDING:
                del self._status[handle.id]
            return status

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._fabric.detach(self._session_id)
        with self._lock:
            for hid, st in self._status.items():
                if st is BatchStatus.PENDING:
                    self._status[hid] = BatchStatus.FAILED
            self._pending = []

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed(f"fake engine {self._session_id} is closed")

    def _check(self, peer: str, writes: Writes) -> FakeTransferEngine:
        bad = self._regions.outside(writes.src, writes.nbytes)
        if bad.shape[0]:
            raise InvalidWrites(
                f"{bad.shape[0]} of {len(writes)} writes read unregistered local memory, "
                f"first at {int(writes.src[int(bad[0])]):#x}"
            )
        return self._fabric.lookup(peer)

    def _copy(self, peer: str, target: FakeTransferEngine, writes: Writes) -> None:
        with self._lock:
            failing = self._fail_next > 0
            self._fail_next -= int(failing)
        if failing:
            raise TransferFailed(peer, len(writes), writes.total_bytes, "injected failure")
        bad = target.regions.outside(writes.dst, writes.nbytes)
        if bad.shape[0]:
            raise TransferFailed(
                peer,
                len(writes),
                writes.total_bytes,
                f"{bad.shape[0]} writes land outside the peer's registered memory, first at "
                f"{int(writes.dst[int(bad[0])]):#x}",
            )
        for s, d, n in zip(
            writes.src.tolist(), writes.dst.tolist(), writes.nbytes.tolist(), strict=True
        ):
            ctypes.memmove(d, s, n)
        with self._lock:
            self.writes_done += len(writes)
