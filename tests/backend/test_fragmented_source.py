"""A prefill rank whose own prefix cache scattered its pages gathers a chunk of them into
its gather area and writes it in the destination's runs: a write per region instead of
one per short source run. Gathering is only an optimisation there: with the area full
the chunk goes out as it lies, and the same bytes arrive either way."""

from __future__ import annotations

import numpy as np
import pytest

from sgl_pd.core.relayout import page_runs
from sgl_pd.core.states import DecodeState

from .pd_fakes import LAYOUT, NUM_PAGES, Rig, wait_state

GATHER_BYTES = 1 << 16  # holds one layer of the whole request


@pytest.mark.parametrize("area_free", [True, False])
def test_fragmented_source_pages_are_gathered_unless_the_area_is_full(area_free: bool) -> None:
    rig = Rig(gather_bytes=GATHER_BYTES)
    d = rig.add_decoder("decode-a")
    assert rig.gather_area is not None
    try:
        src = [int(p) for p in np.random.default_rng(2).permutation(NUM_PAGES)[:24]]
        dst = list(range(30, 54))  # a fresh decode pool: one run
        runs = page_runs(np.asarray(src, dtype=np.int64))
        assert runs > 12
        taken = None if area_free else rig.gather_area.try_take(rig.gather_area.capacity)
        rig.request(d, 9, dst, slot=1)
        rig.prefill_all(9, src, chunk=24)  # one chunk
        wait_state(d, 9, DecodeState.COMPLETE)
        for s, t in zip(src, dst, strict=True):
            assert d.memory.page(t) == rig.prefill_memory.page(s)
        kv_writes = rig.prefill_engine.data_writes - 1  # and the metadata row's
        assert kv_writes == LAYOUT.num_regions * (1 if area_free else runs)
        assert rig.gather_area.used == (0 if taken is None else rig.gather_area.capacity)
    finally:
        rig.prefill.writers.close()


def test_a_slow_destination_leaves_room_for_another_to_gather() -> None:
    """The area is sized for four jobs' blocks of one layer (after-forward jobs carry every
    layer): a gather only fragmentation asked for takes one layer's blocks at a time, so
    a write stuck on one decoder leaves room for the next decoder's chunk to gather."""
    token_layer = len(LAYOUT.parts) * LAYOUT.num_kv_heads * LAYOUT.row_bytes
    rig = Rig(gather_bytes=4 * 12 * token_layer)  # the default for 12-token chunks
    slow, fast = rig.add_decoder("decode-slow"), rig.add_decoder("decode-fast")
    engine = rig.prefill_engine
    pages = [int(p) for p in np.random.default_rng(5).permutation(NUM_PAGES)]
    try:
        engine.hold_peer, _ = slow.engine.session_id, engine.gate.clear()
        rig.request(slow, 1, list(range(30, 42)), slot=1)
        rig.prefill_all(1, pages[:12], chunk=12)
        assert engine.waiting.wait(5)  # a gathered write to the slow decoder is stuck
        before = engine.data_writes
        rig.request(fast, 2, list(range(42, 54)), slot=2)
        rig.prefill_all(2, pages[12:24], chunk=12)
        wait_state(fast, 2, DecodeState.COMPLETE)
        assert engine.data_writes - before - 1 == LAYOUT.num_regions  # and the metadata row
    finally:
        engine.gate.set()
        rig.prefill.writers.close()
