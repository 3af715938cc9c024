"""What --pd-kv-checksum costs per request: the keyed sums of one 8k-token request's KV, as
the prefill side computes them while it writes (per chunk, on every layer) and the decode
side once before hand-off, with the code a served request runs (`backend.kv_sums` over a
pool's pages, on this machine's device: the CPU here, CUDA where there is one).

Side by side in the same run, the same bytes copied once (`torch` copy of the pages' rows:
what a transfer has to read at least), so the ratio is read on one noisy machine.

    .venv/bin/python benchmarks/bench_checksum.py --quick   # about a minute
    .venv/bin/python benchmarks/bench_checksum.py           # three layouts, 3 repetitions

Ends with one JSON line: per layout, seconds per 8k request on each side and the ratio to
one copy of its bytes; the headline is the bundled tiny model's and an 8B-class model's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import dataclass

import numpy as np
import torch

from sgl_pd.backend.kv_sums import KvSums, token_slots
from sgl_pd.backend.pool import PoolDescription
from sgl_pd.core.kv_checksum import checksum_key
from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.regions import Region, RegionTable
from sgl_pd.core.sharding import ShardLink

TOKENS = 8192
CHUNK = 2048  # tokens per prefill chunk (each is summed as it is written)


@dataclass(frozen=True)
class Model:
    name: str
    layers: int
    kv_heads: int
    head_dim: int


MODELS = (
    Model("tiny (bundled, 4 layers)", 4, 2, 64),
    Model("8B-class (32 layers, 8 KV heads)", 32, 8, 128),
    Model("70B-class, one TP8 rank (80 layers, 1 KV head)", 80, 1, 128),
)


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _pool(model: Model, pages: int, device: str) -> tuple[PoolDescription, list[torch.Tensor]]:
    layout = KvLayout.gqa(
        num_layers=model.layers, num_kv_heads=model.kv_heads, head_dim=model.head_dim,
        page_size=1, elem_bytes=2, page_layout=PageLayout.NHD,
    )  # fmt: skip
    row = layout.page_bytes(model.kv_heads)
    buffers = [
        torch.randint(0, 255, (pages * row,), dtype=torch.uint8, device=device)
        for _ in range(layout.num_regions)
    ]
    regions = tuple(Region(int(b.data_ptr()), b.numel()) for b in buffers)
    pool = PoolDescription(
        layout=layout, local_heads=model.kv_heads, kv=RegionTable.for_layout(layout, regions),
        draft_layers=0, num_pages=pages, aux=(), aux_item_bytes=(), aux_rows=1,
    )  # fmt: skip
    return pool, buffers


def measure(model: Model, reps: int, device: str) -> dict[str, float | str]:
    pool, buffers = _pool(model, TOKENS + 64, device)
    sums = KvSums(pool, device, checksum_key(b"benchmark secret, 16+ bytes"))
    link = ShardLink(0, 0, 0, model.kv_heads, 0, model.kv_heads, 0, model.kv_heads)
    pages = np.random.default_rng(0).permutation(TOKENS + 64)[:TOKENS].astype(np.int64)
    regions = list(range(pool.layout.num_regions))
    kv_bytes = TOKENS * sum(b.numel() for b in buffers) // (TOKENS + 64)
    prefill, decode, copy = [], [], []
    for _ in range(reps):
        started = time.perf_counter()
        acc = sums.zeros()
        for start in range(0, TOKENS, CHUNK):
            slots = token_slots(pages, 0, start, start + CHUNK, 1)
            for layer in range(pool.layout.num_layers):  # as the layer-wise writer does
                sums.add_link(
                    acc, 7, sums.regions_of([layer]), link, 0, (start, start + CHUNK), slots
                )
        sent = sums.read(acc)
        prefill.append(time.perf_counter() - started)

        started = time.perf_counter()
        acc = sums.zeros()
        sums.add_link(acc, 7, regions, link, 0, (0, TOKENS), token_slots(pages, 0, 0, TOKENS, 1))
        assert sums.read(acc) == sent
        decode.append(time.perf_counter() - started)

        rows = torch.from_numpy(pages).to(device)
        _sync(device)
        started = time.perf_counter()
        for b in buffers:  # one copy of the request's rows: what a transfer reads at least
            b.view(TOKENS + 64, -1).index_select(0, rows)
        _sync(device)
        copy.append(time.perf_counter() - started)
    p, d, c = (statistics.median(x) for x in (prefill, decode, copy))
    return {
        "model": model.name,
        "kv_mib": round(kv_bytes / 2**20, 1),
        "prefill_s": round(p, 4),
        "decode_s": round(d, 4),
        "copy_s": round(c, 4),
        "prefill_over_copy": round(p / c, 2),
        "decode_over_copy": round(d / c, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two layouts, one repetition")
    parser.add_argument("--out", default=None, help="unused: no files written")
    parser.add_argument("--device", default="cpu", help="where the pool lives (cpu, cuda)")
    args = parser.parse_args(argv)
    models = MODELS[:2] if args.quick else MODELS
    reps = 1 if args.quick else 3
    torch.set_num_threads(1)  # as one scheduler process of a served server
    print(f"[bench] keyed KV sums of one {TOKENS}-token request ({CHUNK}-token chunks), "
          f"{reps} repetition(s), 1 thread, device {args.device}")  # fmt: skip
    rows = []
    print(
        " layout                                           KV MiB  prefill s  decode s"
        "  copy s  prefill/copy  decode/copy"
    )
    for model in models:
        row = measure(model, reps, args.device)
        rows.append(row)
        print(f" {row['model']:46s} {row['kv_mib']:8} {row['prefill_s']:10} "
              f"{row['decode_s']:9} {row['copy_s']:7} {row['prefill_over_copy']:13} "
              f"{row['decode_over_copy']:12}")  # fmt: skip
    print(json.dumps({"tokens": TOKENS, "device": args.device, "rows": rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
