"""Links: every destination head comes from exactly one source, replica sets all send."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_pd.core.errors import ShardingError
from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.sharding import (
    ShardingScheme,
    head_range,
    link_shards,
    local_heads,
    metadata_source,
    replica_sets,
)

TPS = st.sampled_from([1, 2, 4, 8, 16])


def _layout(mla: bool, heads: int) -> KvLayout:
    if mla:
        return KvLayout.mla(
            num_layers=2,
            kv_lora_rank=4,
            rope_dim=2,
            page_size=4,
            elem_bytes=2,
            page_layout=PageLayout.HND,
        )
    return KvLayout.gqa(
        num_layers=2,
        num_kv_heads=heads,
        head_dim=4,
        page_size=4,
        elem_bytes=2,
        page_layout=PageLayout.HND,
    )


@settings(max_examples=200, deadline=None)
@given(
    mla=st.booleans(),
    heads=st.sampled_from([1, 2, 4, 8]),
    tp_p=TPS,
    tp_d=TPS,
    seed=st.integers(0, 2**64 - 1),
)
def test_links_cover_each_destination_once(
    mla: bool, heads: int, tp_p: int, tp_d: int, seed: int
) -> None:
    lay = _layout(mla, heads)
    src, dst = ShardingScheme(tp_p), ShardingScheme(tp_d)
    links = link_shards(lay, src, dst, seed)
    assert links == link_shards(lay, src, dst, seed)  # both sides derive the same links
    for d in range(tp_d):
        d_lo, d_hi = head_range(lay, dst, d)
        got = sorted((lk.head_lo, lk.head_hi) for lk in links if lk.dst_rank == d)
        covered = [h for lo, hi in got for h in range(lo, hi)]
        assert covered == list(range(d_lo, d_hi))
        for lk in links:
            if lk.dst_rank != d:
                continue
            s_lo, s_hi = head_range(lay, src, lk.src_rank)
            assert s_lo <= lk.head_lo < lk.head_hi <= s_hi
            assert lk.src_head_offset == lk.head_lo - s_lo
            assert lk.dst_head_offset == lk.head_lo - d_lo
            assert lk.src_local_heads == local_heads(lay, src)
    # Each destination replica set is fed by exactly one source replica set.
    src_sets = replica_sets(lay, src)
    for dst_set in replica_sets(lay, dst):
        feeding = {lk.src_rank for lk in links if lk.dst_rank in dst_set}
        assert sum(feeding <= set(s) for s in src_sets) == 1
    senders = {lk.src_rank for lk in links}
    if len(replica_sets(lay, dst)) >= len(src_sets):
        assert senders == set(range(tp_p))  # D14: every source device sends
    assert metadata_source(links) in senders


def test_identical_sharding_is_rank_to_rank() -> None:
    for mla in (True, False):
        links = link_shards(_layout(mla, 8), ShardingScheme(8), ShardingScheme(8), 123)
        assert [(lk.src_rank, lk.dst_rank) for lk in links] == [(i, i) for i in range(8)]


def test_mismatched_gqa_shapes() -> None:
    lay = _layout(False, 8)
    down = link_shards(lay, ShardingScheme(8), ShardingScheme(4), 0)  # two sources per page
    assert [(lk.src_rank, lk.dst_rank, lk.dst_head_offset) for lk in down] == [
        (i, i // 2, i % 2) for i in range(8)
    ]
    up = link_shards(lay, ShardingScheme(4), ShardingScheme(8), 0)  # one source, two dests
    assert [(lk.src_rank, lk.dst_rank, lk.src_head_offset) for lk in up] == [
        (i // 2, i, i % 2) for i in range(8)
    ]


def test_replica_choice_spreads_over_seeds() -> None:
    lay = _layout(True, 1)
    used = set()
    for seed in range(64):
        links = link_shards(lay, ShardingScheme(8), ShardingScheme(2), seed)
        assert len(links) == 2 and len({lk.src_rank for lk in links}) == 2
        used |= {lk.src_rank for lk in links}
    assert used == set(range(8))


def test_replicated_gqa_heads() -> None:
    lay = _layout(False, 2)
    scheme = ShardingScheme(8)
    assert [head_range(lay, scheme, r) for r in range(8)] == [
        (r // 4, r // 4 + 1) for r in range(8)
    ]
    assert replica_sets(lay, scheme) == ((0, 4), (1, 5), (2, 6), (3, 7))


def test_invalid_schemes() -> None:
    with pytest.raises(ShardingError):
        ShardingScheme(0)
    with pytest.raises(ShardingError):
        local_heads(_layout(False, 8), ShardingScheme(3))
    with pytest.raises(ShardingError):
        head_range(_layout(False, 8), ShardingScheme(2), 2)
    with pytest.raises(ShardingError):
        metadata_source(())
