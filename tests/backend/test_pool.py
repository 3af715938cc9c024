"""`describe_pool` reads SGLang's KVArgs into the core's layer-major regions, a
speculative draft model's buffers included (they follow the target's)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_pd.backend.pool import describe_pool
from sgl_pd.core.layout import AttnKind
from sgl_pd.core.wire import StateSlicing
from sgl_pd.errors import ConfigError

PAGE_BYTES = 64


def _kv_args(num_buffers: int, num_draft: int, **extra: object) -> SimpleNamespace:
    # buffer i lives at 1000 * (i + 1): its base says which SGLang buffer it was
    return SimpleNamespace(
        kv_data_ptrs=[1000 * (i + 1) for i in range(num_buffers)],
        kv_data_lens=[PAGE_BYTES * 10] * num_buffers,
        kv_item_lens=[PAGE_BYTES] * num_buffers,
        num_draft_entries=num_draft,
        page_size=1,
        aux_data_ptrs=[1],
        aux_data_lens=[80],
        aux_item_lens=[8],
        **extra,
    )


def test_an_mla_draft_layer_is_the_last_layer() -> None:
    pool = describe_pool(_kv_args(4, 1), is_mla=True)
    assert pool.layout.kind is AttnKind.MLA
    assert pool.layout.num_layers == 4 and pool.draft_layers == 1
    assert [r.base for r in pool.kv.regions] == [1000, 2000, 3000, 4000]


def test_kv_pools_pair_k_and_v_per_layer_target_first_then_draft() -> None:
    # SGLang: target K0 K1, target V0 V1, then draft K0, draft V0
    args = _kv_args(6, 2, kv_head_num=2, total_kv_head_num=2)
    pool = describe_pool(args, is_mla=False)
    assert pool.layout.num_layers == 3 and pool.draft_layers == 1
    assert [r.base for r in pool.kv.regions] == [1000, 3000, 2000, 4000, 5000, 6000]


def test_no_draft_means_no_draft_layers() -> None:
    pool = describe_pool(_kv_args(3, 0), is_mla=True)
    assert pool.layout.num_layers == 3 and pool.draft_layers == 0


def test_a_draft_with_other_rows_is_refused_with_the_reason() -> None:
    args = _kv_args(3, 1)
    args.kv_item_lens[-1] = PAGE_BYTES * 2
    with pytest.raises(ConfigError, match="draft model's KV rows differ"):
        describe_pool(args, is_mla=True)


def _swa_args(page_size: int) -> dict[str, object]:
    """A hybrid SWA pool: one full layer in the main buffers, one sliding layer's K and V
    (two buffers of 12 window pages) as SGLang's SWA state component."""
    return _kv_args(
        2,
        0,
        kv_head_num=1,
        total_kv_head_num=1,
        state_types=["SWA"],
        state_data_ptrs=[[50_000, 60_000]],
        state_data_lens=[[PAGE_BYTES * 12] * 2],
        state_item_lens=[[PAGE_BYTES] * 2],
    ).__dict__ | {"page_size": page_size}


def test_a_sliding_window_pool_is_described_as_window_pages() -> None:
    args = SimpleNamespace(**_swa_args(1))
    pool = describe_pool(args, is_mla=False, window=16)
    (state,) = pool.state
    assert state.kind == "swa"
    assert (state.window, state.slots, state.slot_bytes) == (16, 12, (64, 64))
    assert [r.base for r in state.regions] == [50_000, 60_000]
    with pytest.raises(ConfigError, match="sliding window is unknown"):
        describe_pool(args, is_mla=False)


def test_a_window_shorter_than_a_page_is_refused_with_the_page_size_that_serves_it() -> None:
    with pytest.raises(ConfigError, match="--page-size 16 or less"):
        describe_pool(SimpleNamespace(**_swa_args(32)), is_mla=False, window=16)


def test_window_pages_split_as_the_kv_heads_do_where_tp_splits_them() -> None:
    """Two of four KV heads on this rank: a window page is (page_size, 2 heads, row)
    in NHD order, (2 heads, page_size, row) in HND; heads replicated over the ranks
    (one KV head, TP 2) say nothing, so only ranks of one TP size pair up."""
    split = SimpleNamespace(**_swa_args(2) | {"kv_head_num": 2, "total_kv_head_num": 4})
    (state,) = describe_pool(split, is_mla=False, window=16, tp_size=2).state
    assert state.slicing == (StateSlicing(units=2, outer=2),) * 2
    split.swa_kv_cache_layout = "hnd"
    (state,) = describe_pool(split, is_mla=False, window=16, tp_size=2).state
    assert state.slicing == (StateSlicing(units=2),) * 2
    replicated = SimpleNamespace(**_swa_args(2))
    (state,) = describe_pool(replicated, is_mla=False, window=16, tp_size=2).state
    assert state.slicing == ()


def test_a_mamba_pool_is_sliced_as_sglang_lists_it() -> None:
    """SGLang's lists per tensor: the sliced axis on this rank (0: replicated), the rows
    before it, and conv's [q | k | v] sub-blocks in full."""
    args = _kv_args(
        2,
        0,
        kv_head_num=1,
        total_kv_head_num=1,
        state_types=["MAMBA"],
        state_data_ptrs=[[50_000, 60_000, 70_000]],
        state_data_lens=[[96 * 4, 256 * 4, 8 * 4]],
        state_item_lens=[[96, 256, 8]],
        state_dim_per_tensor=[[32, 4, 0]],
        state_slice_outer_counts=[[1, 1, 1]],
        state_conv_shard_groups=[[[16, 16, 32], None, None]],
    )
    (state,) = describe_pool(args, is_mla=False, tp_size=2).state
    assert state.slicing == (
        StateSlicing(units=32, groups=(16, 16, 32)),
        StateSlicing(units=4),
        StateSlicing(units=0),
    )
    args.state_dim_per_tensor = [[]]  # an SGLang that does not list them
    assert describe_pool(args, is_mla=False, tp_size=2).state[0].slicing == ()


def test_a_mamba2_conv_without_its_sub_blocks_moves_between_equal_tp_sizes_only() -> None:
    """Mamba2's conv axis is [x | B | C], each split by TP on its own, yet SGLang names
    sub-blocks for GDN and KDA only: cut as one axis, TP 2 -> TP 1 would put B where x
    goes. Such a pool says nothing of its slicing (one TP size only)."""
    args = _kv_args(
        2,
        0,
        kv_head_num=1,
        total_kv_head_num=1,
        state_types=["MAMBA"],
        state_data_ptrs=[[50_000, 60_000]],
        state_data_lens=[[96 * 4, 256 * 4]],
        state_item_lens=[[96, 256]],
        state_dim_per_tensor=[[16, 4]],
        state_slice_outer_counts=[[1, 1]],
        state_conv_shard_groups=[[None, None]],
    )
    assert describe_pool(args, is_mla=False, tp_size=2).state[0].slicing == ()


def test_mla_window_pages_are_whole_on_every_rank() -> None:
    args = SimpleNamespace(**_swa_args(2))
    (state,) = describe_pool(args, is_mla=True, window=16, tp_size=4).state
    assert state.slicing == (StateSlicing(units=0),) * 2


def test_each_state_region_names_the_model_layer_it_holds() -> None:
    """For layer-wise streaming: a Mamba pool's regions in the layers SGLang lists
    (``state_layer_ids``, tensor-major); a hybrid SWA pool's K then V buffers over its
    sliding layers in model order; a component whose lists do not add up names none."""
    mamba = _kv_args(
        2,
        0,
        kv_head_num=1,
        total_kv_head_num=1,
        state_types=["MAMBA"],
        state_data_ptrs=[[50_000, 60_000, 70_000, 80_000]],
        state_data_lens=[[96 * 4] * 4],
        state_item_lens=[[96] * 4],
        state_layer_ids=[[0, 2, 0, 2]],
    )
    assert describe_pool(mamba, is_mla=False).state_layers == ((0, 2, 0, 2),)
    mamba.state_layer_ids = [[0, 2]]  # not one per region
    assert describe_pool(mamba, is_mla=False).state_layers == ((),)
    window = SimpleNamespace(**_swa_args(1))  # one sliding layer's K and V
    pool = describe_pool(window, is_mla=False, window=16, sliding_layers=frozenset({5}))
    assert pool.state_layers == ((5, 5),)
    # two buffers over two sliding layers: an MLA pool's latent per layer; an MHA pool
    # that holds other layers than the model's sliding ones says nothing
    pool = describe_pool(window, is_mla=True, window=16, sliding_layers=frozenset({1, 5}))
    assert pool.state_layers == ((1, 5),)
    pool = describe_pool(window, is_mla=False, window=16, sliding_layers=frozenset({1, 5}))
    assert pool.state_layers == ((),)
    assert describe_pool(window, is_mla=False, window=16).state_layers == ((),)
