"""Bytes/s of sgl_pd's transfer layer against raw Mooncake on the same buffers.

Two processes on 127.0.0.1 over Mooncake's TCP transport: this one writes, a spawned one
owns the destination buffer and a word for the completion count. Both sides run with
serving's configuration: Mooncake's default per-peer TCP queue, our default in-flight cap
(1024 writes per peer). For each page count, repetitions alternate (rotating which goes
first):
- ours: what a prefill writer does with one group's writes: `CompletionWordWriter.
  send_many` (the `Writes` batch as numpy columns, cut into pipelined chunks under the
  cap, then the count word once they completed);
- raw: the simplest raw-Mooncake equivalent that works under the same queue:
  `batch_transfer_sync_write` with ready-made lists, one batch per 1024 writes in turn,
  then the 8-byte word; on the same engine and buffers.
Overhead per repetition = t_ours / t_raw - 1; a size's overhead is the median over
repetitions; the final JSON reports the worst size's median.

    .venv/bin/python benchmarks/bench_transfer.py --quick   # < 1 minute
    .venv/bin/python benchmarks/bench_transfer.py           # 1k .. 64k pages
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from sgl_pd.transfer import TransportConfig, Writes
from sgl_pd.transfer.completion import CompletionWordWriter
from sgl_pd.transfer.config import TCP_INFLIGHT_WRITES
from sgl_pd.transfer.mooncake import MooncakeTransferEngine

KIB = 1024
MIB = 1024 * KIB
GB = 1e9  # bytes per GB in the reported rates
SAMPLE_S = 0.3  # seconds, at least, per timed sample
Q_TIMEOUT_S = 120.0  # seconds a queue read may wait (touching 1 GiB takes a while)


WORD_VALUE = 7  # the count word's value (any)


def _receiver(cmd_q: Any, out_q: Any, nbytes: int) -> None:
    engine = MooncakeTransferEngine(TransportConfig(hostname="127.0.0.1"))
    try:
        buf = np.ones(nbytes, dtype=np.uint8)  # (nbytes,) destination, every page faulted in
        engine.register(int(buf.ctypes.data), nbytes)
        word = np.zeros(1, dtype=np.uint64)  # the completion count word
        engine.register(int(word.ctypes.data), word.nbytes)
        out_q.put((engine.session_id, int(buf.ctypes.data), int(word.ctypes.data)))
        deadline = time.monotonic() + 3600.0  # seconds: a lost parent never leaves us behind
        while time.monotonic() < deadline:
            try:
                if cmd_q.get(timeout=1.0) == "stop":
                    break
            except queue.Empty:
                continue
    finally:
        engine.close()


@dataclass(frozen=True)
class Row:
    pages: int
    gbps_ours: float  # median over repetitions, GB/s
    gbps_raw: float  # median over repetitions, GB/s
    overhead_pct: float  # median of per-repetition t_ours / t_raw - 1, percent
    overhead_min_pct: float  # min(t_ours) / min(t_raw) - 1, percent: robust to busy CPUs
    convert_ms: float  # median time of the three numpy .tolist() calls, ms


def _log(msg: str) -> None:
    print(f"[bench_transfer] {msg}", file=sys.stderr, flush=True)


def _batch(
    rng: np.random.Generator,
    pages: int,
    page: int,
    src: int,
    src_pages: int,
    dst: int,
    dst_pages: int,
) -> Writes:
    """`pages` writes of `page` bytes: sources cycle through the local buffer, destinations
    are a random scatter over the peer's buffer (reused cyclically past its end)."""
    i = np.arange(pages, dtype=np.int64)
    dst_idx = rng.permutation(max(pages, dst_pages))[:pages] % dst_pages
    return Writes.of(src + (i % src_pages) * page, dst + dst_idx * page, page)


def _measure(
    engine: MooncakeTransferEngine,
    words: CompletionWordWriter,
    peer: str,
    word_addr: int,
    writes: Writes,
    reps: int,
) -> Row:
    nbytes = writes.total_bytes
    t0 = time.perf_counter()
    lists = (writes.src.tolist(), writes.dst.tolist(), writes.nbytes.tolist())
    convert_s = time.perf_counter() - t0
    raw = engine.native
    cap = TCP_INFLIGHT_WRITES
    chunks = [tuple(col[i : i + cap] for col in lists) for i in range(0, len(writes), cap)]
    word = np.full(1, WORD_VALUE, dtype=np.uint64)
    engine.register(int(word.ctypes.data), word.nbytes)
    word_lists = ([int(word.ctypes.data)], [word_addr], [word.nbytes])

    def run_raw() -> None:
        for chunk in (*chunks, word_lists):
            rc = raw.batch_transfer_sync_write(peer, *chunk)
            if rc != 0:
                raise RuntimeError(f"raw batch_transfer_sync_write returned {rc}")

    variants: dict[str, Callable[[], None]] = {
        "ours": lambda: words.send_many(peer, writes, [(word_addr, WORD_VALUE)]),
        "raw": run_raw,
    }
    times: dict[str, list[float]] = {name: [] for name in variants}  # seconds per run
    for fn in variants.values():  # warm-up: handshakes, connections, caches
        fn()
    t0 = time.perf_counter()
    run_raw()
    # transfers per sample, so that one sample lasts >= SAMPLE_S and scheduler noise from
    # other jobs on the machine averages out for small requests
    inner = max(1, round(SAMPLE_S / (time.perf_counter() - t0)))
    names = list(variants)
    for r in range(reps):
        for name in names[r % 2 :] + names[: r % 2]:
            t0 = time.perf_counter()
            for _ in range(inner):
                variants[name]()
            times[name].append((time.perf_counter() - t0) / inner)
        _log(
            f"{len(writes)} pages rep {r + 1}/{reps}: "
            + ", ".join(f"{k} {nbytes / v[-1] / GB:.3f} GB/s" for k, v in times.items())
        )

    def gbps(name: str) -> float:
        return statistics.median(nbytes / t / GB for t in times[name])

    paired = [o / w - 1.0 for o, w in zip(times["ours"], times["raw"], strict=True)]
    return Row(
        pages=len(writes),
        gbps_ours=gbps("ours"),
        gbps_raw=gbps("raw"),
        overhead_pct=100.0 * statistics.median(paired),
        overhead_min_pct=100.0 * (min(times["ours"]) / min(times["raw"]) - 1.0),
        convert_ms=1e3 * convert_s,
    )


def run(page_counts: list[int], reps: int, page: int, side_bytes: int) -> list[Row]:
    ctx = mp.get_context("spawn")
    cmd_q, out_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(cmd_q, out_q, side_bytes), daemon=True)
    proc.start()
    engines: list[MooncakeTransferEngine] = []
    try:
        engine = MooncakeTransferEngine(TransportConfig(hostname="127.0.0.1"))  # as served
        engines.append(engine)
        words = CompletionWordWriter(engine)
        src = np.ones(side_bytes, dtype=np.uint8)  # (side_bytes,) source, faulted in
        src_addr = int(src.ctypes.data)
        engine.register(src_addr, side_bytes)
        _log(f"waiting for the receiver to fault in {side_bytes / MIB:.0f} MiB")
        peer, dst_addr, word_addr = out_q.get(timeout=Q_TIMEOUT_S)
        rng = np.random.default_rng(0)
        rows = []
        for pages in page_counts:
            writes = _batch(
                rng, pages, page, src_addr, side_bytes // page, dst_addr, side_bytes // page
            )
            rows.append(_measure(engine, words, peer, word_addr, writes, reps))
        words.close()
        return rows
    finally:
        for e in engines:
            e.close()
        cmd_q.put("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1k and 4k pages, fewer repetitions")
    ap.add_argument("--pages", type=int, nargs="+", help="page counts per request")
    ap.add_argument("--reps", type=int, help="timed repetitions per page count and side")
    ap.add_argument("--page-kib", type=int, default=64, help="page size, KiB")
    ap.add_argument("--side-mib", type=int, help="buffer per side, MiB (reused cyclically)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"), help="JSON here")
    args = ap.parse_args()
    pages = args.pages or ([1024, 4096] if args.quick else [1024, 4096, 16384, 65536])
    reps = args.reps or (8 if args.quick else 5)
    side = (args.side_mib or (256 if args.quick else 1024)) * MIB
    page = args.page_kib * KIB
    _log(f"pages {pages}, {reps} reps, {page // KIB} KiB pages, load {os.getloadavg()[0]:.2f}")
    rows = run(pages, reps, page, side)

    print(
        f"{'pages':>7} {'MiB':>7} {'GB/s ours':>10} {'GB/s raw':>9} {'overhead %':>11} "
        f"{'ovh % (min)':>12} {'tolist ms':>10}"
    )
    for row in rows:
        mib = row.pages * page / MIB
        print(
            f"{row.pages:>7} {mib:>7.0f} {row.gbps_ours:>10.3f} {row.gbps_raw:>9.3f} "
            f"{row.overhead_pct:>11.2f} {row.overhead_min_pct:>12.2f} {row.convert_ms:>10.2f}"
        )
    worst = max(rows, key=lambda r: r.overhead_pct)
    largest = rows[-1]
    headline = {
        "overhead_pct": round(worst.overhead_pct, 2),
        "overhead_stat": "worst page count's median of per-repetition overheads",
        "overhead_min_pct": round(max(r.overhead_min_pct for r in rows), 2),
        "gbps_ours": round(largest.gbps_ours, 3),
        "gbps_raw": round(largest.gbps_raw, 3),
        "gbps_at_pages": largest.pages,
        "page_bytes": page,
        "reps": reps,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transfer.json").write_text(
        json.dumps({"rows": [asdict(r) for r in rows], "headline": headline}, indent=2)
    )
    print(json.dumps(headline))


if __name__ == "__main__":
    main()
