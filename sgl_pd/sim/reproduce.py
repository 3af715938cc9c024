"""The DeepSeek-R1 figures of the article this design follows (Perplexity, "Disaggregated
prefill and decode", 2025-08-01) beside the simulator's, under one written set of
assumptions (`R1_ASSUMPTIONS`), and the simulator's prediction of this machine's CPU
mixed-vs-PD experiment from its measured step times."""

from __future__ import annotations

import functools
import json
import statistics
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sgl_pd.sim.deploy import Figures, MixedSetup, PdSetup, figures
from sgl_pd.sim.engine import SimRequest, TransferModel
from sgl_pd.sim.hardware import GPUS, Efficiency, Nics
from sgl_pd.sim.model import ModelSpec, model_by_name
from sgl_pd.sim.roofline import MeasuredCost, RooflineCost
from sgl_pd.sim.trace import Lengths, poisson

# The article's figures (DeepSeek-R1): mixed "struggled to exceed 50" tok/s per stream; one
# prefill node kept three decode nodes at "over 90" tok/s per stream and "about 1" request/s
# per decode node, for "about +100 ms" TTFT; data-parallel decode "about 50" tok/s per stream
# at 1 request/s per rank.
ARTICLE = {
    "r1_mixed_tps": 50.0,
    "r1_pd_tps": 90.0,
    "r1_qps_per_decode_node": 1.0,
    "r1_ttft_penalty_ms": 100.0,
    "r1_dp_tps": 50.0,
}
TOLERANCE = 0.20


@dataclass(frozen=True)
class Scenario:
    """One deployment question: a model on GPUs, a workload, the setups compared."""

    model: str = "deepseek-r1"
    gpu: str = "H200"
    gpus_per_node: int = 8
    prompt: Lengths = field(default_factory=lambda: Lengths(10_000, 0.5, 64, 64_000))
    output: Lengths = field(default_factory=lambda: Lengths(950, 0.5, 16, 8_000))
    qps_per_decode_node: float = 1.0
    prefill_nodes: int = 1
    decode_nodes: int = 3
    mixed_nodes: int = 3  # the deployment PD replaced: as many engines as decode nodes
    mixed_chunk_tokens: int = 8192  # SGLang's default chunked prefill on 141 GB GPUs
    prefill_chunk_tokens: int = 16384
    dp_decode_gpus: int = 32  # DP attention + EP over 4 nodes, one rank per GPU
    layerwise: bool = True
    requests: int = 1500
    seeds: tuple[int, ...] = (1, 2)
    eff: Efficiency = field(default_factory=Efficiency)


R1_ASSUMPTIONS = Scenario()


def _spec(s: Scenario) -> ModelSpec:
    return model_by_name(s.model)


def transfer_model(s: Scenario, spec: ModelSpec) -> TransferModel:
    return TransferModel(
        bytes_per_token=spec.kv_bytes_per_token,
        num_layers=spec.num_layers,
        node_bytes_s=Nics(per_node=s.gpus_per_node).node_bytes_s(s.eff.nic),
        latency_s=s.eff.transfer_latency_ms / 1e3,
        layerwise=s.layerwise,
    )


def _mean(runs: list[Figures]) -> dict[str, float]:
    keys = runs[0].as_dict().keys()
    return {k: statistics.fmean(r.as_dict()[k] for r in runs) for k in keys}


def _trace(s: Scenario, rate: float, count: int, *, seed: int) -> list[SimRequest]:
    return poisson(rate, count, s.prompt, s.output, seed=seed)


def simulate_r1(s: Scenario = R1_ASSUMPTIONS) -> dict[str, dict[str, float]]:
    """Mixed, 1P:3D TP8 and DP decode under `s`, each averaged over the scenario's seeds."""
    spec = _spec(s)
    gpu = GPUS[s.gpu]
    tp = RooflineCost(spec, gpu, s.gpus_per_node, 1, s.eff)
    dp = RooflineCost(spec, gpu, s.dp_decode_gpus, s.dp_decode_gpus, s.eff)
    transfer = transfer_model(s, spec)
    rate = s.qps_per_decode_node * s.decode_nodes
    # DP decode: the article's rate per decode node applies per rank (one rank per GPU);
    # prefill nodes in the TP setup's proportion to that load, so they keep up
    dp_rate = s.qps_per_decode_node * s.dp_decode_gpus
    dp_prefills = max(1, round(dp_rate / rate * s.prefill_nodes))
    runs: dict[str, list[Figures]] = {"mixed": [], "pd": [], "dp": []}
    for seed in s.seeds:
        trace = functools.partial(_trace, s, seed=seed)
        runs["mixed"].append(
            figures(
                *MixedSetup(tp, s.mixed_nodes, s.mixed_chunk_tokens).run(trace(rate, s.requests))
            )
        )
        pd = PdSetup(tp, tp, s.prefill_nodes, s.decode_nodes, transfer, s.prefill_chunk_tokens)
        runs["pd"].append(figures(*pd.run(trace(rate, s.requests))))
        dps = PdSetup(
            tp, dp, dp_prefills, 1, transfer, s.prefill_chunk_tokens, decode_ranks=s.dp_decode_gpus
        )
        runs["dp"].append(figures(*dps.run(trace(dp_rate, 2 * s.requests))))
    return {name: _mean(r) for name, r in runs.items()}


def headline(
    results: dict[str, dict[str, float]], s: Scenario = R1_ASSUMPTIONS
) -> dict[str, float]:
    return {
        "r1_mixed_tps": round(results["mixed"]["tps_per_stream"], 1),
        "r1_pd_tps": round(results["pd"]["tps_per_stream"], 1),
        "r1_qps_per_decode_node": round(results["pd"]["served_qps"] / s.decode_nodes, 2),
        "r1_ttft_penalty_ms": round(
            results["pd"]["ttft_p50_ms"] - results["mixed"]["ttft_p50_ms"], 1
        ),
        "r1_dp_tps": round(results["dp"]["tps_per_stream"], 1),
    }


def within(figure: float, article: float, tolerance: float = TOLERANCE) -> bool:
    return abs(figure - article) <= tolerance * article


def print_assumptions(s: Scenario) -> None:
    e = s.eff
    print("assumptions (the article states none of the workload; these are ours):")
    print(
        f"  {s.model} FP8 weights, bf16 KV, {s.gpu} x{s.gpus_per_node} per node, "
        f"8 x 400 Gb/s NICs per node at {e.nic:.0%} of line rate"
    )
    print(
        f"  prompts log-normal mean {s.prompt.mean:.0f} tokens (cv {s.prompt.cv}), outputs "
        f"mean {s.output.mean:.0f} (cv {s.output.cv}), Poisson arrivals"
    )
    print(
        f"  PD: {s.prefill_nodes} prefill : {s.decode_nodes} decode TP{s.gpus_per_node} nodes "
        f"at {s.qps_per_decode_node} req/s per decode node, layer-wise KV streaming; "
        f"prefill chunks of {s.prefill_chunk_tokens}"
    )
    print(
        f"  mixed: {s.mixed_nodes} TP{s.gpus_per_node} nodes at the same per-node rate, prefill "
        f"first (SGLang's default), chunks of {s.mixed_chunk_tokens}"
    )
    print(f"  DP decode: DP attention + EP over {s.dp_decode_gpus} GPUs, 1 req/s per rank")
    print(
        f"  efficiency (calibrated): GEMM {e.peak_mfu:.0%} of peak, half of that at "
        f"{e.gemm_m_half:.0f} rows per weight matrix; HBM {e.hbm:.0%}; step overhead "
        f"{e.decode_overhead_ms} ms decode / {e.prefill_overhead_ms} ms prefill; all-reduce "
        f"{e.allreduce_us} us; EP dispatch+combine {e.all_to_all_us} us per MoE layer"
    )


def reproduce(s: Scenario = R1_ASSUMPTIONS, *, sensitivity: bool = True) -> dict[str, float]:
    print_assumptions(s)
    results = simulate_r1(s)
    head = headline(results, s)
    names = {
        "r1_mixed_tps": "mixed, tok/s per stream",
        "r1_pd_tps": "1P:3D, tok/s per stream",
        "r1_qps_per_decode_node": "1P:3D, req/s per decode node",
        "r1_ttft_penalty_ms": "1P:3D TTFT p50 - mixed's, ms",
        "r1_dp_tps": "DP decode, tok/s per stream",
    }
    print(f"\n{'figure':<32} {'article':>9} {'simulated':>10} {'within 20%':>11}")
    for key, label in names.items():
        ok = within(head[key], ARTICLE[key])
        print(f"{label:<32} {ARTICLE[key]:>9.1f} {head[key]:>10.1f} {'yes' if ok else 'NO':>11}")
    print("\nper setup (means over seeds):")
    print(
        f"{'setup':<6} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'ITL max':>8} {'tok/s':>6} {'exposed':>8}"
    )
    for name, f in results.items():
        print(
            f"{name:<6} {f['ttft_p50_ms']:>9.0f} {f['ttft_p99_ms']:>9.0f} {f['itl_p50_ms']:>8.1f} "
            f"{f['itl_p99_ms']:>8.1f} {f['itl_max_ms']:>8.0f} {f['tps_per_stream']:>6.1f} "
            f"{f['exposed_p50_ms']:>8.2f}"
        )
    if sensitivity:
        print(
            "\nsensitivity (one assumption moved, the rest kept): tok/s mixed / 1P:3D, penalty ms"
        )
        for label, moved in (
            ("outputs -20%", replace(s, output=replace(s.output, mean=s.output.mean * 0.8))),
            ("outputs +20%", replace(s, output=replace(s.output, mean=s.output.mean * 1.2))),
            ("prompts -20%", replace(s, prompt=replace(s.prompt, mean=s.prompt.mean * 0.8))),
            ("prompts +20%", replace(s, prompt=replace(s.prompt, mean=s.prompt.mean * 1.2))),
        ):
            h = headline(simulate_r1(replace(moved, seeds=s.seeds[:1])), moved)
            print(
                f"  {label:<14} {h['r1_mixed_tps']:>6.1f} / {h['r1_pd_tps']:>6.1f}, "
                f"{h['r1_ttft_penalty_ms']:>6.0f}"
            )
    return head


# -- this machine's CPU experiment ------------------------------------------------------


def cpu_check(
    result_json: Path, *, output_tokens: int = 128, seeds: tuple[int, ...] = tuple(range(1, 21))
) -> dict[str, Any]:
    """Predicts benchmarks/bench_mixed_vs_pd.py's figures from its own calibration (one
    core: a prefill's time per token, one decode step) and compares with what it measured.

    The bench ran two mixed servers vs one prefill + one decode server, one core each, and
    measured alone on one core: a prompt's prefill, and decode steps at the prompt's context
    with one stream and with four (the growth per further stream)."""
    data = json.loads(result_json.read_text())
    cal = data["calibration"]
    if "step_ms_at_prompt_length_4_streams" not in cal:
        raise ValueError(
            f"{result_json} has no decode steps at the prompt's context: rerun "
            "benchmarks/bench_mixed_vs_pd.py, which measures them"
        )
    tokens = int(cal["prompt_tokens"])
    output_tokens = int(data.get("workload", {}).get("output_tokens", output_tokens))
    one = cal["step_ms_at_prompt_length"] / 1e3
    four = cal["step_ms_at_prompt_length_4_streams"] / 1e3
    cost = MeasuredCost(cal["prefill_ms"] / 1e3 / tokens, one, max(0.0, (four - one) / 3))
    transfer = TransferModel(1.0, 1, 1e12, 0.0, True)  # loopback, negligible at this scale
    rows = []
    for kind, runs in data["results"].items():
        for run in runs:
            count, output = int(run["completed"]), output_tokens
            sims = []
            for seed in seeds:
                trace = poisson(run["rate"], count, Lengths(tokens), Lengths(output), seed=seed)
                setup = (
                    MixedSetup(cost, 2, chunk_tokens=max(tokens, 8192))
                    if kind == "mixed"
                    else PdSetup(cost, cost, 1, 1, transfer, chunk_tokens=max(tokens, 8192))
                )
                sims.append(figures(*setup.run(trace), warmup=0.0))
            predicted = _mean(sims)
            rows.append(
                {
                    "setup": kind,
                    "rate": run["rate"],
                    "measured": {
                        k: run[k] for k in ("tps_per_stream", "ttft_p50", "itl_p50", "itl_p99")
                    },
                    "predicted": {
                        "tps_per_stream": predicted["tps_per_stream"],
                        "ttft_p50": predicted["ttft_p50_ms"],
                        "itl_p50": predicted["itl_p50_ms"],
                        "itl_p99": predicted["itl_p99_ms"],
                    },
                }
            )
    print(
        f"{'setup':<6} {'req/s':>5}  {'figure':<15} {'measured':>9} {'predicted':>9} {'error':>7}"
    )
    errors: dict[str, list[float]] = {}
    for row in rows:
        for key in row["measured"]:
            m, p = row["measured"][key], row["predicted"][key]
            err = (p - m) / m if m else 0.0
            errors.setdefault(key, []).append(abs(err))
            print(
                f"{row['setup']:<6} {row['rate']:>5.2f}  {key:<15} {m:>9.1f} {p:>9.1f} {err:>+7.0%}"
            )
    summary = {f"median_abs_error_{k}": round(statistics.median(v), 3) for k, v in errors.items()}
    return {"rows": rows, **summary}
