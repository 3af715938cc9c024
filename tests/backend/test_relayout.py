"""Re-layout end to end on real bytes: the planner's staged writes, the edge's torch
gather and scatter (CPU), and an in-memory engine that copies between addresses."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_pd.backend.pool import PoolDescription
from sgl_pd.backend.relayout_copies import PoolCopies
from sgl_pd.core.counting import links_into
from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.plan import AddressedPlan, TokenRange, plan_transfer
from sgl_pd.core.regions import Region, RegionTable
from sgl_pd.core.relayout import NO_RELAYOUT, Relayout, receive_placement
from sgl_pd.core.sharding import ShardingScheme, head_range, link_shards, local_heads

TPS = (1, 2, 4, 8)


class Memory:
    """One arena of bytes: pools and staging areas are slices; addresses are real."""

    def __init__(self, nbytes: int, rng: np.random.Generator) -> None:
        self.data = rng.integers(0, 256, nbytes, dtype=np.uint8)
        self.base = int(self.data.ctypes.data)
        self.used = 0

    def take(self, nbytes: int) -> int:
        """Address of `nbytes` fresh bytes."""
        at = self.used
        self.used += nbytes
        assert self.used <= self.data.shape[0]
        return self.base + at

    def tensor(self, addr: int, nbytes: int) -> torch.Tensor:
        at = addr - self.base
        return torch.from_numpy(self.data[at : at + nbytes])

    def copy(self, src: np.ndarray, dst: np.ndarray, lengths: np.ndarray) -> None:
        """The in-memory engine: each write's bytes, source to destination."""
        for s, d, n in zip(src.tolist(), dst.tolist(), lengths.tolist(), strict=True):
            self.data[d - self.base : d - self.base + n] = self.data[
                s - self.base : s - self.base + n
            ].copy()


@dataclass(frozen=True)
class Scenario:
    heads: int
    row: int
    page_size: int
    layers: int
    tp_p: int
    tp_d: int
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    pool_pages: int
    chunks: tuple[tuple[int, int], ...]
    group_size: int
    seed: int

    @property
    def layout(self) -> KvLayout:
        return KvLayout.gqa(
            num_layers=self.layers,
            num_kv_heads=self.heads,
            head_dim=self.row,
            page_size=self.page_size,
            elem_bytes=1,
            page_layout=PageLayout.NHD,
        )


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    page_size = draw(st.sampled_from([1, 16, 64]))
    tokens = draw(st.integers(1, 150))
    pages = -(-tokens // page_size)
    pool = pages + draw(st.integers(0, 3))
    cuts = sorted(draw(st.sets(st.integers(1, tokens - 1), max_size=3))) if tokens > 1 else []
    layers = draw(st.integers(1, 2))
    return Scenario(
        heads=draw(st.sampled_from([1, 2, 8])),
        row=draw(st.integers(1, 4)),
        page_size=page_size,
        layers=layers,
        tp_p=draw(st.sampled_from(TPS)),
        tp_d=draw(st.sampled_from(TPS)),
        src_pages=tuple(draw(st.permutations(range(pool)))[:pages]),
        dst_pages=tuple(draw(st.permutations(range(pool)))[:pages]),
        pool_pages=pool,
        chunks=tuple(itertools.pairwise([0, *cuts, tokens])),
        group_size=draw(st.integers(1, layers)),
        seed=draw(st.integers(0, 2**63)),
    )


def _pool(memory: Memory, layout: KvLayout, local: int, pages: int) -> PoolDescription:
    nbytes = layout.region_bytes(pages, local)
    table = RegionTable(
        tuple(Region(memory.take(nbytes), nbytes) for _ in range(layout.num_regions))
    )
    return PoolDescription(
        layout=layout,
        local_heads=local,
        kv=table,
        draft_layers=0,
        num_pages=pages,
        aux=(),
        aux_item_bytes=(),
        aux_rows=1,
    )


def _serve(sc: Scenario, relayout: Relayout, data_seed: int) -> tuple[bool, int]:
    """Moves every chunk into every decode rank as the writer and the decoder do; returns
    (every destination pool holds exactly the prompt's KV, writes issued)."""
    lay = sc.layout
    rng = np.random.default_rng(data_seed)
    src_scheme, dst_scheme = ShardingScheme(sc.tp_p), ShardingScheme(sc.tp_d)
    loc_p, loc_d = local_heads(lay, src_scheme), local_heads(lay, dst_scheme)
    tokens = sc.chunks[-1][1]
    size = sc.page_size
    pool_bytes = lay.region_bytes(sc.pool_pages, max(loc_p, loc_d)) * lay.num_regions
    staging = len(sc.src_pages) * size * lay.num_kv_heads * sc.row * lay.num_regions
    memory = Memory((sc.tp_p + sc.tp_d) * pool_bytes + (sc.tp_d + 1) * staging + 64, rng)
    # every prompt token's KV: (regions, tokens, heads, row)
    kv = rng.integers(0, 256, (lay.num_regions, tokens, lay.num_kv_heads, sc.row), np.uint8)
    src_pools = [_pool(memory, lay, loc_p, sc.pool_pages) for _ in range(sc.tp_p)]
    dst_pools = [_pool(memory, lay, loc_d, sc.pool_pages) for _ in range(sc.tp_d)]
    slots = np.array(
        [sc.src_pages[t // size] * size + t % size for t in range(tokens)], dtype=np.int64
    )
    for rank, pool in enumerate(src_pools):
        lo, hi = head_range(lay, src_scheme, rank)
        for r, region in enumerate(pool.kv.regions):
            view = memory.tensor(region.base, region.length).view(-1, loc_p, sc.row)
            view[torch.from_numpy(slots)] = torch.from_numpy(kv[r, :, lo:hi])
    gather_at = memory.take(staging)
    links = link_shards(lay, src_scheme, dst_scheme, sc.seed)
    writes = 0
    for d, pool in enumerate(dst_pools):
        into = links_into(links, d)
        placement = receive_placement(lay, into, len(sc.dst_pages), all_links=relayout.receive_all)
        receive_at = memory.take(placement.total)
        for tokens_range in sc.chunks:
            plan = plan_transfer(
                lay, into, sc.src_pages, sc.dst_pages, TokenRange(*tokens_range), relayout=relayout
            )
            for i, lw in enumerate(plan.links):
                src_pool = src_pools[lw.link.src_rank]
                addressed = AddressedPlan.for_sender(
                    plan, [i], src_pool.kv, pool.kv, sc.group_size, (placement, receive_at)
                )
                for layers in lay.layer_groups(sc.group_size):
                    src, dst, lengths = addressed.columns(layers)
                    if lw.staging.gathers:
                        parts = len(lay.parts)
                        regions = range(layers.start * parts, layers.stop * parts)
                        block = plan.gather_block(i)
                        out = memory.tensor(gather_at, block * len(regions))
                        assert plan.gather_pages is not None
                        PoolCopies(src_pool, "cpu").gather(out, regions, lw.link, plan.gather_pages)
                        src = src + plan.gather_shift(i, layers, gather_at)
                    memory.copy(src, dst, lengths)
                    writes += len(lengths)
        if relayout.receive and placement.total:
            staged = memory.tensor(receive_at, placement.total)
            PoolCopies(pool, "cpu").scatter(staged, placement, into, np.asarray(sc.dst_pages))
    dst_slots = np.array(
        [sc.dst_pages[t // size] * size + t % size for t in range(tokens)], dtype=np.int64
    )
    same = True
    for rank, pool in enumerate(dst_pools):
        lo, hi = head_range(lay, dst_scheme, rank)
        for r, region in enumerate(pool.kv.regions):
            view = memory.data[region.base - memory.base :][: region.length]
            held = view.reshape(-1, loc_d, sc.row)[dst_slots]
            same = same and np.array_equal(held, kv[r, :, lo:hi])
    return same, writes


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(), data_seed=st.integers(0, 2**32 - 1))
def test_gather_write_scatter_reproduces_the_destination_pool(sc: Scenario, data_seed: int) -> None:
    same, staged_writes = _serve(sc, Relayout(gather=True, receive=True), data_seed)
    assert same
    # no more writes than identical TP would make, per source feeding a destination
    identical = Scenario(**{**sc.__dict__, "tp_p": sc.tp_d})
    same_identical, identical_writes = _serve(identical, NO_RELAYOUT, data_seed)
    assert same_identical
    lay = sc.layout
    sources_per_destination = max(
        1, local_heads(lay, ShardingScheme(sc.tp_d)) // local_heads(lay, ShardingScheme(sc.tp_p))
    )
    assert staged_writes <= identical_writes * sources_per_destination


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sc=scenarios(),
    data_seed=st.integers(0, 2**32 - 1),
    gather=st.booleans(),
    gather_all=st.booleans(),
)
def test_a_request_staged_whole_reproduces_the_destination_pool(
    sc: Scenario, data_seed: int, gather: bool, gather_all: bool
) -> None:
    """Every link received (fragmented destination pages), in the request's page order,
    gathered or not (every link, for fragmented source pages): the same bytes land."""
    relayout = Relayout(gather=gather, receive=True, receive_all=True, gather_all=gather_all)
    same, _ = _serve(sc, relayout, data_seed)
    assert same


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(), data_seed=st.integers(0, 2**32 - 1), receive=st.booleans())
def test_every_link_gathered_reproduces_the_destination_pool(
    sc: Scenario, data_seed: int, receive: bool
) -> None:
    """Fragmented source pages gathered on every link, with or without receive staging:
    the same bytes land."""
    same, _ = _serve(sc, Relayout(gather=True, receive=receive, gather_all=True), data_seed)
    assert same


@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 1), (1, 2), (4, 8), (8, 4)])
def test_without_staging_the_same_bytes_arrive_one_slot_at_a_time(tp_p: int, tp_d: int) -> None:
    sc = Scenario(8, 2, 16, 1, tp_p, tp_d, (3, 0, 2), (1, 4, 2), 5, ((0, 20), (20, 40)), 1, 7)
    same, per_slot = _serve(sc, NO_RELAYOUT, 1)
    staged_same, staged = _serve(sc, Relayout(gather=True, receive=True), 1)
    assert same and staged_same
    assert staged < per_slot


@pytest.mark.parametrize("gather", [False, True])
@pytest.mark.parametrize(("tp_p", "tp_d"), [(2, 3), (3, 2)])
def test_links_strided_on_both_sides_land_where_the_decoder_scatters(
    tp_p: int, tp_d: int, gather: bool
) -> None:
    """Six heads at TP2 and TP3: some links carry a slice strided on both sides. With a
    receive grant they write into the receive blocks even when the source cannot gather
    (the decoder scatters every destination-strided link's blocks)."""
    sc = Scenario(6, 2, 16, 2, tp_p, tp_d, (3, 0, 2), (1, 4, 2), 5, ((0, 20), (20, 40)), 1, 9)
    same, staged = _serve(sc, Relayout(gather=gather, receive=True), 2)
    assert same
    same_per_slot, per_slot = _serve(sc, NO_RELAYOUT, 2)
    assert same_per_slot and staged <= per_slot


@pytest.mark.parametrize("heads", [1, 2, 8])
@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 1), (2, 2), (2, 1), (1, 2)])
def test_fragmented_pages_staged_whole_take_a_run_per_chunk(
    heads: int, tp_p: int, tp_d: int
) -> None:
    """A decoder whose pages are scattered (a prefix cache evicting and reusing them),
    fed by a prefill whose pages run in order (as a prefill's mostly do): written as
    they lie, a write per page and region; staged whole (every link received in the
    request's order, strided sources gathered in it), a write per chunk, region and
    link, and the same bytes arrive."""
    rng = np.random.default_rng(3)
    pages = 40
    src, dst = np.arange(10, 10 + pages), rng.permutation(64)[:pages]
    from sgl_pd.core.relayout import fragmented

    assert fragmented(dst.astype(np.int64))
    sc = Scenario(
        heads, 2, 4, 2, tp_p, tp_d, tuple(int(p) for p in src), tuple(int(p) for p in dst), 64,
        ((0, 70), (70, 160)), 1, 5,
    )  # fmt: skip
    same, per_run = _serve(sc, Relayout(gather=True, receive=True), 4)
    whole_same, whole = _serve(sc, Relayout(gather=True, receive=True, receive_all=True), 4)
    assert same and whole_same
    regions = sc.layout.num_regions
    links = len(link_shards(sc.layout, ShardingScheme(tp_p), ShardingScheme(tp_d), sc.seed))
    # a chunk's tokens are one run of block slots, and of the source's pool or gather
    # block: a write per link, region and chunk
    assert whole == len(sc.chunks) * links * regions < per_run, (whole, per_run)


@pytest.mark.parametrize("heads", [1, 2, 8])
@pytest.mark.parametrize(("tp_p", "tp_d"), [(1, 1), (2, 2), (2, 1), (1, 2)])
@pytest.mark.parametrize("dst_fragmented", [False, True])
def test_fragmented_source_pages_gathered_take_a_run_per_chunk(
    heads: int, tp_p: int, tp_d: int, dst_fragmented: bool
) -> None:
    """A prefill whose own prefix cache scattered its pages: written as they lie, a
    write per source run and region whatever the decoder does; gathered on every link
    (into blocks in the destination's order), a write per chunk, region and link when
    the decoder's pages run in order or are staged whole, and the same bytes arrive."""
    rng = np.random.default_rng(8)
    pages = 40
    src = rng.permutation(64)[:pages]
    dst = rng.permutation(64)[:pages] if dst_fragmented else np.arange(5, 5 + pages)
    from sgl_pd.core.relayout import fragmented

    assert fragmented(src.astype(np.int64))
    sc = Scenario(
        heads, 2, 4, 2, tp_p, tp_d, tuple(int(p) for p in src), tuple(int(p) for p in dst), 64,
        ((0, 70), (70, 160)), 1, 5,
    )  # fmt: skip
    plain = Relayout(gather=True, receive=True, receive_all=dst_fragmented)
    same, as_they_lie = _serve(sc, plain, 4)
    gathered_same, gathered = _serve(
        sc, Relayout(gather=True, receive=True, receive_all=dst_fragmented, gather_all=True), 4
    )
    assert same and gathered_same
    regions = sc.layout.num_regions
    links = len(link_shards(sc.layout, ShardingScheme(tp_p), ShardingScheme(tp_d), sc.seed))
    loc_p, loc_d = (local_heads(sc.layout, ShardingScheme(tp)) for tp in (tp_p, tp_d))
    assert gathered == len(sc.chunks) * links * regions <= as_they_lie, (gathered, as_they_lie)
    if loc_d >= loc_p:  # a source slice not strided: written as it lies, a write per run
        assert gathered < as_they_lie


def test_only_short_runs_count_as_fragmented() -> None:
    from sgl_pd.core.relayout import fragmented, page_runs

    assert page_runs(np.array([], dtype=np.int64)) == 0
    assert page_runs(np.array([5, 6, 7, 2, 3, 9], dtype=np.int64)) == 3
    assert not fragmented(np.arange(100, dtype=np.int64))  # a fresh pool: one run
    assert not fragmented(np.concatenate([np.arange(40), np.arange(50, 90)]).astype(np.int64))
    five_runs = np.concatenate([np.arange(i * 100, i * 100 + 30) for i in range(5)])
    assert fragmented(five_runs.astype(np.int64))
    assert fragmented(np.arange(0, 200, 2, dtype=np.int64))  # every other page
