"""A production decoder's concurrency with local prefill at its defaults: SGLang's own
serving benchmark through SGLang's router in PD mode, many requests in flight - does
every request get an answer, and does the decoder stay up?

One prefill server, one decode server (its prefix cache on, so local prefill is on at
its defaults: ITL SLO, step budget, admission bound), SGLang's router. The load is
`sglang.benchmark.serving` with its `random-ids` dataset, 200 -> 64 tokens, a closed
loop of `--concurrency` requests in flight: the run in which a decoder of earlier
versions died in an extend batch with a negative extend length (its local step's budget
went below zero once the running streams outnumbered it). With the bundled model's
512-token vocabulary, SGLang's random-ids prompts often repeat a prefix another request
left in the decoder's cache, so many requests are placed for local prefill while
hundreds of streams run.

Reports: requests answered and failed, requests/s, TTFT and ITL p50/p99, the decoder's
local prefills and those sent to the prefill server after all (by why), and whether
both servers are still alive.

    python benchmarks/bench_local_concurrency.py [--quick] [--out benchmarks/out]

Quick: 384 requests, 128 in flight; full: 1,536 requests, 512 in flight. The last line
is JSON: requests, failed (target 0), servers_alive (target true), local_prefills,
sent_out, requests_per_s, ttft_p50_ms, itl_p50_ms, itl_p99_ms.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from pathlib import Path

import requests

from sgl_pd.cluster.load import Workload, load_result, summarize
from sgl_pd.cluster.local import local_patience, pd_cluster
from sgl_pd.cluster.streaming import metric_sums
from sgl_pd.models import TINY_LLAMA_PATH

LOCAL = "sgl_pd_local_prefills_total"


def _sent_out(url: str) -> dict[str, float]:
    text = requests.get(f"{url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("sgl_pd_local_prefills_sent_out_total{"):
            why = line.split('why="', 1)[1].split('"', 1)[0]
            out[why] = out.get(why, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="384 requests, 128 in flight")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--concurrency", type=int, default=None)
    args = parser.parse_args(argv)
    concurrency = args.concurrency or (128 if args.quick else 512)
    count = args.requests or 3 * concurrency
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_local_concurrency_"))
    workload = Workload(200, 64, count, math.inf, max_concurrency=concurrency)
    print(f"[bench] router PD, {workload.describe()}; logs in {work}", flush=True)
    patience = local_patience()
    room = [
        "--max-running-requests", str(concurrency + 32),
        # SGLang's decoder reserves 512 tokens of pool for each running request
        "--max-total-tokens", str(max(32768, 640 * (concurrency + 32))),
    ]  # fmt: skip
    common = ["--log-level", "warning", "--enable-metrics"]
    with pd_cluster(
        work,
        prefill_extra=[*common, *room],
        decode_extra=[*common, *room, "--disaggregation-decode-enable-radix-cache"],
        patience=patience,
    ) as cluster:
        decoder = cluster.decode.url
        result = load_result(
            cluster.router_url, TINY_LLAMA_PATH, workload, args.out,
            timeout_s=patience.seconds(3600), label="router-pd",
        )  # fmt: skip
        stats = summarize(result, workload.rate, itl_target_ms=1000.0)
        local = metric_sums(decoder, [LOCAL])[LOCAL]
        sent_out = _sent_out(decoder)
        alive = {
            s.process.name: s.process.process is not None and s.process.process.poll() is None
            for s in (cluster.prefill, cluster.decode)
        }
    print(
        f"\nanswered {stats.completed} of {count}, failed {stats.failed};"
        f" {stats.completed / stats.duration_s:.2f} requests/s"
    )
    print(
        f"TTFT p50 {stats.ttft_p50:.0f} ms, p99 {stats.ttft_p99:.0f} ms;"
        f" ITL p50 {stats.itl_p50:.1f} ms, p99 {stats.itl_p99:.1f} ms"
    )
    print(
        f"placed for local prefill: {local:.0f}; sent to the prefill server after all:"
        f" {sum(sent_out.values()):.0f} {sent_out}"
    )
    print(f"servers alive after the run: {alive}")
    headline = {
        "requests": count,
        "failed": count - stats.completed,
        "servers_alive": all(alive.values()),
        "local_prefills": local,
        "sent_out": sum(sent_out.values()),
        "requests_per_s": round(stats.completed / stats.duration_s, 2),
        "ttft_p50_ms": round(stats.ttft_p50, 1),
        "itl_p50_ms": round(stats.itl_p50, 1),
        "itl_p99_ms": round(stats.itl_p99, 1),
    }
    print(json.dumps(headline))
    return 0 if headline["failed"] == 0 and headline["servers_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())
