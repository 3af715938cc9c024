"""Which bytes of a state slot go from a prefill rank to a decode rank of another TP size.

TP splits a layer's state as it splits its heads: a slot of one region holds, on each
rank, `units` consecutive *units* of the slot's sliced axis (`wire.StateSlicing`), e.g.

- a Mamba / gated-DeltaNet recurrent state, `(slots, heads/tp, head_dim, state)`: a unit
  is one head, `head_dim * state` elements;
- its conv state, `(slots, conv_dim/tp, kernel - 1)`, whose axis is the concatenation
  `[q | k | v]`, each sub-block split by TP on its own (`groups` = their full sizes):
  rank r holds `[q_r | k_r | v_r]`, so one global range is three ranges of a slot;
- a sliding-window page in NHD order, `(page_size, heads/tp, head_dim)`: a unit is one
  head of one token, repeated `outer = page_size` times per slot.

Rank r of TP t holds units `[r * G / t, (r + 1) * G / t)` of each group of G units.
A prefill rank writes a decode rank's slot wherever their units overlap (one block per
group and outer row, merged where contiguous on both sides): a decode rank of a smaller
TP size gathers its slot from several prefill ranks, one of a larger TP size takes part
of one rank's. At one TP size every rank writes its peer's whole slot, one block.

A slot with `units == 0` is the same on every rank (replicated across TP): one elected
prefill rank writes it whole (`elected_source`).

Pure arithmetic: both roles run it, the prefill to write, the decoder to know whose
count words to read (`writers_into`).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Hashable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

Block = tuple[int, int, int]  # (source offset, destination offset, bytes) inside one slot
I64 = npt.NDArray[np.int64]


class StateSlicing(Hashable, Protocol):
    """How TP splits one region's slot (`wire.StateSlicing`)."""

    @property
    def units(self) -> int: ...  # sliced units in one row on this rank (0: replicated)
    @property
    def outer(self) -> int: ...  # rows per slot
    @property
    def groups(self) -> tuple[int, ...]: ...  # full units of each sub-block (): one


class Based(Protocol):
    @property
    def base(self) -> int: ...  # absolute address, bytes


class StateSlots(Hashable, Protocol):
    """One state component of a rank (`wire.StateSlots`), as far as slicing needs.
    Hashable (the functions below keep their answers per pair of components)."""

    @property
    def kind(self) -> str: ...
    @property
    def regions(self) -> Sequence[Based]: ...
    @property
    def slot_bytes(self) -> tuple[int, ...]: ...  # one slot of each region
    @property
    def slicing(self) -> Sequence[StateSlicing]: ...  # per region, () when unknown


def elected_source(src_tp: int, dst_tp: int, dst_rank: int) -> int:
    """The prefill rank that writes decode rank `dst_rank`'s copy of a replicated slot:
    the first prefill rank whose share of the heads meets the decode rank's."""
    return dst_rank * src_tp // dst_tp


def _groups(slicing: StateSlicing, tp: int) -> tuple[int, ...]:
    """Full units of each independently split sub-block of the axis."""
    return slicing.groups or (slicing.units * tp,)


def slicing_mismatch(
    src: StateSlicing, src_item: int, src_tp: int, dst: StateSlicing, dst_item: int, dst_tp: int
) -> str | None:
    """Why a slot sliced as `src` on a rank of TP `src_tp` (`src_item` bytes) cannot
    be written into one sliced as `dst` on a rank of TP `dst_tp`, or None."""
    if (src.units == 0) != (dst.units == 0):
        return "one server keeps the state whole on every rank, the other splits it"
    if src.units == 0:
        return None if src_item == dst_item else f"slots of {src_item} and {dst_item} bytes"
    if src.outer != dst.outer:
        return f"{src.outer} and {dst.outer} rows per slot"
    src_groups, dst_groups = _groups(src, src_tp), _groups(dst, dst_tp)
    if src_groups != dst_groups:
        return f"the state's axis splits as {list(src_groups)} and as {list(dst_groups)}"
    for tp, slicing in ((src_tp, src), (dst_tp, dst)):
        if any(g % tp for g in src_groups) or sum(g // tp for g in src_groups) != slicing.units:
            return f"{list(src_groups)} units do not split evenly over TP {tp}"
    src_unit, rest = divmod(src_item, src.units * src.outer)
    dst_unit, dst_rest = divmod(dst_item, dst.units * dst.outer)
    if rest or dst_rest or src_unit != dst_unit:
        return f"{src_item}-byte and {dst_item}-byte slots hold units of different sizes"
    return None


def slot_blocks(
    src: StateSlicing,
    src_item: int,
    src_tp: int,
    src_rank: int,
    dst: StateSlicing,
    dst_item: int,
    dst_tp: int,
    dst_rank: int,
) -> tuple[Block, ...]:
    """The blocks prefill rank `src_rank` writes into decode rank `dst_rank`'s slot (the
    two agreed by `slicing_mismatch`), in source order, contiguous runs merged."""
    if src.units == 0:
        whole = src_rank == elected_source(src_tp, dst_tp, dst_rank)
        return ((0, 0, src_item),) if whole else ()
    unit = src_item // (src.units * src.outer)  # bytes
    blocks: list[Block] = []
    for row in range(src.outer):
        src_at, dst_at = row * src.units, row * dst.units  # units into the slot
        for full in _groups(src, src_tp):
            src_n, dst_n = full // src_tp, full // dst_tp  # this group's units per rank
            src_lo, dst_lo = src_rank * src_n, dst_rank * dst_n  # global units
            lo, hi = max(src_lo, dst_lo), min(src_lo + src_n, dst_lo + dst_n)
            if lo < hi:
                piece = ((src_at + lo - src_lo) * unit, (dst_at + lo - dst_lo) * unit)
                _append_merged(blocks, (*piece, (hi - lo) * unit))
            src_at, dst_at = src_at + src_n, dst_at + dst_n
    return tuple(blocks)


def _append_merged(blocks: list[Block], block: Block) -> None:
    if blocks:
        s, d, n = blocks[-1]
        if s + n == block[0] and d + n == block[1]:
            blocks[-1] = (s, d, n + block[2])
            return
    blocks.append(block)


def component_mismatch(src: StateSlots, src_tp: int, dst: StateSlots, dst_tp: int) -> str | None:
    """Why prefill rank slots `src` (TP `src_tp`) cannot be written into decode rank
    slots `dst` (TP `dst_tp`) region by region, or None."""
    if src_tp == dst_tp:
        return None if src.slot_bytes == dst.slot_bytes else "slots of different sizes"
    if not src.slicing or not dst.slicing:
        return "the server does not say how TP splits it"
    if len(src.slicing) != len(src.slot_bytes) or len(dst.slicing) != len(dst.slot_bytes):
        return "the server describes how TP splits some of its regions only"
    if len(src.slot_bytes) != len(dst.slot_bytes):
        return f"{len(src.slot_bytes)} and {len(dst.slot_bytes)} regions"
    parts = zip(src.slicing, src.slot_bytes, dst.slicing, dst.slot_bytes, strict=True)
    return next(
        (why for s, si, d, di in parts if (why := slicing_mismatch(s, si, src_tp, d, di, dst_tp))),
        None,
    )


@functools.lru_cache(maxsize=256)
def region_blocks(
    src: StateSlots, src_tp: int, src_rank: int, dst: StateSlots, dst_tp: int, dst_rank: int
) -> tuple[tuple[Block, ...], ...]:
    """The blocks of each region's slot that `src_rank` writes into `dst_rank`'s (the
    two components agreed by `component_mismatch`); one whole-slot block per region at
    one TP size."""
    if src_tp == dst_tp:
        whole = src_rank == dst_rank
        return tuple(((0, 0, n),) if whole else () for n in src.slot_bytes)
    parts = zip(src.slicing, src.slot_bytes, dst.slicing, dst.slot_bytes, strict=True)
    return tuple(
        slot_blocks(s, si, src_tp, src_rank, d, di, dst_tp, dst_rank) for s, si, d, di in parts
    )


@functools.lru_cache(maxsize=256)
def writers_into(
    src: tuple[StateSlots, ...],
    src_tp: int,
    dst: tuple[StateSlots, ...],
    dst_tp: int,
    dst_rank: int,
) -> tuple[int, ...]:
    """The prefill ranks that write some of decode rank `dst_rank`'s state (each once per
    request, counted as one group of its count word: `core.counting`), ascending; ()
    for state the two cannot move (`component_mismatch`): the prefill refuses such a
    pair (`backend.state_slots.slot_mismatch`), so the request fails with the reason."""
    if len(src) != len(dst) or any(
        component_mismatch(s, src_tp, d, dst_tp) is not None for s, d in zip(src, dst, strict=False)
    ):
        return ()
    return tuple(
        r
        for r in range(src_tp)
        if any(
            any(region_blocks(s, src_tp, r, d, dst_tp, dst_rank))
            for s, d in zip(src, dst, strict=True)
        )
    )


def slot_writes(
    src: StateSlots,
    dst: StateSlots,
    blocks: tuple[tuple[Block, ...], ...],
    src_slots: Sequence[int],
    dst_slots: Sequence[int],
    regions: Collection[int] | None = None,
) -> tuple[I64, I64, I64]:
    """(sources, destinations, lengths), absolute: `blocks` (`region_blocks`) of slot
    `src_slots[i]` of every region of `src` (or of `regions` only) into slot
    `dst_slots[i]` of `dst`'s, slot pair after slot pair. Columns of (pairs * blocks,)
    int64: a window of thousands of pages cut token by token is hundreds of thousands
    of writes."""
    src_at, dst_at, src_item, dst_item, lengths, region = _block_columns(src, dst, blocks)
    if regions is not None:
        keep = np.isin(region, np.fromiter(regions, dtype=np.int64, count=len(regions)))
        src_at, dst_at, src_item, dst_item = (
            src_at[keep],
            dst_at[keep],
            src_item[keep],
            dst_item[keep],
        )
        lengths = lengths[keep]
    src_slot = np.asarray(src_slots, dtype=np.int64)[:, None]
    dst_slot = np.asarray(dst_slots, dtype=np.int64)[:, None]
    pairs = len(src_slots)
    return (
        (src_at + src_slot * src_item).reshape(-1),
        (dst_at + dst_slot * dst_item).reshape(-1),
        np.broadcast_to(lengths, (pairs, lengths.size)).reshape(-1),
    )


@functools.lru_cache(maxsize=256)
def _block_columns(
    src: StateSlots, dst: StateSlots, blocks: tuple[tuple[Block, ...], ...]
) -> tuple[I64, I64, I64, I64, I64, I64]:
    """Per block of slot 0, in region order: its source and destination address, the
    slot sizes of its regions (the stride to the next slot), its length and region."""
    columns: list[tuple[int, int, int, int, int, int]] = [
        (s_region.base + s, d_region.base + d, s_item, d_item, n, r)
        for r, (s_region, d_region, s_item, d_item, region) in enumerate(
            zip(src.regions, dst.regions, src.slot_bytes, dst.slot_bytes, blocks, strict=True)
        )
        for s, d, n in region
    ]
    table = np.asarray(columns, dtype=np.int64).reshape(-1, 6)
    table.flags.writeable = False  # (kept for every later request of the pair)
    return tuple(table[:, i] for i in range(6))  # type: ignore[return-value]
