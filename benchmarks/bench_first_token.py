"""Who samples the first token (D16), measured on the tiny DeepSeek-V3 with NEXTN.

Starts, side by side on this machine, a monolithic server and two PD clusters (prefill +
decode + router), all serving the bundled tiny DeepSeek-V3 with its MTP layer as the
NEXTN draft:

- `decode`: sgl_pd's default, the prefiller prefills tokens [0, n-1) and never samples;
  the decoder's first step feeds token n-1 and samples the first token, verifying the
  draft the prefiller's MTP layer proposed (the MTP hand-off);
- `prefill`: upstream's way (`--pd-first-token prefill`), the prefiller samples and ships
  the first token.

For prompts of 512, 2k and 8k tokens (distinct per request, so no prefix is cached) it
sends the same requests to the three deployments in turn, streaming, and reports:

- TTFT through each cluster's router (median), and its difference;
- the extra decode step's cost as a ratio to the prefill forward: the decoder's median
  step time (gap between streamed chunks, one chunk per verify step) over the median TTFT
  of the monolithic server (its prefill forward, sampling and draft extend: an upper
  bound of the forward, so the ratio errs high);
- the MTP draft acceptance rate (accepted / proposed drafts over every request) of the
  monolithic server and of the `decode` cluster: equal rates show that the prefill's
  hand-off, not a fresh start, seeded the decoder's first draft.

    python benchmarks/bench_first_token.py [--quick] [--out benchmarks/out]

Prints a table, writes a PNG plot, and ends with one JSON line. On a loaded machine,
SGLPD_LOCAL_PATIENCE=3 makes every wait (servers, router, requests) three times longer.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_pd.cluster.client import stream_generate
from sgl_pd.cluster.load import plot_grouped_bars
from sgl_pd.cluster.local import Patience, local_patience, monolithic_server, pd_cluster
from sgl_pd.cluster.prompts import long_prompt_ids
from sgl_pd.models import TINY_DEEPSEEK_V3_PATH

DEPLOYMENTS = ("mono", "decode", "prefill")  # monolithic; PD with D16; PD upstream's way
SERVER_ARGS = [
    "--dtype", "float32",
    "--chunked-prefill-size", "8192",  # one chunk per prompt
    "--max-prefill-tokens", "16384",
    "--disable-radix-cache",  # every prompt is computed whole
    "--speculative-algorithm", "NEXTN",
    "--speculative-num-steps", "1",
    "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "2",
    "--log-level", "info",
]  # fmt: skip


@dataclass(frozen=True)
class Sample:
    deployment: str
    tokens: int
    ttft_ms: float
    step_ms: float  # median gap between streamed chunks after the first
    correct_drafts: int
    proposed_drafts: int


def stream(
    url: str, ids: list[int], new_tokens: int, patience: Patience
) -> tuple[float, float, dict[str, Any]]:
    """(TTFT ms, median step ms, final meta_info) of one greedy streamed request."""
    start = time.perf_counter()
    chunks = list(stream_generate(url, ids, new_tokens, patience.seconds(600.0), ignore_eos=True))
    if len(chunks) < 3:
        raise RuntimeError(f"the stream gave {len(chunks)} chunks; need 3 or more")
    arrivals = [at for at, _ in chunks]
    gaps = [b - a for a, b in itertools.pairwise(arrivals[1:])]
    return (arrivals[0] - start) * 1e3, statistics.median(gaps) * 1e3, chunks[-1][1]["meta_info"]


@contextlib.contextmanager
def deployments(log_dir: Path, patience: Patience) -> Iterator[dict[str, str]]:
    """Starts the three deployments; yields their URLs; stops them all on exit."""
    with contextlib.ExitStack() as stack:
        mono = stack.enter_context(
            monolithic_server(
                log_dir / "mono", model=TINY_DEEPSEEK_V3_PATH, extra=SERVER_ARGS, patience=patience
            )
        )
        urls = {"mono": mono.url}
        for first_token in ("decode", "prefill"):
            args = [*SERVER_ARGS, "--pd-first-token", first_token]
            cluster = stack.enter_context(
                pd_cluster(
                    log_dir / first_token,
                    model=TINY_DEEPSEEK_V3_PATH,
                    prefill_extra=args,
                    decode_extra=args,
                    patience=patience,
                )
            )
            urls[first_token] = cluster.router_url
        yield urls


def measure(
    urls: dict[str, str], sizes: list[int], reps: int, new_tokens: int, patience: Patience
) -> list[Sample]:
    samples = []
    for tokens in sizes:
        for name in DEPLOYMENTS:  # warm-up at this length
            stream(urls[name], long_prompt_ids(tokens, 1), 8, patience)
        for rep in range(reps):
            ids = long_prompt_ids(tokens, 1000 * (rep + 2))
            # the order rotates so no deployment always goes first
            order = DEPLOYMENTS[rep % 3 :] + DEPLOYMENTS[: rep % 3]
            for name in order:
                ttft, step, meta = stream(urls[name], ids, new_tokens, patience)
                sample = Sample(
                    name,
                    tokens,
                    ttft,
                    step,
                    int(meta.get("spec_num_correct_drafts", 0)),
                    int(meta.get("spec_num_proposed_drafts", 0)),
                )
                samples.append(sample)
                print(
                    f"  {name:8s} {tokens:6d} tokens  rep {rep + 1}/{reps}: TTFT "
                    f"{ttft:8.1f} ms  step {step:6.1f} ms  drafts "
                    f"{sample.correct_drafts}/{sample.proposed_drafts}",
                    flush=True,
                )
    return samples


def accept_rate(samples: list[Sample]) -> float:
    proposed = sum(s.proposed_drafts for s in samples)
    return sum(s.correct_drafts for s in samples) / proposed if proposed else float("nan")


LABELS = {
    "mono": "monolithic",
    "decode": "PD, decoder samples (D16)",
    "prefill": "PD, prefiller samples (upstream)",
}


def plot(rows: dict[tuple[str, int], float], sizes: list[int], path: Path) -> None:
    plot_grouped_bars(
        {LABELS[name]: [rows[(name, n)] for n in sizes] for name in DEPLOYMENTS},
        sizes,
        path,
        ylabel="TTFT ms (median)",
        title="Time to first token, tiny DeepSeek-V3 + NEXTN (CPU)",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 and 2k tokens, 2 repetitions")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    sizes = [512, 2048] if args.quick else [512, 2048, 8192]
    reps = 2 if args.quick else 5
    new_tokens = 16 if args.quick else 32
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_first_token_"))
    print(f"[bench] prompts {sizes}, {reps} reps, {new_tokens} new tokens; logs in {log_dir}")

    patience = local_patience()
    started = time.monotonic()
    with deployments(log_dir, patience) as urls:
        print(f"[bench] deployments up in {time.monotonic() - started:.0f} s", flush=True)
        samples = measure(urls, sizes, reps, new_tokens, patience)

    def median(name: str, n: int, field: str) -> float:
        return statistics.median(
            getattr(s, field) for s in samples if s.deployment == name and s.tokens == n
        )

    ttft = {(name, n): median(name, n, "ttft_ms") for name in DEPLOYMENTS for n in sizes}
    print(
        "\n tokens  TTFT ms mono  PD decode-samples  PD prefill-samples  difference  "
        "decode step ms  step / prefill"
    )
    ratios = {}
    for n in sizes:
        step = median("decode", n, "step_ms")
        ratios[n] = step / ttft[("mono", n)]
        print(
            f" {n:6d}  {ttft[('mono', n)]:12.1f}  {ttft[('decode', n)]:17.1f}  "
            f"{ttft[('prefill', n)]:18.1f}  {ttft[('decode', n)] - ttft[('prefill', n)]:+10.1f}  "
            f"{step:14.1f}  {ratios[n]:14.3f}"
        )
    mono_rate = accept_rate([s for s in samples if s.deployment == "mono"])
    pd_rate = accept_rate([s for s in samples if s.deployment == "decode"])
    upstream_rate = accept_rate([s for s in samples if s.deployment == "prefill"])
    print(
        f"\nMTP acceptance: monolithic {mono_rate:.3f}, PD decoder-samples {pd_rate:.3f}, "
        f"PD prefill-samples {upstream_rate:.3f}"
    )
    png = args.out / "first_token.png"
    plot(ttft, sizes, png)
    print(f"plot: {png}")
    largest = sizes[-1]
    print(
        json.dumps(
            {
                "prompt_tokens": largest,
                "ttft_ms_decode_samples": round(ttft[("decode", largest)], 1),
                "ttft_ms_prefill_samples": round(ttft[("prefill", largest)], 1),
                "extra_step_ratio": round(ratios[largest], 4),
                "mtp_accept_mono": round(mono_rate, 4),
                "mtp_accept_pd": round(pd_rate, 4),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
