"""Exposed KV transfer time: layer-wise streaming against sending after the forward pass.

Starts two local prefill + decode + router clusters (bundled model, CPU) side by side, one
per mode, sends fresh prompts of 512, 2k and 8k tokens (each prefilled in one chunk) to
them in turn, and reads, for each request, the timing line its prefill writes (a request
without its own new line fails the run: no sample is ever reused), from the prefill
messenger's own timestamps (time.monotonic, shared by all processes of this machine):

    exposed transfer = KV transfer done - end of the prompt's forward pass

i.e. the part of the transfer the forward pass did not hide, which is what disaggregation
adds to the time to first token. One layer's transfer time is estimated from the
after-forward runs (all layers are written back to back there): (done - first write of
the last chunk) / layers. TTFT through the router is printed alongside.

    python benchmarks/bench_layerwise.py [--quick] [--out benchmarks/out]

Prints a table, writes a PNG plot, and ends with one JSON line. On a loaded machine,
SGLPD_LOCAL_PATIENCE=3 makes every wait (servers, router, requests) three times longer.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sgl_pd.cluster.client import stream_generate
from sgl_pd.cluster.local import Patience, PdCluster, local_patience, pd_cluster
from sgl_pd.cluster.logs import timing_lines
from sgl_pd.models import TINY_LLAMA_PATH

MODES = ("layerwise", "after-forward")
NUM_LAYERS = json.loads((TINY_LLAMA_PATH / "config.json").read_text())["num_hidden_layers"]
SERVER_ARGS = [
    "--chunked-prefill-size", "16384",  # one chunk per prompt: the forward is one pass
    "--max-prefill-tokens", "16384",
    # a cached prefix would be sent before the forward and the forward would shrink to the
    # uncached tail: every prompt must be computed whole to compare the two modes
    "--disable-radix-cache",
    "--log-level", "info",
]  # fmt: skip


@dataclass(frozen=True)
class Sample:
    mode: str
    tokens: int
    exposed_ms: float  # done - forward end
    last_chunk_ms: float  # done - first write of the last chunk
    ttft_ms: float


def prompt_ids(num_tokens: int, start: int) -> list[int]:
    """A counting prompt of exactly `num_tokens` tokens; `start` makes each one distinct."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA_PATH)
    text = "Count: " + " ".join(str(start + i) for i in range(num_tokens // 2))
    ids = list(tokenizer(text).input_ids[:num_tokens])
    if len(ids) != num_tokens:
        raise ValueError(f"prompt has {len(ids)} tokens, wanted {num_tokens}")
    return ids


def ttft_ms(url: str, ids: list[int], patience: Patience) -> float:
    start = time.perf_counter()
    for arrived, _ in stream_generate(url, ids, 2, patience.seconds(600.0)):
        return (arrived - start) * 1e3
    raise RuntimeError("the stream ended without a token")


def sample_once(
    mode: str, cluster: PdCluster, tokens: int, seed: int, patience: Patience
) -> Sample:
    """One fresh prompt through `cluster`; its prefill server's timing line for it."""
    log = cluster.prefill.process.log_path
    seen = len(timing_lines(log))
    ttft = ttft_ms(cluster.router_url, prompt_ids(tokens, seed), patience)
    deadline = time.monotonic() + patience.seconds(30.0)
    while len(lines := timing_lines(log)) <= seen:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{mode}: no timing line for the request within the wait ({log})")
        time.sleep(0.05)
    if len(lines) != seen + 1:
        raise RuntimeError(f"{mode}: {len(lines) - seen} timing lines for one request ({log})")
    line = lines[-1]
    done, forward_end = float(line["done"]), float(line["forward_end"])
    return Sample(
        mode,
        tokens,
        (done - forward_end) * 1e3,
        (done - float(line["last_chunk_first_write"])) * 1e3,
        ttft,
    )


def run_modes(sizes: list[int], reps: int, log_dir: Path, patience: Patience) -> list[Sample]:
    """Both modes' clusters up side by side; each size's requests alternate between them
    (the order flips every repetition), so both see the same machine."""
    samples = []
    with contextlib.ExitStack() as stack:
        clusters = {
            mode: stack.enter_context(
                pd_cluster(
                    log_dir / mode,
                    prefill_extra=[*SERVER_ARGS, "--pd-kv-send", mode],
                    decode_extra=SERVER_ARGS,
                    patience=patience,
                )
            )
            for mode in MODES
        }
        for tokens in sizes:
            for mode, cluster in clusters.items():
                sample_once(mode, cluster, tokens, 1, patience)  # warm-up, not kept
            for rep in range(reps):
                order = MODES if rep % 2 == 0 else MODES[::-1]
                for mode in order:
                    sample = sample_once(mode, clusters[mode], tokens, 1000 * (rep + 2), patience)
                    samples.append(sample)
                    print(
                        f"  {mode:13s} {tokens:6d} tokens  rep {rep + 1}/{reps}: exposed "
                        f"{sample.exposed_ms:8.2f} ms  TTFT {sample.ttft_ms:8.1f} ms",
                        flush=True,
                    )
    return samples


def plot(rows: dict[tuple[str, int], dict[str, float]], sizes: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for mode, marker in zip(MODES, ("o", "s"), strict=True):
        ax.plot(
            sizes,
            [rows[(mode, n)]["exposed_ms"] for n in sizes],
            marker=marker,
            label=f"{mode}: exposed transfer",
        )
    ax.plot(
        sizes,
        [rows[("after-forward", n)]["layer_ms"] for n in sizes],
        linestyle="--",
        color="grey",
        label="one layer's transfer",
    )
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.set_xlabel("prompt tokens (one prefill chunk)")
    ax.set_ylabel("ms (median)")
    ax.set_title("KV transfer left after the prefill forward pass (CPU, TCP loopback)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 and 2k tokens, 2 repetitions")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    sizes = [512, 2048] if args.quick else [512, 2048, 8192]
    reps = 2 if args.quick else 5
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_layerwise_"))
    print(f"[bench] {NUM_LAYERS} layers, prompts {sizes}, {reps} reps; logs in {log_dir}")

    patience = local_patience()
    samples = run_modes(sizes, reps, log_dir, patience)
    rows: dict[tuple[str, int], dict[str, float]] = {}
    for mode in MODES:
        for n in sizes:
            mine = [s for s in samples if s.mode == mode and s.tokens == n]
            rows[(mode, n)] = {
                "exposed_ms": statistics.median(s.exposed_ms for s in mine),
                "layer_ms": statistics.median(s.last_chunk_ms for s in mine) / NUM_LAYERS,
                "ttft_ms": statistics.median(s.ttft_ms for s in mine),
            }
    print("\n tokens  exposed ms layer-wise  exposed ms after-forward  one layer ms  ratio  "
          "TTFT ms lw / af")  # fmt: skip
    print(
        " one layer ms: from the after-forward runs, where every layer is written back to back"
        " after the forward: (transfer done - first write of the last chunk) / layers"
    )
    for n in sizes:
        lw, af = rows[("layerwise", n)], rows[("after-forward", n)]
        print(
            f" {n:6d}  {lw['exposed_ms']:19.2f}  {af['exposed_ms']:23.2f}  "
            f"{af['layer_ms']:12.2f}  {af['exposed_ms'] / max(lw['exposed_ms'], 1e-3):5.1f}  "
            f"{lw['ttft_ms']:7.0f} / {af['ttft_ms']:.0f}"
        )
    png = args.out / "layerwise.png"
    plot(rows, sizes, png)
    print(f"\nplot: {png}")
    largest = sizes[-1]
    lw, af = rows[("layerwise", largest)], rows[("after-forward", largest)]
    print(
        json.dumps(
            {
                "prompt_tokens": largest,
                "exposed_ms_layerwise": round(lw["exposed_ms"], 3),
                "exposed_ms_after_forward": round(af["exposed_ms"], 3),
                "layer_transfer_ms": round(af["layer_ms"], 3),
                "ratio": round(af["exposed_ms"] / max(lw["exposed_ms"], 1e-3), 2),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
