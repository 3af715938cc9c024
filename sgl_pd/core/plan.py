"""Transfer plans: the byte copies that move one chunk of a request's KV (D12-D15).

A region's geometry does not depend on the layer, so a plan computes, once per link, the
(src_offset, dst_offset, nbytes) writes of the chunk inside *one* region - a template -
and repeats it over every (layer, part) region of the layer range. Offsets are bytes
inside the (layer, part) region of each side (see `regions.py`); `batch` adds the
registered base addresses for the layers the caller is about to submit.

Write counts per link, per (layer, part) and page of the chunk (P = page size):
  HND, tokens of the chunk cover the page:   1 write (heads are adjacent), and consecutive
      pages merge when both sides send their whole page (identical sharding, replicas)
  HND, partial page (chunk edge):            1 write per head of the link
  NHD, link carries all heads of both sides: 1 write, consecutive pages merge
  NHD, heads split on either side:           1 write per token slot - the case HND removes
  NHD, split side staged (`relayout`):        1 write, consecutive pages merge; a gathered
      source is a block of the chunk's pages, a receiving destination one of the
      request's pages (`core.relayout`), so their side of the merge always continues
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import numpy.typing as npt

from sgl_pd.core.counting import WriteGroup, chunk_groups
from sgl_pd.core.errors import PlanError
from sgl_pd.core.layout import KvLayout, KvPart, PageLayout
from sgl_pd.core.regions import RegionTable
from sgl_pd.core.relayout import (
    NO_RELAYOUT,
    UNSTAGED,
    ReceivePlacement,
    Relayout,
    StagedLink,
    block_bytes,
    block_positions,
    block_table,
    staged_link,
)
from sgl_pd.core.sharding import ShardLink

I64 = npt.NDArray[np.int64]


@dataclass(frozen=True)
class TokenRange:
    """Token positions [start, stop) of the request (a chunk)."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start < self.stop:
            raise PlanError(f"token range [{self.start}, {self.stop}) is empty or negative")


@dataclass(frozen=True)
class Write:
    """One contiguous copy; offsets are bytes inside the (layer, part) region of each shard."""

    src_shard: int
    dst_shard: int
    layer: int
    part: KvPart
    src_offset: int
    dst_offset: int
    nbytes: int


@dataclass(frozen=True, eq=False)
class LinkWrites:
    """Writes of one link inside one region (arrays of shape (n,), bytes)."""

    link: ShardLink
    src_offsets: I64
    dst_offsets: I64
    lengths: I64
    # offsets inside staged blocks rather than pool regions, per side (`core.relayout`)
    staging: StagedLink = UNSTAGED

    @property
    def count(self) -> int:
        return int(self.lengths.shape[0])

    @cached_property
    def extents(self) -> tuple[int, int]:
        """Bytes of region each side must have: the end of its furthest write."""
        if not self.count:
            return (0, 0)
        return (
            int((self.src_offsets + self.lengths).max()),
            int((self.dst_offsets + self.lengths).max()),
        )


@dataclass(frozen=True, eq=False)
class AddressBatch:
    """What one `batch_transfer_sync_write(session, src_addrs, dst_addrs, lengths)` takes."""

    src_rank: int
    dst_rank: int
    src_addrs: I64  # (n,) absolute addresses
    dst_addrs: I64
    lengths: I64  # bytes


@dataclass(frozen=True, eq=False)
class TransferPlan:
    layout: KvLayout
    tokens: TokenRange
    layers: range
    links: tuple[LinkWrites, ...]
    first_page: int = 0  # logical page of the chunk's first token (gather blocks start there)
    # (chunk pages,) source page ids in gather-block order (what a gather reads); None
    # when no link gathers
    gather_pages: I64 | None = None

    @property
    def num_pages(self) -> int:
        """Logical pages the chunk touches (a gather block holds this many)."""
        return (self.tokens.stop - 1) // self.layout.page_size + 1 - self.first_page

    @property
    def num_writes(self) -> int:
        """Writes over all links, layers and parts."""
        per_region = sum(lw.count for lw in self.links)
        return per_region * len(self.layers) * len(self.layout.parts)

    def gather_block(self, link_index: int) -> int:
        """Bytes of one region's gather block of a gathering link (the chunk's pages)."""
        return block_bytes(self.layout, self.links[link_index].link, self.num_pages)

    def link_tables(
        self,
        link_index: int,
        src_pool: RegionTable,
        dst_pool: RegionTable,
        receive: tuple[ReceivePlacement, int] | None,
    ) -> tuple[RegionTable, RegionTable]:
        """(source, destination) tables one link's writes are addressed against: the
        pools, or for a staged side its blocks. A gathering link's source addresses are
        relative to a block set starting at 0 for the plan's first layer (the writer adds
        where each job's blocks are, `gather_shift`); `receive` = (the destination's
        placement of the request's receive staging, its base address)."""
        lw, layout = self.links[link_index], self.layout
        src, dst = src_pool, dst_pool
        if lw.staging.gathers:
            parts = len(layout.parts)
            block = self.gather_block(link_index)
            src = block_table(layout, 0, self.layers.start * parts, block, len(self.layers) * parts)
        if lw.staging.receives:
            if receive is None:
                raise PlanError("a receiving link needs the destination's receive staging")
            placement, base = receive
            dst = placement.table(layout, link_index, base)
        return src, dst

    def gather_shift(self, link_index: int, layers: range, blocks_addr: int) -> int:
        """What to add to a gathering link's source addresses of `layers` when their
        blocks (one per region, layer-major) start at `blocks_addr`."""
        skipped = (layers.start - self.layers.start) * len(self.layout.parts)
        return blocks_addr - skipped * self.gather_block(link_index)

    def writes(self) -> Iterator[Write]:
        """Every write, layer by layer (slow; for tests and debugging)."""
        for layer in self.layers:
            for part in self.layout.parts:
                for lw in self.links:
                    for s, d, n in zip(
                        lw.src_offsets.tolist(),
                        lw.dst_offsets.tolist(),
                        lw.lengths.tolist(),
                        strict=True,
                    ):
                        yield Write(lw.link.src_rank, lw.link.dst_rank, layer, part, s, d, n)

    def batch(
        self, link_index: int, layers: range, src: RegionTable, dst: RegionTable
    ) -> AddressBatch:
        """Absolute addresses of one link's writes for `layers` (region-major order)."""
        inside = self.layers.start <= layers.start and layers.stop <= self.layers.stop
        if layers.step != 1 or not layers or not inside:
            raise PlanError(f"layers {layers} not a non-empty sub-range of {self.layers}")
        lw = self.links[link_index]
        parts = len(self.layout.parts)
        regions = np.arange(layers.start * parts, layers.stop * parts)  # layer-major
        if regions[-1] >= len(src.regions) or regions[-1] >= len(dst.regions):
            raise PlanError("region table has fewer regions than the layout's layers x parts")
        for name, table, extent in zip(
            ("source", "destination"), (src, dst), lw.extents, strict=True
        ):
            if extent > int(table.lengths[regions].min()):
                raise PlanError(
                    f"{name} shard write ends at byte {extent}, past its region: a page id"
                    " exceeds the registered pool"
                )
        src_addrs = (src.bases[regions][:, None] + lw.src_offsets[None, :]).ravel()
        dst_addrs = (dst.bases[regions][:, None] + lw.dst_offsets[None, :]).ravel()
        lengths = np.tile(lw.lengths, len(regions))
        return AddressBatch(lw.link.src_rank, lw.link.dst_rank, src_addrs, dst_addrs, lengths)

    def batches(
        self, layers: range, src: Mapping[int, RegionTable], dst: Mapping[int, RegionTable]
    ) -> list[AddressBatch]:
        """One batch per link for `layers`, tables keyed by shard rank."""
        return [
            self.batch(i, layers, src[lw.link.src_rank], dst[lw.link.dst_rank])
            for i, lw in enumerate(self.links)
        ]

    def groups(self, chunk_index: int, layer_group_size: int) -> tuple[WriteGroup, ...]:
        """The completion groups this plan issues: one per link with writes and layer group."""
        groups = self.layout.layer_groups(layer_group_size)
        mine = tuple(g for g in groups if g.start in self.layers)
        if not mine or (mine[0].start, mine[-1].stop) != (self.layers.start, self.layers.stop):
            raise PlanError(f"layers {self.layers} are not whole groups of {layer_group_size}")
        first = groups.index(mine[0])
        return tuple(
            g
            for g in chunk_groups(tuple(lw.link for lw in self.links), chunk_index, groups)
            if first <= g.layer_group < first + len(mine) and self.links[g.link_index].count
        )


class AddressedPlan:
    """One sender's writes of a plan, addressed for every layer of the plan in one numpy
    pass per link; a layer group's batch is then a slice of those arrays (a view when the
    sender has one link into the destination, the common case).

    Layer-wise streaming asks for one layer group at a time; planning and addressing
    once per (request, destination, chunk) instead of once per group keeps the work per
    request to one pass over its writes. Arrays are (regions, writes per region), regions
    layer-major over the plan's layers, int64 bytes.
    """

    def __init__(
        self,
        plan: TransferPlan,
        links: Iterable[int],
        src: RegionTable | Mapping[int, RegionTable],
        dst: RegionTable | Mapping[int, RegionTable],
        layer_group_size: int,
    ) -> None:
        """`src` / `dst`: the pool's region table, or one per link index of `links` (a
        staged side's blocks, `core.relayout.block_table`)."""
        self.plan = plan
        # the sender's links that carry writes; a link without writes has no groups
        self.sending = tuple(sorted(i for i in set(links) if plan.links[i].count))
        self._parts = len(plan.layout.parts)
        groups = plan.layout.layer_groups(layer_group_size)
        self._group_of = {layer: g for g, r in enumerate(groups) for layer in r}
        self._group_starts = frozenset(r.start for r in groups)
        self._rows: dict[int, tuple[I64, I64, I64]] = {}
        for i in self.sending:
            whole = plan.batch(i, plan.layers, _table_of(src, i), _table_of(dst, i))
            n = plan.links[i].count
            self._rows[i] = (
                whole.src_addrs.reshape(-1, n),
                whole.dst_addrs.reshape(-1, n),
                whole.lengths.reshape(-1, n),
            )

    @classmethod
    def for_sender(
        cls,
        plan: TransferPlan,
        links: Iterable[int],
        src_pool: RegionTable,
        dst_pool: RegionTable,
        layer_group_size: int,
        receive: tuple[ReceivePlacement, int] | None = None,
    ) -> AddressedPlan:
        """One sender's links addressed against the pools, or each staged side against
        its blocks (`TransferPlan.link_tables`; `receive` as there)."""
        mine = tuple(links)
        tables = {i: plan.link_tables(i, src_pool, dst_pool, receive) for i in mine}
        return cls(
            plan,
            mine,
            {i: src for i, (src, _) in tables.items()},
            {i: dst for i, (_, dst) in tables.items()},
            layer_group_size,
        )

    def group_count(self, layers: range) -> int:
        """Completion groups this sender finishes with `layers` (whole layer groups)."""
        whole = layers.start in self._group_starts and (
            layers.stop == self.plan.layers.stop or layers.stop in self._group_starts
        )
        inside = self.plan.layers.start <= layers.start < layers.stop <= self.plan.layers.stop
        if not (whole and inside):
            raise PlanError(f"layers {layers} are not whole layer groups of {self.plan.layers}")
        spanned = self._group_of[layers.stop - 1] - self._group_of[layers.start] + 1
        return spanned * len(self.sending)

    def columns(self, layers: range) -> tuple[I64, I64, I64]:
        """(source addresses, destination addresses, lengths) of every sending link for
        `layers`, link after link: views of the addressed arrays when one link sends."""
        first = (layers.start - self.plan.layers.start) * self._parts
        rows = slice(first, first + len(layers) * self._parts)
        if len(self.sending) == 1:
            src, dst, lengths = self._rows[self.sending[0]]
            return src[rows].ravel(), dst[rows].ravel(), lengths[rows].ravel()
        parts = [[a[rows].ravel() for a in self._rows[i]] for i in self.sending]
        src, dst, lengths = (np.concatenate(column) for column in zip(*parts, strict=True))
        return src, dst, lengths

    def batch(self, link_index: int, layers: range) -> AddressBatch:
        """Absolute addresses of one of this sender's links for `layers`."""
        lw = self.plan.links[link_index]
        first = (layers.start - self.plan.layers.start) * self._parts
        rows = slice(first, first + len(layers) * self._parts)
        src, dst, lengths = (a[rows].ravel() for a in self._rows[link_index])
        return AddressBatch(lw.link.src_rank, lw.link.dst_rank, src, dst, lengths)


def _table_of(tables: RegionTable | Mapping[int, RegionTable], link_index: int) -> RegionTable:
    return tables if isinstance(tables, RegionTable) else tables[link_index]


def _coalesce(src: I64, dst: I64, length: I64) -> tuple[I64, I64, I64]:
    """Fewest writes for these spans: in source address order, merge each span into the
    previous one when both sides continue it in memory (so descending page runs merge too)."""
    if src.shape[0] <= 1:
        return src, dst, length
    if np.any(src[1:] < src[:-1]):
        order = np.argsort(src, kind="stable")
        src, dst, length = src[order], dst[order], length[order]
    breaks = (src[1:] != src[:-1] + length[:-1]) | (dst[1:] != dst[:-1] + length[:-1])
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    return src[starts], dst[starts], np.add.reduceat(length, starts)


def _written(
    link: ShardLink, spans: tuple[I64, I64, I64], staging: StagedLink = UNSTAGED
) -> LinkWrites:
    src, dst, lengths = _frozen(*spans)
    return LinkWrites(link, src, dst, lengths, staging)


def _frozen(*arrays: I64) -> tuple[I64, ...]:
    out = tuple(np.ascontiguousarray(a) for a in arrays)
    for a in out:
        a.flags.writeable = False
    return out


def _pages(pages: Sequence[int] | I64, name: str, first: int, last: int) -> I64:
    arr = np.asarray(pages)
    if arr.ndim != 1 or arr.shape[0] <= last:
        raise PlanError(f"{name} page list covers {arr.size} pages, the chunk needs {last + 1}")
    if arr.dtype.kind not in "iu":
        raise PlanError(f"{name} page ids must be integers, got {arr.dtype}")
    used = arr[first : last + 1].astype(np.int64, copy=False)
    if used.min() < 0:
        raise PlanError(f"{name} page ids must be >= 0")
    if np.unique(used).shape[0] != used.shape[0]:
        raise PlanError(f"{name} page ids repeat inside the chunk")
    return used


def plan_transfer(
    layout: KvLayout,
    links: tuple[ShardLink, ...],
    src_pages: Sequence[int] | I64,
    dst_pages: Sequence[int] | I64,
    tokens: TokenRange,
    layers: range | None = None,
    relayout: Relayout = NO_RELAYOUT,
    *,
    src_first_page: int = 0,
    held_pages: int = 0,
) -> TransferPlan:
    """Plan the writes of tokens `tokens` for `layers` (default all).

    Page list entry i holds logical page `first + i` of the request on that side, tokens
    [(first + i) * page_size, (first + i + 1) * page_size); only the pages the chunk
    touches are read (and must be distinct, >= 0). The destination holds the request's
    first `held_pages` pages already (its prefix cache): its list starts after them, so
    no write can name a held page, and a chunk starting inside them is refused.
    `relayout` says which strided sides may be staged (`core.relayout`).
    """
    layers = range(layout.num_layers) if layers is None else layers
    if layers.step != 1 or not layers or layers.start < 0 or layers.stop > layout.num_layers:
        raise PlanError(f"layers {layers} not a non-empty range inside [0, {layout.num_layers})")
    chunk = _Chunk(
        layout, src_pages, dst_pages, tokens, src_first_page, held_pages, relayout.receive_all
    )
    writes = tuple(chunk.link_writes(lk, staged_link(layout, lk, relayout)) for lk in links)
    gathering = any(lw.staging.gathers for lw in writes)
    gather_pages = None
    if gathering:  # the chunk's source pages in the order of its block pages
        gather_pages = chunk.sp if chunk.logical else chunk.sp[np.argsort(chunk.dp, kind="stable")]
    return TransferPlan(layout, tokens, layers, writes, chunk.first, gather_pages)


class _Chunk:
    """Per-chunk geometry shared by the links of one plan."""

    def __init__(
        self,
        layout: KvLayout,
        src_pages: Sequence[int] | I64,
        dst_pages: Sequence[int] | I64,
        tokens: TokenRange,
        src_first_page: int,
        held_pages: int,
        logical: bool,
    ) -> None:
        self.hnd = layout.page_layout is PageLayout.HND
        # staged blocks hold pages in the request's order, not in destination page-id
        # order (`core.relayout.ReceivePlacement.logical`)
        self.logical = logical
        self.size, self.row = layout.page_size, layout.row_bytes  # tokens, bytes
        self.tokens = tokens
        self.first = tokens.start // self.size  # logical pages of the request
        last = (tokens.stop - 1) // self.size
        if src_first_page < 0 or held_pages < 0:
            raise PlanError("page lists start at a logical page >= 0")
        if tokens.start < held_pages * self.size:
            raise PlanError(
                f"tokens [{tokens.start}, {tokens.stop}) start inside the destination's held"
                f" prefix ({held_pages * self.size} tokens): a held page is never written"
            )
        if tokens.start < src_first_page * self.size:
            raise PlanError(
                f"tokens [{tokens.start}, {tokens.stop}) start before the source page list"
                f" (logical page {src_first_page})"
            )
        # (n_pages,) page ids of the chunk's pages on each side
        self.sp = _pages(src_pages, "source", self.first - src_first_page, last - src_first_page)
        self.dp = _pages(dst_pages, "destination", self.first - held_pages, last - held_pages)
        self.held = held_pages
        self.dp_all = np.asarray(dst_pages, dtype=np.int64)  # (request pages past held,)
        starts = np.arange(self.first, last + 1, dtype=np.int64) * self.size  # first tokens
        self.lo = np.maximum(tokens.start - starts, 0)  # (n_pages,) slots [lo, hi) of a page
        self.hi = np.minimum(tokens.stop - starts, self.size)
        self._slots: tuple[I64, I64] | None = None
        self._arrays: dict[tuple[str, int, int], I64] = {}

    def link_writes(self, link: ShardLink, staging: StagedLink) -> LinkWrites:
        size, row, lo, hi = self.size, self.row, self.lo, self.hi
        nh, hs, hd = link.num_heads, link.src_local_heads, link.dst_local_heads
        if staging.receives and not staging.gathers and nh < hs:
            # a strided source that cannot gather, into receive blocks: one span per token
            # slot (as without staging), landing where the decoder's scatter reads it
            src_slots, _ = self._token_slots()
            t = np.arange(self.tokens.start, self.tokens.stop, dtype=np.int64)
            block_page = self.request_positions[t // size - self.held]
            s = (src_slots * hs + link.src_head_offset) * row
            d = (block_page * size + t % size) * nh * row
            return _written(link, (s, d, np.full(s.shape, nh * row, np.int64)), staging)
        if staging.staged:
            # NHD with a staged strided side: one span per page. Gather blocks hold the
            # chunk's pages in order, receive blocks the request's (logical page p at
            # p * page_size rows), nh heads a row; an unstaged side has all its heads.
            if staging.gathers:  # block page of each chunk page: (n_pages,)
                order = np.arange(self.dp.shape[0]) if self.logical else block_positions(self.dp)
                s = (order * size + lo) * nh * row
            else:
                s = (self.sp * size + lo) * hs * row
            if staging.receives:  # the request's block page of each chunk page
                n, first = self.dp.shape[0], self.first - self.held
                p = self.request_positions[first : first + n]
                d = (p * size + lo) * nh * row
            else:
                d = (self.dp * size + lo) * hd * row
            writes = _coalesce(s, d, (hi - lo) * nh * row)
            return _written(link, writes, staging)
        if self.hnd:
            # (pages, heads, page_size, head_dim): one span per (page, head); heads merge
            # when the chunk covers the page, pages merge when a side's slice is its page.
            j = np.arange(nh, dtype=np.int64)[None, :]
            s = ((self.sp[:, None] * hs + link.src_head_offset + j) * size + lo[:, None]) * row
            d = ((self.dp[:, None] * hd + link.dst_head_offset + j) * size + lo[:, None]) * row
            n = np.broadcast_to(((hi - lo) * row)[:, None], s.shape)
            return _written(link, _coalesce(s.ravel(), d.ravel(), n.ravel()))
        if nh == hs == hd:
            # NHD, all heads of both sides: one span per page; consecutive pages merge.
            s, d = (self.sp * size + lo) * hs * row, (self.dp * size + lo) * hd * row
            return _written(link, _coalesce(s, d, (hi - lo) * hs * row))
        # NHD with split heads: one span per token slot. Never mergeable: on the split side
        # consecutive slots are hs*row (or hd*row) apart but only nh*row long. Links often
        # share a side's geometry (TP8->TP4: every source sends all its heads), and the
        # arrays are read-only, so each distinct one is built once per chunk.
        src_slots, dst_slots = self._token_slots()
        s_first, d_first = link.src_head_offset, link.dst_head_offset
        return LinkWrites(
            link,
            self._shared(("src", hs, s_first), lambda: (src_slots * hs + s_first) * row),
            self._shared(("dst", hd, d_first), lambda: (dst_slots * hd + d_first) * row),
            self._shared(("len", nh, 0), lambda: np.full(src_slots.shape, nh * row, np.int64)),
        )

    @cached_property
    def request_positions(self) -> I64:
        """(request pages past held,) block page of each of the request's destination
        pages (receive staging holds only the pages that are written)."""
        if self.logical:
            return np.arange(self.dp_all.shape[0], dtype=np.int64)
        return block_positions(self.dp_all)

    def _token_slots(self) -> tuple[I64, I64]:
        """(n_tokens,) slot index (page * page_size + slot) of each token, per side."""
        if self._slots is None:
            t = np.arange(self.tokens.start, self.tokens.stop, dtype=np.int64)
            page_i, slot = t // self.size - self.first, t % self.size
            self._slots = (self.sp[page_i] * self.size + slot, self.dp[page_i] * self.size + slot)
        return self._slots

    def _shared(self, key: tuple[str, int, int], make: Callable[[], I64]) -> I64:
        if key not in self._arrays:
            self._arrays[key] = _frozen(make())[0]
        return self._arrays[key]
