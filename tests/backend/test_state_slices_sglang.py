"""sgl_pd cuts a state slot between TP sizes as SGLang's own Mamba transfer does
(`compute_mamba_state_slice_byte_blocks`): for GDN's grouped conv axis, a plain head
axis and Kimi's rows before the axis, every byte of every decode rank's slot comes from
the same prefill rank and offset."""

from __future__ import annotations

import itertools

import pytest

from sgl_pd.core.state_slices import slicing_mismatch, slot_blocks
from sgl_pd.core.wire import StateSlicing

UNIT = 6  # bytes of one unit of the sliced axis


def _sources(blocks: list[tuple[int, int, int]], rank: int) -> dict[int, tuple[int, int]]:
    """Destination byte -> (source rank, source byte)."""
    out: dict[int, tuple[int, int]] = {}
    for s, d, n in blocks:
        for i in range(n):
            assert d + i not in out
            out[d + i] = (rank, s + i)
    return out


@pytest.mark.parametrize("groups", [None, (8, 8, 16), (16, 4, 4)])
@pytest.mark.parametrize("outer", [1, 3])
@pytest.mark.parametrize("src_tp,dst_tp", list(itertools.permutations([1, 2, 4], 2)))
def test_every_byte_comes_from_where_sglang_takes_it(
    groups: tuple[int, ...] | None, outer: int, src_tp: int, dst_tp: int
) -> None:
    from sglang.srt.disaggregation.utils import compute_mamba_state_slice_byte_blocks

    full = sum(groups) if groups else 32
    src_units, dst_units = full // src_tp, full // dst_tp
    src = StateSlicing(units=src_units, outer=outer, groups=groups or ())
    dst = StateSlicing(units=dst_units, outer=outer, groups=groups or ())
    src_item, dst_item = src_units * outer * UNIT, dst_units * outer * UNIT
    assert slicing_mismatch(src, src_item, src_tp, dst, dst_item, dst_tp) is None
    for dst_rank in range(dst_tp):
        ours: dict[int, tuple[int, int]] = {}
        theirs: dict[int, tuple[int, int]] = {}
        for src_rank in range(src_tp):
            # SGLang pairs each decode rank with the prefill ranks of its group
            pairs = (
                src_rank == dst_rank * src_tp // dst_tp
                if src_tp <= dst_tp
                else dst_rank == src_rank * dst_tp // src_tp
            )
            if pairs:
                reference = compute_mamba_state_slice_byte_blocks(
                    src_item_len=src_item, dst_item_len=dst_item, src_dim=src_units,
                    dst_dim=dst_units, outer_count=outer, src_attn_tp_size=src_tp,
                    dst_attn_tp_size=dst_tp, dst_tp_rank_in_group=dst_rank,
                    local_tp_rank_in_group=src_rank,
                    conv_shard_groups=list(groups) if groups else None,
                )  # fmt: skip
                theirs |= _sources(reference, src_rank)
            mine = slot_blocks(src, src_item, src_tp, src_rank, dst, dst_item, dst_tp, dst_rank)
            ours |= _sources(list(mine), src_rank)
        assert ours == theirs and len(ours) == dst_item
