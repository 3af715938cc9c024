"""Cluster simulator command line.

    python -m sgl_pd.sim reproduce            the article's DeepSeek-R1 figures beside ours
    python -m sgl_pd.sim cpu-check RESULT     predict bench_mixed_vs_pd's run from its step times
    python -m sgl_pd.sim plan --model deepseek-r1 --gpu H200 --rate 4 --itl-slo 20 --ttft-slo 2000
    python -m sgl_pd.sim predict --model ... --prefill-nodes 1 --decode-nodes 3 --rate 3

Each ends with one JSON line of its headline figures.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from sgl_pd.sim.hardware import GPUS
from sgl_pd.sim.model import PRESETS, ModelSpec
from sgl_pd.sim.trace import Lengths


def _workload_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="deepseek-r1", help=f"{', '.join(PRESETS)} or a config.json")
    p.add_argument("--gpu", default="H200", choices=sorted(GPUS))
    p.add_argument("--rate", type=float, required=True, help="requests/s offered")
    p.add_argument("--prompt-mean", type=float, default=10_000, help="tokens (log-normal)")
    p.add_argument("--output-mean", type=float, default=950, help="tokens (log-normal)")
    p.add_argument("--length-cv", type=float, default=0.5, help="coefficient of variation")
    p.add_argument("--trace", type=Path, help="Mooncake .jsonl or Azure .csv trace instead")
    p.add_argument("--requests", type=int, default=800)
    p.add_argument(
        "--follow-up-share", type=float, default=0.0,
        help="share of requests that are a conversation's follow-up turn, all of whose "
        "prompt but --follow-up-new-tokens is cached where it is served",
    )  # fmt: skip
    p.add_argument("--follow-up-new-tokens", type=int, default=200)
    p.add_argument(
        "--local-prefill-max-tokens", type=int, default=0,
        help="decoders prefill uncached suffixes up to this long themselves (sgl_pd's "
        "--pd-local-prefill-max-tokens; 0 = off)",
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sgl_pd.sim", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    rep = sub.add_parser("reproduce", help="the article's DeepSeek-R1 figures")
    rep.add_argument("--no-sensitivity", action="store_true", help="skip the sensitivity runs")
    cpu = sub.add_parser("cpu-check", help="predict this machine's mixed-vs-PD benchmark")
    cpu.add_argument(
        "result", type=Path, help="benchmarks/results/bench_mixed_vs_pd/mixed_vs_pd.json"
    )
    for p in (rep, cpu):
        p.add_argument("--out", type=Path, help="also write the figures as JSON in this folder")
    pl = sub.add_parser("plan", help="cheapest deployment meeting the SLOs")
    _workload_args(pl)
    pl.add_argument("--itl-slo", type=float, required=True, help="ITL p99 target, ms")
    pl.add_argument("--ttft-slo", type=float, required=True, help="TTFT p99 target, ms")
    pl.add_argument("--max-nodes", type=int, default=32)
    pl.add_argument("--out", type=Path, default=Path("benchmarks/out"), help="plot and JSON here")
    pr = sub.add_parser(
        "predict", help="figures of one PD deployment and of mixed nodes on the same GPUs"
    )
    _workload_args(pr)
    pr.add_argument("--prefill-nodes", type=int, default=1)
    pr.add_argument("--decode-nodes", type=int, default=3)
    pr.add_argument("--decode-dp", action="store_true", help="DP attention + EP decode")
    pr.add_argument("--decode-gpus", type=int, default=8, help="GPUs per decode instance")
    pr.add_argument("--out", type=Path, help="also write the figures as JSON in this folder")
    args = parser.parse_args(argv)
    try:
        if args.command == "reproduce":
            from sgl_pd.sim.reproduce import reproduce

            head = reproduce(sensitivity=not args.no_sensitivity)
            _write(args.out, "reproduce.json", head)
            print(json.dumps(head))
        elif args.command == "cpu-check":
            from sgl_pd.sim.reproduce import cpu_check

            out = cpu_check(args.result)
            _write(args.out, "cpu_check.json", out)
            print(json.dumps({k: v for k, v in out.items() if k != "rows"}))
        elif args.command == "plan":
            return _plan(args)
        else:
            return _predict(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _write(folder: Path | None, name: str, data: object) -> None:
    if folder is not None:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(data, indent=2))


def _trace_and_model(args: argparse.Namespace) -> tuple[ModelSpec, Lengths, Lengths]:
    from sgl_pd.sim.model import model_by_name

    spec = model_by_name(args.model)
    prompt = Lengths(args.prompt_mean, args.length_cv, 1, 1 << 20)
    output = Lengths(args.output_mean, args.length_cv, 1, 1 << 20)
    return spec, prompt, output


def _plan(args: argparse.Namespace) -> int:
    from sgl_pd.sim.planner import PlanInputs, Slo, plan, plot_frontier

    spec, prompt, output = _trace_and_model(args)
    slo = Slo(args.itl_slo, args.ttft_slo)
    inputs = PlanInputs(
        spec,
        args.gpu,
        args.rate,
        prompt,
        output,
        slo,
        max_nodes=args.max_nodes,
        requests=args.requests,
        follow_up_share=args.follow_up_share,
        follow_up_new_tokens=args.follow_up_new_tokens,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
    )
    print(
        f"planning {spec.name} on {args.gpu} at {args.rate} req/s; targets ITL p99 "
        f"{slo.itl_p99_ms} ms, TTFT p99 {slo.ttft_p99_ms} ms"
    )
    best, tried = plan(inputs)
    png = args.out / "plan_frontier.png"
    plot_frontier(tried, best, slo, png)
    print(f"\n{'deployment':<30} {'GPUs':>5} {'ITL p99':>8} {'TTFT p99':>9} {'tok/s':>6}  meets")
    for c in sorted(tried, key=lambda c: (c.gpus, c.shape)):
        f = c.figures
        print(
            f"{c.shape:<30} {c.gpus:>5} {f.itl_p99_ms:>8.1f} {f.ttft_p99_ms:>9.0f} "
            f"{f.tps_per_stream:>6.1f}  {'yes' if slo.met_by(f) else ''}"
        )
    print(f"frontier plot: {png}")
    if best is None:
        print(f"no deployment within {args.max_nodes} nodes meets the targets")
        print(json.dumps({"found": False}))
        return 1
    print(f"cheapest: {best.shape}, {best.gpus} GPUs")
    print(
        json.dumps(
            {"found": True, "deployment": best.shape, "gpus": best.gpus, **best.figures.as_dict()}
        )
    )
    return 0


def _predict(args: argparse.Namespace) -> int:
    from sgl_pd.sim.deploy import MixedSetup, PdSetup, figures
    from sgl_pd.sim.engine import SimRequest, TransferModel
    from sgl_pd.sim.hardware import Efficiency, Nics
    from sgl_pd.sim.roofline import RooflineCost
    from sgl_pd.sim.trace import load_trace, poisson, with_follow_ups

    spec, prompt, output = _trace_and_model(args)
    eff = Efficiency()
    gpu = GPUS[args.gpu]

    def trace() -> list[SimRequest]:
        if args.trace:
            requests = load_trace(args.trace, limit=args.requests)
        else:
            requests = poisson(args.rate, args.requests, prompt, output, seed=1)
        return with_follow_ups(requests, args.follow_up_share, args.follow_up_new_tokens, seed=2)

    tp = RooflineCost(spec, gpu, 8, 1, eff)
    dp = args.decode_gpus if args.decode_dp else 1
    decode = RooflineCost(spec, gpu, args.decode_gpus, dp, eff)
    transfer = TransferModel(
        spec.kv_bytes_per_token,
        spec.num_layers,
        Nics().node_bytes_s(eff.nic),
        eff.transfer_latency_ms / 1e3,
    )
    setup = PdSetup(
        tp, decode, args.prefill_nodes, args.decode_nodes, transfer, decode_ranks=dp,
        local_prefill_max_tokens=args.local_prefill_max_tokens,
    )  # fmt: skip
    pd = figures(*setup.run(trace()))
    # the baseline: mixed TP8 nodes on the same GPUs as the whole PD deployment
    mixed_nodes = args.prefill_nodes + args.decode_nodes * args.decode_gpus // 8
    mixed = figures(*MixedSetup(tp, mixed_nodes).run(trace()))
    for name, f in (("pd", pd), (f"mixed x{mixed_nodes}", mixed)):
        print(
            f"{name:<10} TTFT p50 {f.ttft_p50_ms:7.0f} ms  p99 {f.ttft_p99_ms:7.0f}  ITL p50 "
            f"{f.itl_p50_ms:6.1f} p99 {f.itl_p99_ms:6.1f} max {f.itl_max_ms:6.0f} ms  "
            f"{f.tps_per_stream:6.1f} tok/s per stream  {f.served_qps:5.2f} req/s  "
            f"exposed {f.exposed_p50_ms:.2f} ms"
        )
    result = {"pd": pd.as_dict(), "mixed": mixed.as_dict()}
    _write(args.out, "predict.json", result)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
