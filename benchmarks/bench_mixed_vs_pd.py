"""Mixed vs disaggregated serving on equal hardware: does PD remove decode stutter?

Two setups on this machine's two cores, run one after the other with the same workload:

- mixed: two ordinary SGLang servers behind SGLang's router, each pinned to one core;
- PD: one prefill server and one decode server behind the router in PD mode, each
  pinned to one core (sgl_pd, layer-wise streaming).

Every server runs one torch thread per core it has (`sgl_pd.cluster.local.place_servers`).
The model has the bundled tiny Llama's architecture at a larger size with random weights
(`sgl_pd.models.scaled`), so that a long prompt's prefill costs many decode steps as it
does on a GPU; the script measures and prints that ratio first. The load is SGLang's own
(`sglang.benchmark.serving`): Poisson arrivals of long prompts with moderate outputs at
several request rates. For each setup and rate it reports per-stream tokens/s, TTFT
p50/p99, ITL p50/p99/max and goodput (requests/s whose every inter-token gap met the ITL
target), as a table, a PNG and a JSON file.

    python benchmarks/bench_mixed_vs_pd.py [--quick] [--out benchmarks/out]

The last line is JSON: itl_p99_over_p50_pd / _mixed, itl_max_ms_pd / _mixed (highest
rate), tps_per_stream_pd_over_mixed (highest rate), prefill_over_decode_step.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sgl_pd.cluster.client import stream_generate
from sgl_pd.cluster.load import StreamStats, Workload, plot_setups, print_table, run_rates
from sgl_pd.cluster.local import (
    Patience,
    deployment,
    local_patience,
    monolithic_server,
    place_servers,
)
from sgl_pd.cluster.prompts import long_prompt_ids
from sgl_pd.models.scaled import DUMMY_WEIGHTS_ARGS, LlamaShape, write_scaled_llama

SHAPE = LlamaShape(
    hidden_size=512, num_layers=6, intermediate_size=1536, num_heads=8, num_kv_heads=4
)
SERVER_ARGS = [
    *DUMMY_WEIGHTS_ARGS,
    "--dtype",
    "float32",
    "--chunked-prefill-size",
    "4096",  # a whole prompt per forward, as PD prefills it
    "--disable-radix-cache",  # random prompts share nothing; keep the pools comparable
    "--max-running-requests",
    "16",
]
SETUPS = ("mixed", "pd")


def prefill_over_step(model: Path, log_dir: Path, prompt_tokens: int, patience: Patience) -> dict:
    """A long prompt's TTFT over a decode step's time, one server on one core, alone."""
    core = place_servers(2)[0]
    with monolithic_server(
        log_dir, model=model, extra=SERVER_ARGS, patience=patience, placement=core
    ) as server:
        timeout = patience.seconds(600)
        list(stream_generate(server.url, long_prompt_ids(64, 1), 4, timeout))  # warm-up
        ttfts, steps = [], []
        for rep in range(3):
            start = time.perf_counter()
            first = next(
                iter(
                    stream_generate(server.url, long_prompt_ids(prompt_tokens, rep + 5), 1, timeout)
                )
            )
            ttfts.append((first[0] - start) * 1e3)
            arrivals = [
                at
                for at, _ in stream_generate(
                    server.url, long_prompt_ids(16, rep), 40, timeout, ignore_eos=True
                )
            ]
            steps.extend((b - a) * 1e3 for a, b in itertools.pairwise(arrivals[1:]))
        # decode steps at the workload's context, one stream and four at once: what a
        # simulator needs to predict this run (sgl_pd.sim cpu-check)
        long_one = _steady_steps(server.url, prompt_tokens, 1, timeout)
        long_four = _steady_steps(server.url, prompt_tokens, 4, timeout)
    prefill_ms, step_ms = statistics.median(ttfts), statistics.median(steps)
    return {
        "prompt_tokens": prompt_tokens,
        "prefill_ms": prefill_ms,
        "step_ms": step_ms,
        "ratio": prefill_ms / step_ms,
        "step_ms_at_prompt_length": long_one,
        "step_ms_at_prompt_length_4_streams": long_four,
    }


def _steady_steps(url: str, prompt_tokens: int, streams: int, timeout: float) -> float:
    """Median gap (ms) between tokens once `streams` streams of long prompts all decode:
    gaps in the second half of each stream, after every prefill has finished."""
    out_tokens = 48

    def one(seed: int) -> list[float]:
        ids = long_prompt_ids(prompt_tokens, 100 + seed)
        return [at for at, _ in stream_generate(url, ids, out_tokens, timeout, ignore_eos=True)]

    with ThreadPoolExecutor(streams) as pool:
        runs = list(pool.map(one, range(streams)))
    start = max(run[0] for run in runs)  # every stream has its first token: all decode
    gaps = [
        (b - a) * 1e3
        for run in runs
        for a, b in itertools.pairwise(run[out_tokens // 2 :])
        if a >= start
    ]
    return statistics.median(gaps)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one rate, few requests")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--input-tokens", type=int, default=2048)
    parser.add_argument("--output-tokens", type=int, default=None)
    parser.add_argument("--rates", type=float, nargs="+", default=None, help="requests/s")
    parser.add_argument("--requests", type=int, default=None, help="per rate")
    parser.add_argument(
        "--itl-target-ms",
        type=float,
        default=None,
        help="goodput's ITL target (default: 3x the measured decode step)",
    )
    args = parser.parse_args(argv)
    rates = args.rates or ([0.2] if args.quick else [0.1, 0.2, 0.3])
    num_requests = args.requests or (6 if args.quick else 12)
    output_tokens = args.output_tokens or (48 if args.quick else 128)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_mixed_vs_pd_"))
    model = write_scaled_llama(work / "model", SHAPE)
    patience = local_patience()
    print(
        f"[bench] model: tiny Llama's architecture at {SHAPE.parameters(512) / 1e6:.0f}M "
        f"parameters, random weights; logs in {work}",
        flush=True,
    )

    ratio = prefill_over_step(model, work / "calibrate", args.input_tokens, patience)
    print(
        f"[bench] one core, alone: {args.input_tokens}-token prefill {ratio['prefill_ms']:.0f} ms,"
        f" decode step {ratio['step_ms']:.1f} ms: a prefill costs {ratio['ratio']:.0f} decode"
        " steps",
        flush=True,
    )
    print(
        f"[bench] decode step at {args.input_tokens} tokens of context: "
        f"{ratio['step_ms_at_prompt_length']:.1f} ms one stream, "
        f"{ratio['step_ms_at_prompt_length_4_streams']:.1f} ms four streams",
        flush=True,
    )
    itl_target = args.itl_target_ms or 3 * ratio["step_ms"]

    results: dict[str, list[StreamStats]] = {name: [] for name in SETUPS}
    for name in SETUPS:
        started = time.monotonic()
        with deployment(name, work / name, model, SERVER_ARGS, patience) as url:
            print(f"[bench] {name}: up in {time.monotonic() - started:.0f} s", flush=True)
            workloads = [
                Workload(args.input_tokens, output_tokens, num_requests, rate) for rate in rates
            ]
            results[name] = run_rates(
                name,
                url,
                model,
                workloads,
                work / name,
                itl_target_ms=itl_target,
                timeout_s=patience.seconds(1800),
            )

    print(
        f"\n{args.input_tokens}-token prompts, {output_tokens} output tokens, "
        f"{num_requests} requests per rate; ITL target {itl_target:.0f} ms"
    )
    print_table([(name, s) for name in SETUPS for s in results[name]])
    png = args.out / "mixed_vs_pd.png"
    plot_setups(results, itl_target, png, "Mixed vs disaggregated on the same 2 CPU cores")
    details = args.out / "mixed_vs_pd.json"
    details.write_text(
        json.dumps(
            {
                "calibration": ratio,
                "workload": {
                    "prompt_tokens": args.input_tokens,
                    "output_tokens": output_tokens,
                    "requests_per_rate": num_requests,
                },
                "itl_target_ms": itl_target,
                "results": {n: [s.as_dict() for s in results[n]] for n in SETUPS},
            },
            indent=2,
        )
    )
    print(f"plot: {png}\ndetails: {details}")
    pd, mixed = results["pd"][-1], results["mixed"][-1]
    print(
        json.dumps(
            {
                "itl_p99_over_p50_pd": round(pd.itl_p99 / pd.itl_p50, 3),
                "itl_p99_over_p50_mixed": round(mixed.itl_p99 / mixed.itl_p50, 3),
                "itl_max_ms_pd": round(pd.itl_max, 1),
                "itl_max_ms_mixed": round(mixed.itl_max, 1),
                "tps_per_stream_pd_over_mixed": round(pd.tps_per_stream / mixed.tps_per_stream, 3),
                "prefill_over_decode_step": round(ratio["ratio"], 1),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
