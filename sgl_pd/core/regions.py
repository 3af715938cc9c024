"""A shard's registered KV memory: one (base address, length) region per (layer, part).

Writes in a `TransferPlan` carry byte offsets *inside* a region; the region table of each
shard, exchanged at registration, turns them into absolute addresses for the transfer
engine: address = table.bases[layout.region_index(layer, part)] + offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

from sgl_pd.core.errors import LayoutError
from sgl_pd.core.layout import KvLayout


@dataclass(frozen=True)
class Region:
    base: int  # absolute address, bytes
    length: int  # bytes

    def __post_init__(self) -> None:
        if self.base < 0 or self.length < 0:
            raise LayoutError(f"region base and length must be >= 0, got {self}")


@dataclass(frozen=True)
class RegionTable:
    """Regions of one shard, indexed by `KvLayout.region_index(layer, part)`."""

    regions: tuple[Region, ...]

    @classmethod
    def for_layout(cls, layout: KvLayout, regions: tuple[Region, ...]) -> RegionTable:
        if len(regions) != layout.num_regions:
            raise LayoutError(
                f"expected {layout.num_regions} regions (layers x parts), got {len(regions)}"
            )
        return cls(regions)

    @classmethod
    def packed(
        cls, layout: KvLayout, num_pages: int, local_heads: int, base: int = 0
    ) -> RegionTable:
        """Regions laid back to back from `base` (one arena per shard: CPU pools, tests)."""
        size = layout.region_bytes(num_pages, local_heads)
        return cls(tuple(Region(base + i * size, size) for i in range(layout.num_regions)))

    @cached_property
    def bases(self) -> npt.NDArray[np.int64]:
        out = np.array([r.base for r in self.regions], dtype=np.int64)
        out.flags.writeable = False
        return out

    @cached_property
    def lengths(self) -> npt.NDArray[np.int64]:
        out = np.array([r.length for r in self.regions], dtype=np.int64)
        out.flags.writeable = False
        return out
