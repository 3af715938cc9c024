"""Keyed KV checksums (`core.kv_checksum`) computed with torch on the pool's device.

A prefill rank sums each chunk's layers as it writes them, per destination decode rank,
over the heads its links send there (`Destination.sums`, kept on the device and read
once, for the request's last notice); a decode rank sums what landed in its pages after
the request's last write was counted and its staged blocks were scattered, per prefill
rank it has links from, and compares. Both read the pool through the same views as the
re-layout copies: region (layer, part) as (token slots, local heads, row bytes).

On CUDA the sums run on a stream of their own (never on the forward's) and are read
with one synchronisation per request and side.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from typing import Any

import numpy as np
import numpy.typing as npt

from sgl_pd.backend.device_memory import pool_region_views, side_stream
from sgl_pd.backend.pool import PoolDescription
from sgl_pd.core.kv_checksum import MASK, ROW_ALIGN, WORD_BYTES, head_weights, token_weights
from sgl_pd.core.sharding import ShardLink

I64 = npt.NDArray[np.int64]
SUM_BLOCK_TOKENS = 4096  # tokens summed at once (bounds the device memory a sum takes)


def token_slots(pages: I64, first_page: int, start: int, stop: int, page_size: int) -> I64:
    """(stop - start,) the token slot of each token in [start, stop), where `pages[i]`
    holds the prompt's logical page `first_page + i`."""
    tokens = np.arange(start, stop, dtype=np.int64)
    return pages[tokens // page_size - first_page].astype(np.int64) * page_size + (
        tokens % page_size
    )


class KvSums:
    def __init__(self, pool: PoolDescription, device: Any, key: int) -> None:
        import torch

        self.layout = pool.layout
        self.key = key
        if self.layout.row_bytes % ROW_ALIGN:
            raise ValueError(
                f"--pd-kv-checksum sums 64-bit words; a KV row of {self.layout.row_bytes}"
                " bytes is not whole words"
            )
        self.device = torch.device(device)
        self._views = pool_region_views(pool, self.device)
        self._stream = side_stream(self.device)

    def regions_of(self, layers: Iterable[int]) -> list[int]:
        parts = self.layout.parts
        return [self.layout.region_index(layer, part) for layer in layers for part in parts]

    def zeros(self) -> Any:
        """A (regions,) int64 accumulator on the device (made on the sums' stream, which
        every later use of it runs on)."""
        import torch

        with self._on_stream():
            return torch.zeros(self.layout.num_regions, dtype=torch.int64, device=self.device)

    def add_link(
        self,
        into: Any,
        room: int,
        regions: list[int],
        link: ShardLink,
        local_head_offset: int,
        tokens: tuple[int, int],
        slots: I64,
    ) -> None:
        """Adds to `into` (a `zeros` accumulator), for each of `regions`, the sum of
        `link`'s heads (at `local_head_offset` in this rank's region) over `tokens`
        ([start, stop), model positions) whose rows are at `slots`."""
        import torch

        start, stop = tokens
        if stop <= start or not regions:
            return
        pieces = self.layout.row_bytes // WORD_BYTES
        nh = link.num_heads
        with self._on_stream():
            for region in regions:
                heads = head_weights(
                    self.key, room, region, link.head_lo, link.head_hi, self.layout.row_bytes
                )
                h = torch.from_numpy(heads.view(np.int64)).to(self.device)
                view = self._views[region][:, local_head_offset : local_head_offset + nh]
                # a block of tokens at a time: the int64 products take 4x the KV's bytes
                for lo in range(0, stop - start, SUM_BLOCK_TOKENS):
                    hi = min(lo + SUM_BLOCK_TOKENS, stop - start)
                    rows = torch.from_numpy(slots[lo:hi]).to(self.device)
                    weights = torch.from_numpy(
                        token_weights(self.key, room, region, start + lo, start + hi).view(np.int64)
                    ).to(self.device)
                    picked = torch.index_select(view, 0, rows).contiguous()
                    x = picked.view(torch.int32).view(hi - lo, nh, pieces).to(torch.int64)
                    x &= 0xFFFFFFFF  # unsigned pieces
                    # int64 arithmetic wraps: the same bits as the reference's uint64
                    per_token = (x * h).sum(dim=(1, 2))
                    into[region] += (per_token * weights).sum()

    def read(self, sums: Any) -> tuple[int, ...]:
        """The accumulator's values as unsigned 64-bit ints (waits for the device)."""
        if self._stream is not None:
            self._stream.synchronize()
        return tuple(int(v) & MASK for v in sums.tolist())

    def _on_stream(self) -> Any:
        """Work on the sums' own stream, after what the caller's stream queued."""
        import torch

        if self._stream is None:
            return contextlib.nullcontext()
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._stream)
