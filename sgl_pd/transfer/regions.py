"""Registered memory regions of one engine, and the vectorised check that writes stay inside.

Mooncake's TCP transport does not check the *local* side of a write (RDMA does, through the
memory key), so a write reading unregistered memory would pass tests on CPU and fail on a
cluster. Checking here makes both transports refuse it the same way.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sgl_pd.transfer.errors import RegistrationError


@dataclass(frozen=True, slots=True)
class _Snapshot:
    starts: npt.NDArray[np.int64]  # (r,) sorted region starts, bytes
    ends: npt.NDArray[np.int64]  # (r,) exclusive region ends, bytes


_EMPTY = _Snapshot(np.zeros(0, np.int64), np.zeros(0, np.int64))


class RegionTable:
    """Non-overlapping [start, end) address ranges. Readers take an immutable snapshot, so
    the hot path (`outside`) needs no lock; `add` / `remove` swap the snapshot under one."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._regions: dict[int, int] = {}  # start -> nbytes
        self._snap = _EMPTY

    def add(self, addr: int, nbytes: int) -> None:
        if addr <= 0 or nbytes <= 0:
            raise RegistrationError(
                f"cannot register {nbytes} bytes at {addr:#x}: need addr > 0 and nbytes > 0"
            )
        with self._lock:
            for start, size in self._regions.items():
                if addr < start + size and start < addr + nbytes:
                    raise RegistrationError(
                        f"[{addr:#x}, +{nbytes}) overlaps the registered region "
                        f"[{start:#x}, +{size}); unregister it first or register one "
                        "region covering both"
                    )
            self._regions[addr] = nbytes
            self._rebuild()

    def remove(self, addr: int) -> int:
        """Removes the region starting at `addr`; returns its size in bytes."""
        with self._lock:
            size = self._regions.pop(addr, None)
            if size is None:
                raise RegistrationError(f"no registered region starts at {addr:#x}")
            self._rebuild()
            return size

    def starts(self) -> list[int]:
        with self._lock:
            return list(self._regions)

    def find(self, addr: int, nbytes: int) -> int | None:
        """The start of the region holding [addr, addr + nbytes), or None."""
        snap = self._snap
        i = int(np.searchsorted(snap.starts, addr, side="right")) - 1
        if i >= 0 and addr + nbytes <= int(snap.ends[i]):
            return int(snap.starts[i])
        return None

    def outside(
        self, addr: npt.NDArray[np.int64], nbytes: npt.NDArray[np.int64]
    ) -> npt.NDArray[np.intp]:
        """Indices of the ranges [addr[i], addr[i] + nbytes[i]) not inside one region."""
        snap = self._snap
        if snap.starts.shape[0] == 0:
            return np.arange(addr.shape[0])
        idx = np.searchsorted(snap.starts, addr, side="right") - 1  # (n,) region index
        inside = (idx >= 0) & (addr + nbytes <= snap.ends[np.maximum(idx, 0)])
        return np.flatnonzero(~inside)

    def _rebuild(self) -> None:
        starts = np.array(sorted(self._regions), dtype=np.int64)
        ends = starts + np.array([self._regions[int(s)] for s in starts], dtype=np.int64)
        self._snap = _Snapshot(starts, ends)
