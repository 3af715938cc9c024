"""Keyed KV checksums: sums that both sides compute the same however each is sharded and
chunked (additive over tokens and heads), that change with any changed byte, misplaced
token or head, and that the torch implementation on the pool computes exactly."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_pd.core.kv_checksum import (
    MASK,
    add,
    checksum_key,
    head_weights,
    region_sum,
    token_weights,
)

ROW = 16  # bytes per head row: two words
KEY, ROOM, REGION = checksum_key(b"a cluster secret of 16+ bytes"), 77, 3


def _sum(rows: np.ndarray, start: int, head_lo: int) -> int:
    tokens, heads = rows.shape[0], rows.shape[1]
    return region_sum(
        rows,
        token_weights(KEY, ROOM, REGION, start, start + tokens),
        head_weights(KEY, ROOM, REGION, head_lo, head_lo + heads, ROW),
    )


def _rows(seed: int, tokens: int = 12, heads: int = 4) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (tokens, heads, ROW), dtype=np.uint8)


@given(st.integers(0, 2**32), st.integers(1, 11), st.integers(1, 3))
@settings(max_examples=50, deadline=None)
def test_sums_add_up_over_chunks_and_head_shards(seed: int, cut: int, heads_cut: int) -> None:
    rows = _rows(seed)
    whole = _sum(rows, 100, 0)
    assert add(_sum(rows[:cut], 100, 0), _sum(rows[cut:], 100 + cut, 0)) == whole
    shards = add(_sum(rows[:, :heads_cut], 100, 0), _sum(rows[:, heads_cut:], 100, heads_cut))
    assert shards == whole


@given(st.integers(0, 2**32), st.integers(0, 12 * 4 * ROW - 1), st.integers(1, 255))
@settings(max_examples=200, deadline=None)
def test_any_changed_byte_changes_the_sum(seed: int, where: int, flip: int) -> None:
    rows = _rows(seed)
    changed = rows.copy()
    changed.reshape(-1)[where] ^= flip
    assert _sum(changed, 0, 0) != _sum(rows, 0, 0)


def test_misplaced_tokens_heads_and_other_requests_change_the_sum() -> None:
    rows = _rows(1)
    whole = _sum(rows, 0, 0)
    assert _sum(rows[[1, 0, *range(2, 12)]], 0, 0) != whole  # two tokens swapped
    assert _sum(rows[:, [1, 0, 2, 3]], 0, 0) != whole  # two heads swapped
    assert _sum(rows, 1, 0) != whole  # one position off
    other_room = region_sum(
        rows,
        token_weights(KEY, ROOM + 1, REGION, 0, 12),
        head_weights(KEY, ROOM + 1, REGION, 0, 4, ROW),
    )
    assert other_room != whole
    assert checksum_key(b"another secret") != KEY and 0 <= whole <= MASK


def test_the_pool_sums_equal_the_reference() -> None:
    """`backend.kv_sums` over a pool's pages, any head offset, equals `region_sum` over
    the same rows."""
    from sgl_pd.backend.kv_sums import KvSums, token_slots
    from sgl_pd.core.sharding import ShardLink
    from sgl_pd.transfer.fake import FakeFabric, FakeTransferEngine
    from tests.backend.pd_fakes import LAYOUT, NUM_PAGES, Memory

    memory = Memory.make(FakeTransferEngine(FakeFabric()), fill=3)
    pool = memory.pool()
    sums = KvSums(pool, "cpu", KEY)
    pages = np.array([7, 3, 40, 12], dtype=np.int64)  # logical pages 2..5 of a request
    ps, row = LAYOUT.page_size, LAYOUT.row_bytes
    start, stop = 2 * ps, 6 * ps
    slots = token_slots(pages, 2, start, stop, ps)
    link = ShardLink(0, 0, head_lo=1, head_hi=2, src_head_offset=1, src_local_heads=2,
                     dst_head_offset=0, dst_local_heads=1)  # fmt: skip
    acc = sums.zeros()
    sums.add_link(acc, ROOM, [0, 5], link, 1, (start, stop), slots)
    got = sums.read(acc)
    for region in (0, 5):
        view = memory.kv[region].reshape(NUM_PAGES * ps, LAYOUT.num_kv_heads, row)
        want = region_sum(
            view[slots][:, 1:2],
            token_weights(KEY, ROOM, region, start, stop),
            head_weights(KEY, ROOM, region, 1, 2, row),
        )
        assert got[region] == want
    assert got[1] == 0  # not asked for
