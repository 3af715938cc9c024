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

Runs twice, one cluster after the other: local prefill at its defaults (on), and off
(`--pd-local-prefill-max-tokens 0`: every request crosses the wire). Reports per run:
requests answered and failed, requests/s, TTFT and ITL p50/p99, the decoder's local
prefills and those sent to the prefill server after all (by why), and whether both
servers are still alive.

    python benchmarks/bench_local_concurrency.py [--quick] [--out benchmarks/out]

Quick: 384 requests, 128 in flight; full: 1,536 requests, 512 in flight. The last line
is JSON: requests (per run), failed (both runs; target 0), servers_alive (target true),
local_prefills and sent_out (on), and the on/off ratios of requests/s, TTFT p50 and
ITL p50/p99.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from sgl_pd.cluster.load import StreamStats, Workload, load_result, summarize
from sgl_pd.cluster.local import local_patience, pd_cluster
from sgl_pd.cluster.streaming import metric_by_label, metric_sums
from sgl_pd.models import TINY_LLAMA_PATH

LOCAL = "sgl_pd_local_prefills_total"
# the decoder's local prefill at its defaults, and off (every request crosses the wire)
MODES = {"on": [], "off": ["--pd-local-prefill-max-tokens", "0"]}


@dataclass(frozen=True)
class Run:
    stats: StreamStats
    local: float  # requests placed for local prefill
    sent_out: dict[str, float]  # of them sent to the prefill server after all, by why
    alive: bool  # both servers still up after the run

    @property
    def rps(self) -> float:
        return self.stats.completed / self.stats.duration_s


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def _sent_out(url: str) -> dict[str, float]:
    return metric_by_label(url, "sgl_pd_local_prefills_sent_out_total", "why")


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
    runs = {}
    for mode, local_flags in MODES.items():
        print(f"[bench] local prefill {mode} ...", flush=True)
        with pd_cluster(
            work / mode,
            prefill_extra=[*common, *room],
            decode_extra=[
                *common, *room, "--disaggregation-decode-enable-radix-cache", *local_flags
            ],
            patience=patience,
        ) as cluster:  # fmt: skip
            decoder = cluster.decode.url
            result = load_result(
                cluster.router_url, TINY_LLAMA_PATH, workload, args.out,
                timeout_s=patience.seconds(3600), label=f"router-pd-local-{mode}",
            )  # fmt: skip
            alive = all(
                s.process.process is not None and s.process.process.poll() is None
                for s in (cluster.prefill, cluster.decode)
            )
            runs[mode] = Run(
                summarize(result, workload.rate, itl_target_ms=1000.0),
                metric_sums(decoder, [LOCAL])[LOCAL],
                _sent_out(decoder),
                alive,
            )
    print(
        f"\n{'local prefill':<14}{'answered':>9}{'failed':>7}{'req/s':>7}{'TTFT p50':>10}"
        f"{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}{'placed':>8}{'out':>6}  alive"
    )
    for mode, r in runs.items():
        s = r.stats
        print(
            f"{mode:<14}{s.completed:>9}{count - s.completed:>7}"
            f"{s.completed / s.duration_s:>7.2f}{s.ttft_p50:>10.0f}{s.ttft_p99:>10.0f}"
            f"{s.itl_p50:>9.1f}{s.itl_p99:>9.1f}{r.local:>8.0f}{sum(r.sent_out.values()):>6.0f}"
            f"  {r.alive}"
        )
    print("(ms; placed: requests placed for local prefill, out: of them sent to the prefill")
    print(f" server after all, by why: {runs['on'].sent_out})")
    on, off = runs["on"], runs["off"]
    headline = {
        "requests": count,
        "failed": sum(count - r.stats.completed for r in runs.values()),
        "servers_alive": all(r.alive for r in runs.values()),
        "local_prefills": on.local,
        "sent_out": sum(on.sent_out.values()),
        "requests_per_s_on_over_off": _ratio(on.rps, off.rps),
        "ttft_p50_on_over_off": _ratio(on.stats.ttft_p50, off.stats.ttft_p50),
        "itl_p50_on_over_off": _ratio(on.stats.itl_p50, off.stats.itl_p50),
        "itl_p99_on_over_off": _ratio(on.stats.itl_p99, off.stats.itl_p99),
    }
    print(json.dumps(headline))
    return 0 if headline["failed"] == 0 and headline["servers_alive"] else 1


if __name__ == "__main__":
    sys.exit(main())
