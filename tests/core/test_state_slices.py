"""Slices of a state slot between ranks of different TP sizes (`core.state_slices`):
whatever the split (sub-blocks split on their own, rows of a page, a replicated slot),
the prefill ranks' blocks rebuild every decode rank's slot exactly, each byte written
once, none outside the slot; and the decoder reads the count words of exactly the ranks
that write."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_pd.core.regions import Region
from sgl_pd.core.state_slices import (
    component_mismatch,
    elected_source,
    region_blocks,
    slicing_mismatch,
    slot_blocks,
    slot_writes,
    writers_into,
)
from sgl_pd.core.wire import StateSlicing, StateSlots

TPS = (1, 2, 4, 8)


def shard(whole: np.ndarray, groups: tuple[int, ...], rank: int, tp: int) -> np.ndarray:
    """Rank `rank`'s slot (flat bytes) of a whole slot `whole`, (rows, units, unit_bytes):
    each row holds the rank's share of every group, groups in order (the oracle)."""
    rows = []
    at = 0
    for row in whole:
        parts, at = [], 0
        for full in groups:
            n = full // tp
            parts.append(row[at + rank * n : at + (rank + 1) * n])
            at += full
        rows.append(np.concatenate(parts))
    return np.stack(rows).reshape(-1)


def slicing_of(groups: tuple[int, ...], tp: int, outer: int, grouped: bool) -> StateSlicing:
    units = sum(g // tp for g in groups)
    return StateSlicing(units=units, outer=outer, groups=groups if grouped else ())


@st.composite
def splits(draw: st.DrawFn) -> tuple[tuple[int, ...], int, int, int, int, bool]:
    """(groups, prefill TP, decode TP, rows, unit bytes, grouped): group sizes that both
    TP sizes divide."""
    src_tp, dst_tp = draw(st.sampled_from(TPS)), draw(st.sampled_from(TPS))
    step = max(src_tp, dst_tp)
    grouped = draw(st.booleans())
    count = draw(st.integers(1, 3)) if grouped else 1
    groups = tuple(step * draw(st.integers(1, 3)) for _ in range(count))
    return groups, src_tp, dst_tp, draw(st.integers(1, 4)), draw(st.integers(1, 5)), grouped


@settings(max_examples=300, deadline=None)
@given(splits(), st.integers(0, 2**31))
def test_the_prefill_ranks_blocks_rebuild_every_decode_ranks_slot(split, seed) -> None:  # type: ignore[no-untyped-def]
    groups, src_tp, dst_tp, outer, unit, grouped = split
    rng = np.random.default_rng(seed)
    whole = rng.integers(0, 255, (outer, sum(groups), unit), dtype=np.uint8)
    src_s = slicing_of(groups, src_tp, outer, grouped)
    dst_s = slicing_of(groups, dst_tp, outer, grouped)
    src_item = src_s.units * outer * unit
    dst_item = dst_s.units * outer * unit
    if not grouped and len(groups) == 1:
        assert slicing_mismatch(src_s, src_item, src_tp, dst_s, dst_item, dst_tp) is None
    for dst_rank in range(dst_tp):
        got = np.zeros(dst_item, np.uint8)
        written = np.zeros(dst_item, np.int64)
        for src_rank in range(src_tp):
            mine = shard(whole, groups, src_rank, src_tp)
            blocks = slot_blocks(
                src_s, src_item, src_tp, src_rank, dst_s, dst_item, dst_tp, dst_rank
            )
            for s, d, n in blocks:
                assert n > 0 and s >= 0 and s + n <= src_item and d >= 0 and d + n <= dst_item
                got[d : d + n] = mine[s : s + n]
                written[d : d + n] += 1
        assert (written == 1).all(), written
        assert (got == shard(whole, groups, dst_rank, dst_tp)).all()


@given(st.sampled_from(TPS), st.sampled_from(TPS), st.integers(1, 64))
def test_a_replicated_slot_is_written_whole_by_one_elected_rank(src_tp, dst_tp, item) -> None:  # type: ignore[no-untyped-def]
    whole = StateSlicing(units=0)
    assert slicing_mismatch(whole, item, src_tp, whole, item, dst_tp) is None
    for dst_rank in range(dst_tp):
        writers = [
            r
            for r in range(src_tp)
            if slot_blocks(whole, item, src_tp, r, whole, item, dst_tp, dst_rank)
        ]
        assert writers == [elected_source(src_tp, dst_tp, dst_rank)]
        (block,) = slot_blocks(whole, item, src_tp, writers[0], whole, item, dst_tp, dst_rank)
        assert block == (0, 0, item)


def test_one_tp_size_moves_each_slot_whole_from_its_peer() -> None:
    component = _component(((8, StateSlicing(units=2)), (24, StateSlicing(units=4, outer=3))))
    assert region_blocks(component, 2, 1, component, 2, 1) == (((0, 0, 8),), ((0, 0, 24),))
    assert region_blocks(component, 2, 0, component, 2, 1) == ((), ())
    assert writers_into((component,), 2, (component,), 2, 1) == (1,)


def test_a_grouped_conv_slot_takes_three_pieces_from_each_rank() -> None:
    """GDN's conv state [q | k | v], 4 units each: TP2 -> TP1 writes each prefill rank's
    two units of q, k and v at their places (6 bytes a unit)."""
    src = StateSlicing(units=6, groups=(4, 4, 4))
    dst = StateSlicing(units=12, groups=(4, 4, 4))
    blocks = slot_blocks(src, 36, 2, 1, dst, 72, 1, 0)
    assert blocks == ((0, 12, 12), (12, 36, 12), (24, 60, 12))


def test_pairs_that_cannot_be_split_say_why() -> None:
    two = StateSlicing(units=2)
    assert "whole on every rank" in (slicing_mismatch(two, 8, 1, StateSlicing(units=0), 8, 2) or "")
    assert "rows per slot" in (
        slicing_mismatch(StateSlicing(units=2, outer=2), 16, 1, StateSlicing(units=1), 8, 2) or ""
    )
    assert "split evenly over TP 4" in (
        slicing_mismatch(
            StateSlicing(units=6, groups=(6,)), 12, 1, StateSlicing(units=1, groups=(6,)), 2, 4
        )
        or ""
    )
    assert "units of different sizes" in (
        slicing_mismatch(two, 8, 1, StateSlicing(units=1), 8, 2) or ""
    )
    unsliced = _component(((8, None),))
    sliced = _component(((4, StateSlicing(units=1)),))
    assert "does not say how TP splits" in (component_mismatch(unsliced, 1, sliced, 2) or "")
    # the decoder then expects no state writers: the prefill refuses the pair
    assert writers_into((unsliced,), 1, (sliced,), 2, 0) == ()


def _component(regions: tuple[tuple[int, StateSlicing | None], ...]) -> StateSlots:
    slicing = tuple(s for _, s in regions if s is not None)
    return StateSlots(
        kind="mamba",
        regions=tuple(Region(0x1000 * (i + 1), 4 * n) for i, (n, _) in enumerate(regions)),
        slot_bytes=tuple(n for n, _ in regions),
        slots=4,
        slicing=slicing,
    )


@given(st.sampled_from(TPS), st.sampled_from(TPS), st.sets(st.integers(0, 2)), st.data())
def test_writes_of_some_regions_are_the_whole_slots_writes_of_those_regions(
    src_tp: int, dst_tp: int, some: set[int], data: st.DataObject
) -> None:
    """Layer-wise streaming writes a slot region by region as the forward finishes
    their layers: any split of the regions writes exactly the whole slot's writes."""
    heads, rows = 8, 2
    regions = ((heads, rows), (heads * 2, 1), (0, 1))  # (sliced units, rows); 0: replicated

    def side(tp: int) -> StateSlots:
        slicing = tuple(
            StateSlicing(units=n // tp, outer=o) if n else StateSlicing(units=0) for n, o in regions
        )
        items = tuple(4 * (o * n // tp if n else 3) for n, o in regions)
        return StateSlots(
            kind="mamba",
            regions=tuple(Region(0x10000 * (i + 1), 8 * n) for i, n in enumerate(items)),
            slot_bytes=items,
            slots=8,
            slicing=slicing,
        )

    src, dst = side(src_tp), side(dst_tp)
    src_rank = data.draw(st.integers(0, src_tp - 1))
    dst_rank = data.draw(st.integers(0, dst_tp - 1))
    blocks = region_blocks(src, src_tp, src_rank, dst, dst_tp, dst_rank)
    src_slots, dst_slots = [3, 1], [5, 0]
    whole = slot_writes(src, dst, blocks, src_slots, dst_slots)
    rest = set(range(len(regions))) - some
    parts = [slot_writes(src, dst, blocks, src_slots, dst_slots, part) for part in (some, rest)]

    def rows(columns: tuple[np.ndarray, ...]) -> set[tuple[int, int, int]]:
        return set(zip(*(c.tolist() for c in columns), strict=True))

    assert rows(parts[0]) | rows(parts[1]) == rows(whole)
    assert len(parts[0][0]) + len(parts[1][0]) == len(whole[0])
