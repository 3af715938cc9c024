"""Transfer-plan benchmark: writes per page and planning time for an 8k-token prompt.

Shapes: DeepSeek-R1 (MLA, 61 layers, latent 512 + rope 64) and Qwen3-Coder-480B (GQA,
62 layers, 8 KV heads of 128), bf16, page size 64, TP8->TP8, TP8->TP4, TP4->TP8, NHD and HND.

Page lists: "frag" draws 128 distinct ids at random from a 64k-page pool (a busy server's
free list), "contig" uses one ascending run on each side (a fresh pool). Writes count every
(address, length) pair handed to the transfer engine, over all links, layers and K/V parts.
The baseline "identical" for a mismatched pair is identical sharding at the larger of the
two TP sizes: the same head slices travel, so the same number of shard links carry them.

The last line is JSON: plan_and_addr_ms_8k (worst planning + address building per request
as served, NHD under mismatched TP apart: plan_and_addr_ms_8k_nhd_mismatch), the same
without the conversion to Python ints Mooncake's binding requires
(plan_and_addr_ms_8k_without_int_conversion), plan_ms_8k (worst planning time of one
request, ms), hnd_writes_vs_identical / nhd_writes_vs_identical (worst ratio, fragmented
pages, of writes under mismatched TP to writes under identical sharding).

Re-layout rows (NHD, `core.relayout`): the same requests with staging on both sides, as
served: writes, planning + addressing per request layer by layer (the gather blocks'
addresses included), and the copies themselves with torch on this CPU - the busiest
prefill rank's gathers and the busiest decode rank's scatter of one request, over pools
of the real shapes. JSON: relayout_writes_vs_identical (worst ratio to identical
sharding at the larger TP; also per pair, _8to4 and _4to8), relayout_served_ms_8k_mismatch
(worst served ms), relayout_copy_ms_8k (worst gather + scatter ms of one request on CPU).

Usage: python benchmarks/bench_plan.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from sgl_pd.backend.prefill.writer import layer_writes
from sgl_pd.core.counting import links_into
from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.plan import AddressedPlan, TokenRange, TransferPlan, plan_transfer
from sgl_pd.core.regions import RegionTable
from sgl_pd.core.relayout import NO_RELAYOUT, Relayout, receive_placement
from sgl_pd.core.sharding import ShardingScheme, link_shards, local_heads
from sgl_pd.transfer.engine import Writes
from sgl_pd.transfer.mooncake import engine_columns as mooncake_columns

PROMPT_TOKENS = 8192
PAGE_SIZE = 64
POOL_PAGES = 65_536
TP_PAIRS = ((8, 8), (8, 4), (4, 8))


def _layouts(page_layout: PageLayout) -> dict[str, KvLayout]:
    return {
        "DeepSeek-R1": KvLayout.mla(
            num_layers=61,
            kv_lora_rank=512,
            rope_dim=64,
            page_size=PAGE_SIZE,
            elem_bytes=2,
            page_layout=page_layout,
        ),
        "Qwen3-Coder-480B": KvLayout.gqa(
            num_layers=62,
            num_kv_heads=8,
            head_dim=128,
            page_size=PAGE_SIZE,
            elem_bytes=2,
            page_layout=page_layout,
        ),
    }


@dataclass(frozen=True)
class Row:
    model: str
    tp: tuple[int, int]
    page_layout: PageLayout
    links: int
    writes_frag: int
    writes_contig: int
    plan_ms: float  # median over repeats, worst of the two page lists
    served_layerwise_ms: float  # plan + addresses per request as served, layer by layer
    served_after_forward_ms: float  # the same with one group of every layer
    int_conversion_ms: float  # of served_layerwise_ms: numpy columns to Python int lists

    @property
    def pages(self) -> int:
        return -(-PROMPT_TOKENS // PAGE_SIZE)


def _time_plan(
    layout: KvLayout,
    tp: tuple[int, int],
    src: np.ndarray,
    dst: np.ndarray,
    reps: int,
    relayout: Relayout = NO_RELAYOUT,
) -> tuple[int, float]:
    """(writes of the request over every decode rank, median planning ms)."""
    seed = 1234  # the request's bootstrap room
    times = []
    plans: list[TransferPlan] = []
    for _ in range(reps):
        t0 = time.perf_counter()
        # Planning a request includes deriving its links from the two schemes.
        links = link_shards(layout, ShardingScheme(tp[0]), ShardingScheme(tp[1]), seed)
        plans = [
            plan_transfer(
                layout, links_into(links, d), src, dst, TokenRange(0, PROMPT_TOKENS),
                relayout=relayout,
            )
            for d in range(tp[1])
        ]  # fmt: skip
        times.append(time.perf_counter() - t0)
    assert plans
    return sum(p.num_writes for p in plans), statistics.median(times) * 1e3


def _served_ms(
    layout: KvLayout,
    tp: tuple[int, int],
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    layer_group_size: int,
    reps: int,
    relayout: Relayout = NO_RELAYOUT,
) -> tuple[float, float]:
    """Planning plus address building for one request as a prefill rank serves it (the
    worst rank, median over `reps`), and the part of it spent converting the columns to
    the Python int lists Mooncake's binding takes, through the writer's own functions: the request's
    links; per decode rank it writes to, the chunk planned once over every layer and
    addressed once (`AddressedPlan`); then per layer group (one layer when streaming layer
    by layer) that group's writes, and the columns handed to Mooncake (Python lists)."""
    src_heads = local_heads(layout, ShardingScheme(tp[0]))
    dst_heads = local_heads(layout, ShardingScheme(tp[1]))
    tokens = TokenRange(0, PROMPT_TOKENS)
    groups = layout.layer_groups(layer_group_size)
    worst, worst_conversion = 0.0, 0.0
    for rank in range(tp[0]):
        src_table = RegionTable.packed(layout, POOL_PAGES, src_heads, rank << 40)
        dst_tables = [
            RegionTable.packed(layout, POOL_PAGES, dst_heads, (64 + r) << 40) for r in range(tp[1])
        ]
        times, conversions = [], []
        for _ in range(reps):
            converting = 0.0
            t0 = time.perf_counter()
            links = link_shards(layout, ShardingScheme(tp[0]), ShardingScheme(tp[1]), 1234)
            for dst_rank, dst_table in enumerate(dst_tables):
                into = links_into(links, dst_rank)
                mine = [i for i, link in enumerate(into) if link.src_rank == rank]
                if not mine:
                    continue
                plan = plan_transfer(layout, into, src_pages, dst_pages, tokens, relayout=relayout)
                receive = (receive_placement(layout, into, len(dst_pages)), 1 << 50)
                addressed = AddressedPlan.for_sender(
                    plan, mine, src_table, dst_table, layer_group_size, receive
                )
                gathering = [i for i in mine if plan.links[i].staging.gathers]
                for layers in groups:
                    writes, _ = layer_writes(addressed, layers)
                    if gathering:  # the blocks' addresses, as the writer shifts them
                        shift = plan.gather_shift(gathering[0], layers, 1 << 48)
                        writes = Writes.trusted(writes.src + shift, writes.dst, writes.nbytes)
                    c0 = time.perf_counter()
                    mooncake_columns(writes)
                    converting += time.perf_counter() - c0
            times.append(time.perf_counter() - t0)
            conversions.append(converting)
        if statistics.median(times) * 1e3 > worst:
            worst = statistics.median(times) * 1e3
            worst_conversion = statistics.median(conversions) * 1e3
    return worst, worst_conversion


@dataclass(frozen=True)
class RelayoutRow:
    model: str
    tp: tuple[int, int]
    writes_frag: int
    served_layerwise_ms: float
    gather_ms: float  # the busiest prefill rank's gathers of one request (CPU, torch)
    scatter_ms: float  # the busiest decode rank's scatter of one request (CPU, torch)


def _copy_ms(
    layout: KvLayout, tp: tuple[int, int], src: np.ndarray, dst: np.ndarray
) -> tuple[float, float]:
    """(gather ms of prefill rank 0, scatter ms of decode rank 0) for one request, with
    the edge's own copies over pools of the model's shape holding just the request."""
    import torch

    from sgl_pd.backend.pool import PoolDescription
    from sgl_pd.backend.relayout_copies import PoolCopies

    relayout = Relayout(gather=True, receive=True)
    links = link_shards(layout, ShardingScheme(tp[0]), ShardingScheme(tp[1]), 1234)
    pages = len(src)
    # the request's pages renumbered into a pool of just them (the copies' cost does not
    # depend on where the pages are, only on how many)
    src_local = np.argsort(np.argsort(src))
    dst_local = np.argsort(np.argsort(dst))

    def pool(heads: int) -> tuple[PoolDescription, torch.Tensor]:
        nbytes = layout.region_bytes(pages, heads)
        arena = torch.zeros(nbytes * layout.num_regions, dtype=torch.uint8)
        base = int(arena.data_ptr())
        table = RegionTable.packed(layout, pages, heads, base)
        return PoolDescription(layout, heads, table, 0, pages, (), (), 1), arena

    gather_s = scatter_s = 0.0
    src_pool, _keep_src = pool(local_heads(layout, ShardingScheme(tp[0])))
    copies = PoolCopies(src_pool, "cpu")
    for d in range(tp[1]):
        into = links_into(links, d)
        plan = plan_transfer(
            layout, into, src_local, dst_local, TokenRange(0, PROMPT_TOKENS), relayout=relayout
        )
        for i, lw in enumerate(plan.links):
            if lw.link.src_rank == 0 and lw.staging.gathers:
                block = plan.gather_block(i)
                out = torch.empty(block * layout.num_regions, dtype=torch.uint8)
                t0 = time.perf_counter()
                assert plan.gather_pages is not None
                copies.gather(out, range(layout.num_regions), lw.link, plan.gather_pages)
                gather_s += time.perf_counter() - t0
    dst_pool, _keep_dst = pool(local_heads(layout, ShardingScheme(tp[1])))
    into = links_into(links, 0)
    placement = receive_placement(layout, into, pages)
    if placement.total:
        staged = torch.empty(placement.total, dtype=torch.uint8)
        t0 = time.perf_counter()
        PoolCopies(dst_pool, "cpu").scatter(staged, placement, into, dst_local)
        scatter_s = time.perf_counter() - t0
    return gather_s * 1e3, scatter_s * 1e3


def measure(reps: int, served_reps: int) -> tuple[list[Row], list[RelayoutRow]]:
    rng = np.random.default_rng(0)
    pages = -(-PROMPT_TOKENS // PAGE_SIZE)
    frag = (rng.permutation(POOL_PAGES)[:pages], rng.permutation(POOL_PAGES)[:pages])
    contig = (np.arange(100, 100 + pages), np.arange(5000, 5000 + pages))
    rows, relayout_rows = [], []
    staged = Relayout(gather=True, receive=True)
    for page_layout in (PageLayout.NHD, PageLayout.HND):
        for model, layout in _layouts(page_layout).items():
            for tp in TP_PAIRS:
                writes_f, ms_f = _time_plan(layout, tp, *frag, reps)
                writes_c, ms_c = _time_plan(layout, tp, *contig, reps)
                layerwise, converting = _served_ms(layout, tp, *frag, 1, served_reps)
                after_forward, _ = _served_ms(layout, tp, *frag, layout.num_layers, served_reps)
                links = link_shards(layout, ShardingScheme(tp[0]), ShardingScheme(tp[1]), 1234)
                rows.append(
                    Row(
                        model,
                        tp,
                        page_layout,
                        len(links),
                        writes_f,
                        writes_c,
                        max(ms_f, ms_c),
                        layerwise,
                        after_forward,
                        converting,
                    )
                )
                if page_layout is PageLayout.NHD:
                    relayout_rows.append(
                        RelayoutRow(
                            model,
                            tp,
                            _time_plan(layout, tp, *frag, 1, staged)[0],
                            _served_ms(layout, tp, *frag, 1, served_reps, staged)[0],
                            *_copy_ms(layout, tp, *frag),
                        )
                    )
                print(f"  measured {model} TP{tp[0]}->TP{tp[1]} {page_layout.name}", flush=True)
    return rows, relayout_rows


def _ratios(rows: list[Row], page_layout: PageLayout) -> list[float]:
    by_key = {(r.model, r.tp, r.page_layout): r for r in rows}
    out = []
    for r in rows:
        if r.page_layout is page_layout and r.tp[0] != r.tp[1]:
            big = max(r.tp)
            out.append(r.writes_frag / by_key[(r.model, (big, big), page_layout)].writes_frag)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="few repeats")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"), help="JSON here")
    args = parser.parse_args()
    reps, served_reps = (5, 2) if args.quick else (200, 15)
    rows, relayout_rows = measure(reps, served_reps)

    head = (
        f"{'model':<17} {'TP':>5} {'layout':>6} {'links':>5} {'writes/page':>11} "
        f"{'(contig)':>9} {'plan ms':>8} {'served ms':>10} {'(ints)':>7} {'(one group)':>11}"
    )
    print(f"{PROMPT_TOKENS}-token prompt, page size {PAGE_SIZE}, {rows[0].pages} pages, bf16")
    print("served ms: planning + address building per request on the busiest prefill rank,")
    print("layer by layer as layer-wise streaming sends (one group: after-forward mode);")
    print("(ints): the part spent turning columns into the Python int lists Mooncake takes")
    print(head)
    print("-" * len(head))
    for r in rows:
        tp = f"{r.tp[0]}->{r.tp[1]}"
        print(
            f"{r.model:<17} {tp:>5} {r.page_layout.name:>6} {r.links:>5} "
            f"{r.writes_frag / r.pages:>11.0f} {r.writes_contig / r.pages:>9.1f} "
            f"{r.plan_ms:>8.3f} {r.served_layerwise_ms:>10.3f} {r.int_conversion_ms:>7.3f} "
            f"{r.served_after_forward_ms:>11.3f}"
        )
    print()
    print("Re-layout (NHD, staging on both sides), as served; copies with torch on this CPU")
    head2 = (
        f"{'model':<17} {'TP':>5} {'writes/page':>11} {'vs identical':>12} {'served ms':>10} "
        f"{'gather ms':>10} {'scatter ms':>11}"
    )
    print(head2)
    print("-" * len(head2))
    by_key = {(r.model, r.tp, r.page_layout): r for r in rows}
    relayout_ratio: dict[tuple[int, int], float] = {}
    for rr in relayout_rows:
        big = max(rr.tp)
        ratio = rr.writes_frag / by_key[(rr.model, (big, big), PageLayout.NHD)].writes_frag
        relayout_ratio[rr.tp] = max(relayout_ratio.get(rr.tp, 0.0), ratio)
        print(
            f"{rr.model:<17} {f'{rr.tp[0]}->{rr.tp[1]}':>5} "
            f"{rr.writes_frag / rows[0].pages:>11.0f} {ratio:>12.2f} "
            f"{rr.served_layerwise_ms:>10.3f} {rr.gather_ms:>10.1f} {rr.scatter_ms:>11.1f}"
        )
    mismatched = [rr for rr in relayout_rows if rr.tp[0] != rr.tp[1]]
    # NHD under mismatched TP writes every token slot separately (see core/plan.py):
    # its cost is the count of writes, which only HND pages remove (D15)
    per_slot = [r for r in rows if r.page_layout is PageLayout.NHD and r.tp[0] != r.tp[1]]
    others = [r for r in rows if r not in per_slot]
    headline = {
        "plan_and_addr_ms_8k": round(max(r.served_layerwise_ms for r in others), 4),
        "plan_and_addr_ms_8k_without_int_conversion": round(
            max(r.served_layerwise_ms - r.int_conversion_ms for r in others), 4
        ),
        "plan_and_addr_ms_8k_nhd_mismatch": round(max(r.served_layerwise_ms for r in per_slot), 3),
        "plan_ms_8k": round(max(r.plan_ms for r in rows), 4),
        "hnd_writes_vs_identical": round(max(_ratios(rows, PageLayout.HND)), 3),
        "nhd_writes_vs_identical": round(max(_ratios(rows, PageLayout.NHD)), 3),
        "relayout_writes_vs_identical": round(
            max(v for tp, v in relayout_ratio.items() if tp[0] != tp[1]), 3
        ),
        "relayout_writes_vs_identical_8to4": round(relayout_ratio[(8, 4)], 3),
        "relayout_writes_vs_identical_4to8": round(relayout_ratio[(4, 8)], 3),
        "relayout_served_ms_8k_mismatch": round(max(r.served_layerwise_ms for r in mismatched), 3),
        "relayout_copy_ms_8k": round(max(r.gather_ms + r.scatter_ms for r in mismatched), 1),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan.json").write_text(
        json.dumps(
            {
                "rows": [asdict(r) | {"page_layout": r.page_layout.name} for r in rows],
                "relayout_rows": [asdict(r) for r in relayout_rows],
                "headline": headline,
            },
            indent=2,
        )
    )
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
