"""Independent reference for planner tests: what each shard's pool must hold and how few
writes can move it, derived from the layout definition with numpy indexing. Nothing here
calls the planner, so a planner bug cannot hide in a shared helper."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

U8 = npt.NDArray[np.uint8]


def ref_heads(mla: bool, num_heads: int, tp: int, rank: int) -> tuple[int, int]:
    """Heads [lo, hi) a TP rank holds (SGLang: contiguous blocks, or replicas of one head)."""
    if mla:
        return (0, 1)
    if tp <= num_heads:
        per = num_heads // tp
        return (rank * per, rank * per + per)
    head = rank * num_heads // tp
    return (head, head + 1)


@dataclass
class Arena:
    """One byte buffer holding every region of every shard; addresses are indices into it."""

    data: U8
    used: int = 0

    def take(self, nbytes: int) -> int:
        base = self.used
        self.used += nbytes
        assert self.used <= self.data.shape[0]
        return base


def pool_view(
    arena: Arena, base: int, hnd: bool, pages: int, local: int, page_size: int, row: int
) -> U8:
    """Region at `base` as (pages, local, page_size, row) for HND or (pages, page_size,
    local, row) for NHD, row = head_dim * elem_bytes bytes."""
    shape = (pages, local, page_size, row) if hnd else (pages, page_size, local, row)
    size = pages * local * page_size * row
    return arena.data[base : base + size].reshape(shape)


def put_token(pool: U8, hnd: bool, page: int, slot: int, values: U8) -> None:
    """Store values (local_heads, row) as token `slot` of `page`."""
    if hnd:
        pool[page, :, slot, :] = values
    else:
        pool[page, slot, :, :] = values


def row_address(
    base: int,
    hnd: bool,
    pages: int,
    local: int,
    page_size: int,
    row: int,
    page: int,
    slot: int,
    head: int,
) -> int:
    shape = (pages, local, page_size) if hnd else (pages, page_size, local)
    index = (page, head, slot) if hnd else (page, slot, head)
    return base + int(np.ravel_multi_index(index, shape)) * row


def min_writes(src_addrs: list[int], dst_addrs: list[int], row: int) -> int:
    """Fewest contiguous copies moving rows src_addrs[i] -> dst_addrs[i] of `row` bytes."""
    if not src_addrs:
        return 0
    s = np.array(src_addrs, dtype=np.int64)
    d = np.array(dst_addrs, dtype=np.int64)
    order = np.argsort(s)
    s, d = s[order], d[order]
    breaks = (np.diff(s) != row) | (np.diff(d) != row)
    return 1 + int(breaks.sum())
