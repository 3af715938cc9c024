"""Byte ranges of one staging area: who holds which, first fit, no I/O and no locking
(the owner serializes calls). Offsets and sizes are bytes, aligned to `ALIGN`."""

from __future__ import annotations

import bisect

from sgl_pd.core.errors import PlanError

ALIGN = 256  # bytes: keeps every staged block aligned for vectorized copies and the NIC


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


class StagingSpace:
    """Free ranges kept sorted and merged; `take` returns the lowest offset that fits."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise PlanError(f"staging capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity - capacity % ALIGN
        self._free: list[tuple[int, int]] = [(0, self.capacity)] if self.capacity else []
        self._held: dict[int, int] = {}  # offset -> bytes

    @property
    def used(self) -> int:
        """Bytes held now."""
        return sum(self._held.values())

    def fits(self, nbytes: int) -> bool:
        """Whether `nbytes` could ever be taken (when nothing else is held)."""
        return _aligned(nbytes) <= self.capacity

    def take(self, nbytes: int) -> int | None:
        """Offset of `nbytes` now held, or None while no free range is large enough."""
        size = _aligned(max(nbytes, 1))
        for i, (start, length) in enumerate(self._free):
            if length >= size:
                if length == size:
                    del self._free[i]
                else:
                    self._free[i] = (start + size, length - size)
                self._held[start] = size
                return start
        return None

    def give_back(self, offset: int) -> None:
        """Frees what `take` returned at `offset` (once)."""
        size = self._held.pop(offset, None)
        if size is None:
            raise PlanError(f"staging offset {offset} is not held")
        i = bisect.bisect(self._free, (offset, 0))
        self._free.insert(i, (offset, size))
        # merge with the neighbours on both sides
        if i + 1 < len(self._free) and offset + size == self._free[i + 1][0]:
            size += self._free.pop(i + 1)[1]
            self._free[i] = (offset, size)
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == offset:
            start, length = self._free.pop(i - 1)
            self._free[i - 1] = (start, length + size)
