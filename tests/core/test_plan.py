"""Executing a plan on real bytes reproduces exactly what each decoder shard must hold."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_pd.core.counting import CompletionCounter, WriteGroup, expected_groups
from sgl_pd.core.errors import PlanError
from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.plan import AddressedPlan, TokenRange, plan_transfer
from sgl_pd.core.regions import Region, RegionTable
from sgl_pd.core.sharding import ShardingScheme, link_shards

from .kv_reference import Arena, min_writes, pool_view, put_token, ref_heads, row_address

TPS = (1, 2, 4, 8)


@dataclass(frozen=True)
class Scenario:
    layout: KvLayout
    tp_p: int
    tp_d: int
    src_pool_pages: int
    dst_pool_pages: int
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    chunks: tuple[tuple[int, int], ...]  # token ranges, consecutive
    group_size: int
    seed: int
    # the destination holds the first `held_pages` pages (its prefix cache): its list
    # starts after them; the source list starts at logical page `src_first_page`
    held_pages: int = 0
    src_first_page: int = 0


def _page_list(draw: st.DrawFn, needed: int, pool: int) -> tuple[int, ...]:
    mode = draw(st.sampled_from(["random", "ascending", "descending"]))
    if mode == "random":
        return tuple(draw(st.permutations(range(pool)))[:needed])
    start = draw(st.integers(0, pool - needed))
    run = list(range(start, start + needed))
    return tuple(run if mode == "ascending" else run[::-1])


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    page_layout = draw(st.sampled_from(PageLayout))
    page_size = draw(st.sampled_from([1, 2, 3, 4, 8]))
    elem = draw(st.sampled_from([1, 2]))
    layers = draw(st.integers(1, 3))
    if draw(st.booleans()):
        lora, rope = draw(st.integers(1, 3)), draw(st.integers(0, 2))
        layout = KvLayout.mla(
            num_layers=layers,
            kv_lora_rank=lora,
            rope_dim=rope,
            page_size=page_size,
            elem_bytes=elem,
            page_layout=page_layout,
        )
    else:
        layout = KvLayout.gqa(
            num_layers=layers,
            num_kv_heads=draw(st.sampled_from([1, 2, 4, 8])),
            head_dim=draw(st.integers(1, 3)),
            page_size=page_size,
            elem_bytes=elem,
            page_layout=page_layout,
        )
    num_tokens = draw(st.integers(1, 40))
    needed = -(-num_tokens // page_size)
    src_pool = needed + draw(st.integers(0, 5))
    dst_pool = needed + draw(st.integers(0, 5))
    start = draw(st.integers(0, num_tokens - 1))  # tokens before it: decoder prefix hit
    cuts: list[int] = []
    if start + 1 < num_tokens:
        cuts = sorted(draw(st.sets(st.integers(start + 1, num_tokens - 1), max_size=4)))
    bounds = [start, *cuts, num_tokens]
    return Scenario(
        layout,
        draw(st.sampled_from(TPS)),
        draw(st.sampled_from(TPS)),
        src_pool,
        dst_pool,
        _page_list(draw, needed, src_pool),
        _page_list(draw, needed, dst_pool),
        tuple(itertools.pairwise(bounds)),
        draw(st.integers(1, layers)),
        draw(st.integers(0, 2**63)),
        held_pages=draw(st.sampled_from([0, start // page_size])),
        src_first_page=draw(st.sampled_from([0, start // page_size])),
    )


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(sc=scenarios(), data_seed=st.integers(0, 2**32 - 1))
def test_plan_reproduces_destination_bytes(sc: Scenario, data_seed: int) -> None:
    lay = sc.layout
    mla = lay.kind.value == "mla"
    hnd = lay.page_layout is PageLayout.HND
    heads, size, row = lay.num_kv_heads, lay.page_size, lay.head_dim * lay.elem_bytes
    num_tokens = sc.chunks[-1][1]
    rng = np.random.default_rng(data_seed)
    regions = [(layer, part) for layer in range(lay.num_layers) for part in range(len(lay.parts))]
    kv = {r: rng.integers(0, 256, (num_tokens, heads, row), dtype=np.uint8) for r in regions}

    def local(tp: int) -> int:
        return max(1, heads // tp)

    loc_p, loc_d = local(sc.tp_p), local(sc.tp_d)
    src_bytes = sc.src_pool_pages * loc_p * size * row
    dst_bytes = sc.dst_pool_pages * loc_d * size * row
    total = len(regions) * (sc.tp_p * src_bytes + sc.tp_d * dst_bytes)
    arena = Arena(rng.integers(0, 256, total, dtype=np.uint8))

    def tables(tp: int, nbytes: int) -> dict[int, RegionTable]:
        return {
            rank: RegionTable.for_layout(
                lay, tuple(Region(arena.take(nbytes), nbytes) for _ in regions)
            )
            for rank in range(tp)
        }

    src_tables, dst_tables = tables(sc.tp_p, src_bytes), tables(sc.tp_d, dst_bytes)

    # Source pools hold every prompt token; destination pools start as garbage.
    for rank, table in src_tables.items():
        lo, hi = ref_heads(mla, heads, sc.tp_p, rank)
        for i, r in enumerate(regions):
            pool = pool_view(arena, table.regions[i].base, hnd, sc.src_pool_pages, loc_p, size, row)
            for t in range(num_tokens):
                put_token(pool, hnd, sc.src_pages[t // size], t % size, kv[r][t, lo:hi])
    before = arena.data.copy()
    expected = arena.data.copy()
    first = sc.chunks[0][0]
    for rank, table in dst_tables.items():
        lo, hi = ref_heads(mla, heads, sc.tp_d, rank)
        for i, r in enumerate(regions):
            base = table.regions[i].base
            pool = pool_view(Arena(expected), base, hnd, sc.dst_pool_pages, loc_d, size, row)
            for t in range(first, num_tokens):
                put_token(pool, hnd, sc.dst_pages[t // size], t % size, kv[r][t, lo:hi])

    # Execute every plan, chunk by chunk and layer group by layer group.
    links = link_shards(lay, ShardingScheme(sc.tp_p), ShardingScheme(sc.tp_d), sc.seed)
    written = issued_writes = 0
    issued_groups: list[WriteGroup] = []
    for c, (t0, t1) in enumerate(sc.chunks):
        for layers in lay.layer_groups(sc.group_size):
            plan = plan_transfer(
                lay,
                links,
                sc.src_pages[sc.src_first_page :],
                sc.dst_pages[sc.held_pages :],
                TokenRange(t0, t1),
                layers,
                src_first_page=sc.src_first_page,
                held_pages=sc.held_pages,
            )
            issued_writes += plan.num_writes
            issued_groups.extend(plan.groups(c, sc.group_size))
            for batch in plan.batches(layers, src_tables, dst_tables):
                for s, d, n in zip(
                    batch.src_addrs.tolist(),
                    batch.dst_addrs.tolist(),
                    batch.lengths.tolist(),
                    strict=True,
                ):
                    arena.data[d : d + n] = before[s : s + n]
                    written += n

    # (with a held prefix: its pages, which hold only tokens before the first chunk, are
    # left exactly as they were)
    assert np.array_equal(arena.data, expected)
    # No byte written twice: exactly the needed bytes moved.
    assert written == (num_tokens - first) * len(regions) * sc.tp_d * loc_d * row

    # Fewest writes: the reference count of contiguous runs, chunk by chunk.
    def base_of(table: RegionTable) -> int:
        return table.regions[0].base

    want = 0
    for t0, t1 in sc.chunks:
        for link in links:
            s_lo = ref_heads(mla, heads, sc.tp_p, link.src_rank)[0]
            d_lo = ref_heads(mla, heads, sc.tp_d, link.dst_rank)[0]
            src_rows, dst_rows = [], []
            for t in range(t0, t1):
                for h in range(link.head_lo, link.head_hi):
                    src_rows.append(
                        row_address(
                            base_of(src_tables[link.src_rank]),
                            hnd,
                            sc.src_pool_pages,
                            loc_p,
                            size,
                            row,
                            sc.src_pages[t // size],
                            t % size,
                            h - s_lo,
                        )
                    )
                    dst_rows.append(
                        row_address(
                            base_of(dst_tables[link.dst_rank]),
                            hnd,
                            sc.dst_pool_pages,
                            loc_d,
                            size,
                            row,
                            sc.dst_pages[t // size],
                            t % size,
                            h - d_lo,
                        )
                    )
            want += min_writes(src_rows, dst_rows, row) * len(regions)
    assert issued_writes == want

    # D10: the decoder's expectation equals the groups the prefiller's plans issue.
    exp = expected_groups(
        lay, ShardingScheme(sc.tp_p), ShardingScheme(sc.tp_d), sc.seed, sc.group_size
    )
    assert len(issued_groups) == exp.total(len(sc.chunks))
    # Each source counts the groups it issued, one by one; the decoder reads the sources'
    # growing counts in any interleaving.
    counter = CompletionCounter(exp, expect_metadata=False)
    issued = [g.src_rank for g in issued_groups]
    turns = [issued[i] for i in rng.permutation(len(issued))]  # who writes its next count
    seal_at = int(rng.integers(0, len(turns)))  # the last chunk notice arrives at any time
    done = dict.fromkeys(issued, 0)
    for k, src in enumerate(turns):
        done[src] += 1
        counter.observe(src, done[src])
        if k == seal_at:
            counter.seal(len(sc.chunks))
        assert counter.is_complete == (k == len(turns) - 1)


def _qwen(page_layout: PageLayout) -> KvLayout:
    return KvLayout.gqa(
        num_layers=2,
        num_kv_heads=8,
        head_dim=128,
        page_size=16,
        elem_bytes=2,
        page_layout=page_layout,
    )


@pytest.mark.parametrize(("tp_p", "tp_d"), [(8, 4), (4, 8), (2, 8)])
def test_hnd_one_write_per_page_nhd_one_per_token(tp_p: int, tp_d: int) -> None:
    pages = [9, 3, 7, 1]  # fragmented: nothing merges across pages
    per_page = {}
    for page_layout in PageLayout:
        lay = _qwen(page_layout)
        links = link_shards(lay, ShardingScheme(tp_p), ShardingScheme(tp_d), 0)
        plan = plan_transfer(lay, links, pages, pages, TokenRange(0, 64))
        per_page[page_layout] = plan.num_writes / (4 * 2 * 2 * len(links))  # pages, layers, K/V
    assert per_page[PageLayout.HND] == 1
    assert per_page[PageLayout.NHD] == 16  # page_size


def test_identical_sharding_merges_consecutive_pages() -> None:
    lay = _qwen(PageLayout.NHD)
    links = link_shards(lay, ShardingScheme(8), ShardingScheme(8), 0)
    assert [(lk.src_rank, lk.dst_rank) for lk in links] == [(i, i) for i in range(8)]
    plan = plan_transfer(lay, links, range(10, 14), range(20, 24), TokenRange(0, 64))
    assert plan.num_writes == 8 * 2 * 2  # one write per link and region


def test_plan_writes_match_batches() -> None:
    lay = _qwen(PageLayout.HND)
    links = link_shards(lay, ShardingScheme(2), ShardingScheme(4), 0)
    plan = plan_transfer(lay, links, [5, 2], [0, 1], TokenRange(3, 20))
    writes = list(plan.writes())
    assert len(writes) == plan.num_writes
    tables = {r: RegionTable.packed(lay, 6, lay.num_kv_heads // 2, base=r << 32) for r in range(2)}
    dst = {r: RegionTable.packed(lay, 6, lay.num_kv_heads // 4, base=1 << 40) for r in range(4)}
    batches = plan.batches(lay.layer_groups(2)[0], tables, dst)
    assert sum(b.lengths.shape[0] for b in batches) == plan.num_writes
    assert sum(w.nbytes for w in writes) == sum(int(b.lengths.sum()) for b in batches)


@pytest.mark.parametrize(
    ("src", "dst", "tokens", "layers", "match"),
    [
        ([0], [0, 1], (0, 20), None, "covers 1 pages"),
        ([0, 0], [0, 1], (0, 20), None, "repeat"),
        ([0, -1], [0, 1], (0, 20), None, ">= 0"),
        ([0, 1], [0, 1], (0, 20), range(0, 3), "layers"),
        ([0, 1], [0, 1], (0, 20), range(1, 1), "layers"),
        ([0, 1.5], [0, 1], (0, 20), None, "integers"),
        ([[0, 1]], [0, 1], (0, 20), None, "covers"),
    ],
)
def test_plan_rejects_bad_input(
    src: list[object], dst: list[int], tokens: tuple[int, int], layers: range | None, match: str
) -> None:
    lay = _qwen(PageLayout.HND)
    links = link_shards(lay, ShardingScheme(1), ShardingScheme(1), 0)
    with pytest.raises(PlanError, match=match):
        plan_transfer(lay, links, src, dst, TokenRange(*tokens), layers)  # type: ignore[arg-type]


def test_token_range_and_region_bounds() -> None:
    with pytest.raises(PlanError):
        TokenRange(5, 5)
    lay = _qwen(PageLayout.HND)
    links = link_shards(lay, ShardingScheme(1), ShardingScheme(1), 0)
    plan = plan_transfer(lay, links, [0, 7], [0, 1], TokenRange(0, 32))
    small = RegionTable.packed(lay, 4, 8)  # page 7 lies past a 4-page pool
    with pytest.raises(PlanError, match="past its region"):
        plan.batch(0, range(2), small, RegionTable.packed(lay, 4, 8))
    with pytest.raises(PlanError, match="whole groups"):
        plan_transfer(lay, links, [0, 7], [0, 1], TokenRange(0, 32), range(1, 2)).groups(0, 2)


def test_batch_layers_must_lie_in_the_plan() -> None:
    lay = _qwen(PageLayout.HND)
    links = link_shards(lay, ShardingScheme(1), ShardingScheme(1), 0)
    plan = plan_transfer(lay, links, [0, 1], [0, 1], TokenRange(0, 32), range(1, 2))
    table = RegionTable.packed(lay, 4, 8)
    assert plan.batch(0, range(1, 2), table, table).lengths.shape == (2,)  # K and V
    for bad in (range(0, 2), range(1, 1), range(1, 3)):
        with pytest.raises(PlanError, match="sub-range"):
            plan.batch(0, bad, table, table)
    with pytest.raises(PlanError, match="fewer regions"):
        plan.batch(0, range(1, 2), RegionTable(table.regions[:2]), table)


@pytest.mark.parametrize(
    ("tp_p", "tp_d", "layout"),
    [(2, 4, PageLayout.HND), (4, 2, PageLayout.NHD), (2, 2, PageLayout.NHD)],
)
def test_an_addressed_plan_gives_each_layer_groups_batches(
    tp_p: int, tp_d: int, layout: PageLayout
) -> None:
    """Addressing a sender's links once for every layer, then slicing a layer group,
    gives the batches addressing that group alone gives, and counts its groups."""
    lay = _qwen(layout)
    links = link_shards(lay, ShardingScheme(tp_p), ShardingScheme(tp_d), 3)
    plan = plan_transfer(lay, links, [5, 2, 7], [0, 1, 4], TokenRange(3, 40))
    src = RegionTable.packed(lay, 8, lay.num_kv_heads // tp_p, base=1 << 32)
    dst = RegionTable.packed(lay, 8, lay.num_kv_heads // tp_d, base=1 << 40)
    group_size = 2
    for rank in range(tp_p):
        mine = [i for i, link in enumerate(links) if link.src_rank == rank]
        addressed = AddressedPlan(plan, mine, src, dst, group_size)
        assert addressed.sending == tuple(i for i in mine if plan.links[i].count)
        for layers in lay.layer_groups(group_size):
            for i in addressed.sending:
                want, got = plan.batch(i, layers, src, dst), addressed.batch(i, layers)
                for column in ("src_addrs", "dst_addrs", "lengths"):
                    assert np.array_equal(getattr(want, column), getattr(got, column))
            sent = sorted({g.link_index for g in plan.groups(0, group_size) if g.layers == layers})
            assert addressed.group_count(layers) == len(set(sent) & set(mine))
        assert addressed.group_count(plan.layers) == len(addressed.sending) * len(
            lay.layer_groups(group_size)
        )


def test_an_addressed_plan_takes_only_whole_layer_groups() -> None:
    lay = _qwen(PageLayout.HND)  # 2 layers: one group of 2
    links = link_shards(lay, ShardingScheme(1), ShardingScheme(1), 0)
    plan = plan_transfer(lay, links, [0, 1], [0, 1], TokenRange(0, 32))
    table = RegionTable.packed(lay, 4, 8)
    addressed = AddressedPlan(plan, [0], table, table, 2)
    assert addressed.group_count(range(0, 2)) == 1
    for bad in (range(0, 1), range(1, 2), range(0, 3)):
        with pytest.raises(PlanError, match="whole layer groups"):
            addressed.group_count(bad)


def test_an_addressed_plans_columns_join_its_links_batches() -> None:
    lay = _qwen(PageLayout.HND)
    links = link_shards(lay, ShardingScheme(2), ShardingScheme(1), 0)  # two links in
    plan = plan_transfer(lay, links, [3, 1], [0, 5], TokenRange(0, 32))
    src = RegionTable.packed(lay, 8, lay.num_kv_heads // 2, base=1 << 32)
    dst = RegionTable.packed(lay, 8, lay.num_kv_heads, base=1 << 40)
    both = AddressedPlan(plan, [0, 1], src, dst, 1)
    one = AddressedPlan(plan, [1], src, dst, 1)
    for layers in (range(0, 1), range(1, 2), range(0, 2)):
        batches = [both.batch(i, layers) for i in both.sending]
        columns = ("src_addrs", "dst_addrs", "lengths")
        for column, got in zip(columns, both.columns(layers), strict=True):
            assert np.array_equal(got, np.concatenate([getattr(b, column) for b in batches]))
        only = one.batch(1, layers)
        assert all(
            np.array_equal(got, getattr(only, column))
            for column, got in zip(columns, one.columns(layers), strict=True)
        )


@pytest.mark.parametrize("page_layout", list(PageLayout))
def test_a_chunk_cannot_start_inside_the_held_prefix(page_layout: PageLayout) -> None:
    """The held pages are not in the destination's list, and a chunk that would reach
    back into them is refused: no plan can write a page the decoder's cache holds."""
    lay = KvLayout.gqa(
        num_layers=2, num_kv_heads=2, head_dim=4, page_size=4, elem_bytes=2,
        page_layout=page_layout,
    )  # fmt: skip
    links = link_shards(lay, ShardingScheme(1), ShardingScheme(1), 0)
    src, dst = list(range(10)), [20, 21]  # decoder holds pages 0-2 (12 tokens)
    plan = plan_transfer(lay, links, src, dst, TokenRange(12, 20), held_pages=3)
    assert plan.num_writes > 0
    with pytest.raises(PlanError, match="held"):
        plan_transfer(lay, links, src, dst, TokenRange(11, 20), held_pages=3)
    with pytest.raises(PlanError, match="source page list"):
        plan_transfer(lay, links, src[3:], dst, TokenRange(8, 20), src_first_page=3)
