"""Direct mode vs router mode: time to first token for the same workload, one cluster.

One prefill server feeds two decode servers on this machine (bundled tiny model, each
server on its own cores where there are enough). The same servers are reached two ways,
alternately at each request rate:

- router: SGLang's router in PD mode sends each request to the prefill server and to a
  decoder (round robin) with a shared bootstrap room;
- direct: clients send requests straight to the decoders (half the rate each); a decoder
  submits the prefill to the prefill server itself (D3).

Load comes from SGLang's own `sglang.benchmark.serving` (Poisson arrivals, streamed,
random token ids). Reports TTFT p50/p99 (and the rest of the per-stream figures) per mode
and rate as a table, a PNG and a JSON file.

    python benchmarks/bench_direct.py [--quick] [--out benchmarks/out]

The last line is JSON: ttft_p50_direct_ms, ttft_p50_router_ms, ttft_p99_direct_ms,
ttft_p99_router_ms (highest rate).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from sgl_pd.cluster.load import (
    StreamStats,
    Workload,
    plot_grouped_bars,
    print_table,
    run_load,
    run_split_load,
)
from sgl_pd.cluster.local import direct_cluster, local_patience
from sgl_pd.models import TINY_LLAMA_PATH

MODES = ("router", "direct")
ITL_TARGET_MS = 100.0  # goodput's target; the bundled model decodes a step in ~20 ms


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one rate, few requests")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--input-tokens", type=int, default=512)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--rates", type=float, nargs="+", default=None, help="requests/s")
    parser.add_argument("--requests", type=int, default=None, help="per rate and mode")
    args = parser.parse_args(argv)
    rates = args.rates or ([1.0] if args.quick else [0.5, 1.0, 2.0])
    num_requests = args.requests or (12 if args.quick else 40)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_direct_"))
    patience = local_patience()
    timeout_s = patience.seconds(1800)
    print(f"[bench] 1 prefill + 2 decoders, bundled tiny Llama; logs in {work}", flush=True)
    results: dict[str, list[StreamStats]] = {mode: [] for mode in MODES}
    with direct_cluster(work / "cluster", with_router=True, patience=patience) as cluster:
        assert cluster.router_url is not None
        decoders = [d.url for d in cluster.decoders]
        # warm both paths (first requests compile kernels and open connections)
        warm = Workload(args.input_tokens, args.output_tokens, 8, 2.0, seed=99)
        for run, url in ((run_load, cluster.router_url), (run_split_load, decoders)):
            run(url, TINY_LLAMA_PATH, warm, work / "warm", itl_target_ms=ITL_TARGET_MS,
                timeout_s=timeout_s, label="warm")  # fmt: skip
        for i, rate in enumerate(rates):
            workload = Workload(args.input_tokens, args.output_tokens, num_requests, rate)
            # alternate which mode goes first, so neither always meets a warmer cluster
            for mode in MODES if i % 2 == 0 else MODES[::-1]:
                print(f"[bench] {mode}: {workload.describe()} ...", flush=True)
                if mode == "router":
                    stats = run_load(
                        cluster.router_url, TINY_LLAMA_PATH, workload, work / mode,
                        itl_target_ms=ITL_TARGET_MS, timeout_s=timeout_s, label=mode,
                    )  # fmt: skip
                else:
                    stats = run_split_load(
                        decoders, TINY_LLAMA_PATH, workload, work / mode,
                        itl_target_ms=ITL_TARGET_MS, timeout_s=timeout_s, label=mode,
                    )  # fmt: skip
                results[mode].append(stats)
                print_table([(mode, stats)])

    print(
        f"\n{args.input_tokens}-token prompts, {args.output_tokens} output tokens, "
        f"{num_requests} requests per rate and mode"
    )
    print_table([(mode, s) for mode in MODES for s in results[mode]])
    png = args.out / "direct_vs_router_ttft.png"
    plot_grouped_bars(
        {
            f"{mode} {q}": [getattr(s, f"ttft_{q}") for s in results[mode]]
            for mode in MODES
            for q in ("p50", "p99")
        },
        [f"{r:g}" for r in rates],
        png,
        ylabel="TTFT (ms)",
        title="Direct mode vs router mode, 1 prefill + 2 decoders",
        xlabel="request rate (req/s)",
    )
    details = args.out / "direct_vs_router.json"
    details.write_text(json.dumps({m: [s.as_dict() for s in results[m]] for m in MODES}, indent=2))
    print(f"plot: {png}\ndetails: {details}")
    direct, router = results["direct"][-1], results["router"][-1]
    print(
        json.dumps(
            {
                "ttft_p50_direct_ms": round(direct.ttft_p50, 1),
                "ttft_p50_router_ms": round(router.ttft_p50, 1),
                "ttft_p99_direct_ms": round(direct.ttft_p99, 1),
                "ttft_p99_router_ms": round(router.ttft_p99, 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
