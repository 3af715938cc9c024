"""The article's workloads for DeepSeek-R1 and Qwen3-Coder, mixed vs disaggregated.

Against a running deployment: give the router URL of a mixed setup and/or of a PD setup
and the model path (its tokenizer makes the prompts); the script runs SGLang's own load
generator (`sglang.benchmark.serving`, Poisson arrivals, streamed) at several request
rates and reports, per setup and rate, per-stream tokens/s, TTFT p50/p99, ITL p50/p99/max
and goodput under an ITL target, as a table, a PNG and a JSON file:

    python benchmarks/bench_models.py --preset deepseek-r1 --model /models/DeepSeek-R1 \\
        --mixed-url http://mixed-router:8000 --pd-url http://pd-router:8000

Presets (override any figure with its flag):
  deepseek-r1   long prompts, moderate outputs: 4096 -> 1024 tokens, 1 to 8 req/s
  qwen3-coder   long code contexts: 16384 -> 512 tokens, 0.5 to 4 req/s
  qwen3-next    a gated-DeltaNet hybrid: 16384 -> 512 tokens, 0.5 to 4 req/s
  mellum        a sliding-window hybrid: 8192 -> 512 tokens, 0.5 to 4 req/s

For a hybrid model (Qwen3-Next: linear-attention layers beside full-attention ones;
Mellum: sliding-window layers beside them, in SGLang's hybrid SWA pool) the PD setup
also reports the bytes its prefill server moved per request - the full-attention
layers' KV and each linear-attention layer's final state, or each sliding layer's
window - against what the same model with every layer full attention would move (its
KV per token times the prompt, computed from the model's config).

With `--local` it starts both setups on this machine (two mixed servers vs one prefill +
one decode server, each pinned to its own core) with the bundled tiny model of the same
architecture (DeepSeek-V3 for deepseek-r1, Qwen3-MoE for qwen3-coder, Qwen3-Next for
qwen3-next, Mellum for mellum) and runs the same
workload at a scale that fits two CPU cores. `--quick` makes it shorter still.

The last line is JSON: per setup, at the highest rate, tps_per_stream, ttft_p50_ms,
itl_p50_ms, itl_p99_ms, goodput; for a hybrid model (local PD setup) also
bytes_per_request, full_attention_bytes_per_request and their ratio.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from sgl_pd.cluster.load import StreamStats, Workload, plot_setups, print_table, run_rates
from sgl_pd.cluster.local import deployment, local_patience
from sgl_pd.cluster.logs import timing_lines
from sgl_pd.models import (
    TINY_DEEPSEEK_V3_PATH,
    TINY_MELLUM_PATH,
    TINY_QWEN3_MOE_PATH,
    TINY_QWEN3_NEXT_PATH,
)


@dataclass(frozen=True)
class Preset:
    title: str
    input_tokens: int
    output_tokens: int
    rates: tuple[float, ...]  # requests/s
    requests_per_rate: int
    itl_target_ms: float
    local_model: Path  # the bundled model of the same architecture


PRESETS = {
    "deepseek-r1": Preset(
        "DeepSeek-R1", 4096, 1024, (1, 2, 4, 8), 200, 50.0, TINY_DEEPSEEK_V3_PATH
    ),
    "qwen3-coder": Preset(
        "Qwen3-Coder-480B", 16384, 512, (0.5, 1, 2, 4), 100, 50.0, TINY_QWEN3_MOE_PATH
    ),
    "qwen3-next": Preset(
        "Qwen3-Next-80B", 16384, 512, (0.5, 1, 2, 4), 100, 50.0, TINY_QWEN3_NEXT_PATH
    ),
    "mellum": Preset("Mellum", 8192, 512, (0.5, 1, 2, 4), 100, 50.0, TINY_MELLUM_PATH),
}
# a hybrid model's Mamba pool is otherwise sized from free memory (a large zeroed pool);
# its prefill server's per-request lines (what it moved) are logged at level info
LOCAL_MODEL_ARGS = {
    TINY_QWEN3_NEXT_PATH: ["--max-mamba-cache-size", "64", "--log-level", "info"],
    TINY_MELLUM_PATH: ["--log-level", "info"],
}
# the layer types of hybrid models (a config's ``layer_types``) besides full attention
HYBRID_LAYER_TYPES = ("linear_attention", "sliding_attention")


@dataclass(frozen=True)
class BytesMoved:
    """What a PD prefill server moved per request, against the full-attention equivalent."""

    requests: int
    bytes_per_request: float  # mean over the requests the prefill server sent
    full_attention_bytes_per_request: float  # every layer full attention, same prompts
    besides: str  # what moved besides the full-attention layers' KV

    @property
    def ratio(self) -> float:
        return self.bytes_per_request / self.full_attention_bytes_per_request


def hybrid_bytes(model: Path, prefill_log: Path) -> BytesMoved | None:
    """`BytesMoved` from the prefill's timing lines, for a model with linear-attention or
    sliding-window layers (None for any other): the full-attention equivalent is each
    line's tokens times the KV of one token in every layer (K and V, its KV heads, in
    the KV dtype the servers ran: float32 here)."""
    config = json.loads((model / "config.json").read_text())
    layer_types = set(config.get("layer_types", ()))
    if not set(HYBRID_LAYER_TYPES) & layer_types:
        return None
    besides = (
        "each linear-attention layer's state"
        if "linear_attention" in layer_types
        else "each sliding layer's window"
    )
    lines = [line for line in timing_lines(prefill_log) if line["tokens"]]
    if not lines:
        return None
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    token_bytes = 2 * config["num_key_value_heads"] * head_dim * 4 * config["num_hidden_layers"]
    moved = sum(float(line["bytes"]) for line in lines) / len(lines)
    full = sum(float(line["tokens"]) * token_bytes for line in lines) / len(lines)
    return BytesMoved(len(lines), moved, full, besides)


# --local: the same shape of workload at two CPU cores' scale (tiny model: ~20 ms a step)
LOCAL = {"input_tokens": 1024, "output_tokens": 64, "rates": (0.2, 0.5), "requests_per_rate": 10}
LOCAL_QUICK = {"input_tokens": 512, "output_tokens": 32, "rates": (0.5,), "requests_per_rate": 6}
LOCAL_SERVER_ARGS = ["--dtype", "float32", "--disable-radix-cache"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--preset", choices=sorted(PRESETS), required=True)
    parser.add_argument("--model", type=Path, help="model path (tokenizer); default: local")
    parser.add_argument("--mixed-url", help="router of a mixed (non-PD) deployment")
    parser.add_argument("--pd-url", help="router of a PD deployment")
    parser.add_argument("--local", action="store_true", help="start both setups here")
    parser.add_argument("--quick", action="store_true", help="with --local: one short rate")
    parser.add_argument("--input-tokens", type=int)
    parser.add_argument("--output-tokens", type=int)
    parser.add_argument("--rates", type=float, nargs="+", help="requests/s")
    parser.add_argument("--requests", type=int, help="requests per rate")
    parser.add_argument("--itl-target-ms", type=float, help="goodput's ITL target")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    if args.local == bool(args.mixed_url or args.pd_url):
        parser.error("give --local, or the URL of at least one deployment (--mixed-url/--pd-url)")
    if not args.local and args.model is None:
        parser.error("--model is needed with deployment URLs (its tokenizer makes the prompts)")

    preset = PRESETS[args.preset]
    if args.local:
        preset = replace(preset, **(LOCAL_QUICK if args.quick else LOCAL))
    preset = replace(
        preset,
        input_tokens=args.input_tokens or preset.input_tokens,
        output_tokens=args.output_tokens or preset.output_tokens,
        rates=tuple(args.rates or preset.rates),
        requests_per_rate=args.requests or preset.requests_per_rate,
        itl_target_ms=args.itl_target_ms or preset.itl_target_ms,
    )
    model = args.model or preset.local_model
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"bench_{args.preset}_"))
    patience = local_patience()
    setups = (
        ["mixed", "pd"] if args.local else [n for n in ("mixed", "pd") if getattr(args, f"{n}_url")]
    )
    print(
        f"[bench] {preset.title} workload: {preset.input_tokens} -> {preset.output_tokens} "
        f"tokens, {preset.requests_per_rate} requests at each of {list(preset.rates)} req/s; "
        f"model {model}; logs in {work}",
        flush=True,
    )

    results: dict[str, list[StreamStats]] = {}
    for name in setups:
        with contextlib.ExitStack() as stack:
            if args.local:
                started = time.monotonic()
                extra = [*LOCAL_SERVER_ARGS, *LOCAL_MODEL_ARGS.get(model, [])]
                url = stack.enter_context(deployment(name, work / name, model, extra, patience))
                print(f"[bench] {name}: up in {time.monotonic() - started:.0f} s", flush=True)
            else:
                url = getattr(args, f"{name}_url")
            workloads = [
                Workload(preset.input_tokens, preset.output_tokens, preset.requests_per_rate, r)
                for r in preset.rates
            ]
            results[name] = run_rates(
                name,
                url,
                model,
                workloads,
                work / name,
                itl_target_ms=preset.itl_target_ms,
                timeout_s=patience.seconds(3600),
            )

    print(f"\n{preset.title} workload, ITL target {preset.itl_target_ms:g} ms")
    print_table([(name, s) for name, runs in results.items() for s in runs])
    png = args.out / f"{args.preset}{'_local' if args.local else ''}.png"
    plot_setups(results, preset.itl_target_ms, png, f"{preset.title} workload ({model.name})")
    details = png.with_suffix(".json")
    details.write_text(
        json.dumps(
            {
                "preset": args.preset,
                "model": str(model),
                "workload": {
                    "input_tokens": preset.input_tokens,
                    "output_tokens": preset.output_tokens,
                    "requests_per_rate": preset.requests_per_rate,
                },
                "results": {n: [s.as_dict() for s in runs] for n, runs in results.items()},
            },
            indent=2,
        )
    )
    print(f"plot: {png}\ndetails: {details}")
    moved = hybrid_bytes(model, work / "pd" / "prefill.log") if args.local else None
    if moved is not None:
        mib, full_mib = (
            moved.bytes_per_request / 2**20,
            moved.full_attention_bytes_per_request / 2**20,
        )
        print(
            f"\nbytes moved per request by the PD prefill server ({moved.requests} requests):"
            f" {mib:.2f} MiB (full-attention KV and {moved.besides})"
            f" vs {full_mib:.2f} MiB were every layer full attention: {moved.ratio:.3f}x"
        )
    headline: dict[str, object] = {}
    for name, runs in results.items():
        top = runs[-1]
        headline[name] = {
            "rate": top.rate,
            "tps_per_stream": round(top.tps_per_stream, 2),
            "ttft_p50_ms": round(top.ttft_p50, 1),
            "itl_p50_ms": round(top.itl_p50, 2),
            "itl_p99_ms": round(top.itl_p99, 2),
            "goodput": round(top.goodput, 4),
        }
    if moved is not None:
        headline["bytes_per_request"] = round(moved.bytes_per_request)
        headline["full_attention_bytes_per_request"] = round(moved.full_attention_bytes_per_request)
        headline["bytes_ratio"] = round(moved.ratio, 4)
    print(json.dumps(headline))
    return 0


if __name__ == "__main__":
    sys.exit(main())
