"""The copies of re-layout (`core.relayout`), with torch on the KV pool's device.

A rank's region (layer, part) is viewed as (token slots, local heads, row bytes) uint8:
SGLang's NHD buffers are token slot after token slot, and a slot is page * page_size +
position. Both copies are one indexed copy per (region, link): `index_select` of the
link's heads out of the chunk's pages into a gather block, `index_copy_` of a receive
block into the link's heads of the request's pages.

On CUDA they run on a stream of their own and are waited for before returning: a gather
block must hold its bytes before the NIC reads it, and a receive block must be copied out
before its space is given to another request. The pool's bytes they read are complete
(layer-wise: the progress counter said the layer's forward is done; otherwise the
forward ended), and a scatter precedes SGLang's first decode step of the request.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

from sgl_pd.backend.device_memory import pool_region_views, side_stream
from sgl_pd.backend.pool import PoolDescription
from sgl_pd.core.relayout import ReceivePlacement, block_bytes, page_slots
from sgl_pd.core.sharding import ShardLink

I64 = npt.NDArray[np.int64]


class PoolCopies:
    """Gathers out of and scatters into one rank's KV pool."""

    def __init__(self, pool: PoolDescription, device: Any) -> None:
        import torch

        self.layout = pool.layout
        self.device = torch.device(device)
        self._views = pool_region_views(pool, self.device)
        self._stream = side_stream(self.device)

    def gather(self, out: Any, regions: range, link: ShardLink, pages: I64) -> None:
        """Into `out` ((len(regions) * block,) uint8): for each region, the link's heads
        of every slot of `pages` (the chunk's source pages in block order,
        `TransferPlan.gather_pages`), a block per region."""
        layout, lo, nh = self.layout, link.src_head_offset, link.num_heads
        block = block_bytes(layout, link, len(pages))
        with self._on_stream():
            rows = self._rows(pages)
            for k, region in enumerate(regions):
                dst = out[k * block : (k + 1) * block].view(rows.shape[0], nh, layout.row_bytes)
                self._index_select(self._views[region][:, lo : lo + nh], rows, dst)
        self._wait()

    def scatter(
        self,
        staged: Any,
        placement: ReceivePlacement,
        links: tuple[ShardLink, ...],
        pages: I64,
    ) -> None:
        """From `staged` (the request's receive staging, uint8) into the pool: each link's
        block of each region into the link's heads of `pages` (the request's destination
        pages; a block holds them in ascending order, `core.relayout.block_positions`, or
        in the request's order when `placement.logical`)."""
        layout = self.layout
        with self._on_stream():
            rows = self._rows(pages if placement.logical else np.sort(pages))
            for i, start in placement.offsets.items():
                link, block = links[i], placement.block[i]
                lo, nh = link.dst_head_offset, link.num_heads
                for region, view in enumerate(self._views):
                    first = start + region * block
                    src = staged[first : first + block].view(rows.shape[0], nh, layout.row_bytes)
                    view[:, lo : lo + nh].index_copy_(0, rows, src)
        self._wait()

    def _rows(self, pages: I64) -> Any:
        import torch

        return torch.from_numpy(page_slots(pages, self.layout.page_size)).to(self.device)

    @staticmethod
    def _index_select(src: Any, rows: Any, out: Any) -> None:
        import torch

        torch.index_select(src, 0, rows, out=out)

    def _on_stream(self) -> Any:
        import contextlib

        import torch

        if self._stream is None:
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream)

    def _wait(self) -> None:
        if self._stream is not None:
            self._stream.synchronize()
