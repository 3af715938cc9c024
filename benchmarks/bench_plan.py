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
from sgl_pd.core.sharding import ShardingScheme, link_shards, local_heads
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
    layout: KvLayout, tp: tuple[int, int], src: np.ndarray, dst: np.ndarray, reps: int
) -> tuple[TransferPlan, float]:
    seed = 1234  # the request's bootstrap room
    times = []
    plan = None
    for _ in range(reps):
        t0 = time.perf_counter()
        # Planning a request includes deriving its links from the two schemes.
        links = link_shards(layout, ShardingScheme(tp[0]), ShardingScheme(tp[1]), seed)
        plan = plan_transfer(layout, links, src, dst, TokenRange(0, PROMPT_TOKENS))
        times.append(time.perf_counter() - t0)
    assert plan is not None
    return plan, statistics.median(times) * 1e3


def _served_ms(
    layout: KvLayout,
    tp: tuple[int, int],
    src_pages: np.ndarray,
    dst_pages: np.ndarray,
    layer_group_size: int,
    reps: int,
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
                plan = plan_transfer(layout, into, src_pages, dst_pages, tokens)
                addressed = AddressedPlan(plan, mine, src_table, dst_table, layer_group_size)
                for layers in groups:
                    writes, _ = layer_writes(addressed, layers)
                    c0 = time.perf_counter()
                    mooncake_columns(writes)
                    converting += time.perf_counter() - c0
            times.append(time.perf_counter() - t0)
            conversions.append(converting)
        if statistics.median(times) * 1e3 > worst:
            worst = statistics.median(times) * 1e3
            worst_conversion = statistics.median(conversions) * 1e3
    return worst, worst_conversion


def measure(reps: int, served_reps: int) -> list[Row]:
    rng = np.random.default_rng(0)
    pages = -(-PROMPT_TOKENS // PAGE_SIZE)
    frag = (rng.permutation(POOL_PAGES)[:pages], rng.permutation(POOL_PAGES)[:pages])
    contig = (np.arange(100, 100 + pages), np.arange(5000, 5000 + pages))
    rows = []
    for page_layout in (PageLayout.NHD, PageLayout.HND):
        for model, layout in _layouts(page_layout).items():
            for tp in TP_PAIRS:
                plan_f, ms_f = _time_plan(layout, tp, *frag, reps)
                plan_c, ms_c = _time_plan(layout, tp, *contig, reps)
                layerwise, converting = _served_ms(layout, tp, *frag, 1, served_reps)
                after_forward, _ = _served_ms(layout, tp, *frag, layout.num_layers, served_reps)
                rows.append(
                    Row(
                        model,
                        tp,
                        page_layout,
                        len(plan_f.links),
                        plan_f.num_writes,
                        plan_c.num_writes,
                        max(ms_f, ms_c),
                        layerwise,
                        after_forward,
                        converting,
                    )
                )
                print(f"  measured {model} TP{tp[0]}->TP{tp[1]} {page_layout.name}", flush=True)
    return rows


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
    rows = measure(reps, served_reps)

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
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "plan.json").write_text(
        json.dumps(
            {
                "rows": [asdict(r) | {"page_layout": r.page_layout.name} for r in rows],
                "headline": headline,
            },
            indent=2,
        )
    )
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
