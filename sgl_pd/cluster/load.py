"""Serving load through SGLang's own benchmark client, summarised per stream.

`run_load` runs ``python -m sglang.benchmark.serving`` (SGLang's load generator: Poisson
arrivals, streamed responses) against one URL - a router, a server - with prompts of
random token ids, and reads back its per-request details (TTFT, every inter-token gap).
`summarize` turns them into the figures users size a deployment by: per-stream tokens/s,
TTFT and ITL percentiles, and goodput under an ITL target.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np


@dataclass(frozen=True)
class Workload:
    """Requests of `input_tokens` random token ids wanting `output_tokens` each (exact
    lengths, EOS ignored), arriving as a Poisson process of `rate` requests/s."""

    input_tokens: int
    output_tokens: int
    num_requests: int
    rate: float
    seed: int = 1
    max_concurrency: int | None = None  # requests in flight at most (None: no limit)

    def describe(self) -> str:
        at_most = f", at most {self.max_concurrency} at once" if self.max_concurrency else ""
        return (
            f"{self.num_requests} requests of {self.input_tokens} -> {self.output_tokens} "
            f"tokens at {self.rate:g} req/s{at_most}"
        )


@dataclass(frozen=True)
class StreamStats:
    """What one load run measured, over its completed requests (ms unless named)."""

    rate: float
    completed: int
    failed: int
    input_tokens: float  # mean prompt length the client sent
    tps_per_stream: float  # median over requests of (output tokens - 1) / decode time, tok/s
    ttft_p50: float
    ttft_p99: float
    itl_p50: float
    itl_p99: float
    itl_max: float
    goodput: float  # requests/s whose every inter-token gap met the ITL target
    itl_target_ms: float
    duration_s: float

    def as_dict(self) -> dict[str, float]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in asdict(self).items()}


def bench_serving_argv(
    base_url: str, model: Path, workload: Workload, output_file: Path
) -> list[str]:
    return [
        sys.executable, "-m", "sglang.benchmark.serving",
        "--backend", "sglang",
        "--base-url", base_url,
        "--model", str(model),
        "--tokenizer", str(model),
        "--dataset-name", "random-ids",  # token ids drawn at random: no dataset download
        "--tokenize-prompt",  # sent as ids: prompts of exactly input_tokens tokens
        "--random-input-len", str(workload.input_tokens),
        "--random-output-len", str(workload.output_tokens),
        "--random-range-ratio", "1.0",
        "--num-prompts", str(workload.num_requests),
        "--request-rate", str(workload.rate),
        "--seed", str(workload.seed),
        "--warmup-requests", "1",
        "--ready-check-timeout-sec", "0",  # the caller started and checked the servers
        "--disable-tqdm",
        "--output-file", str(output_file),
        "--output-details",
        *(["--max-concurrency", str(workload.max_concurrency)] if workload.max_concurrency else []),
    ]  # fmt: skip


def run_load(
    base_url: str,
    model: Path,
    workload: Workload,
    out_dir: Path,
    *,
    itl_target_ms: float,
    timeout_s: float,
    label: str = "",
) -> StreamStats:
    """Runs `workload` against `base_url`; SGLang's output goes to a log in `out_dir`."""
    result = load_result(base_url, model, workload, out_dir, timeout_s=timeout_s, label=label)
    return summarize(result, workload.rate, itl_target_ms)


def run_split_load(
    base_urls: Sequence[str],
    model: Path,
    workload: Workload,
    out_dir: Path,
    *,
    itl_target_ms: float,
    timeout_s: float,
    label: str = "",
) -> StreamStats:
    """`workload` shared out over several entry points (decoders taking requests directly):
    one Poisson stream of rate/len(urls) per URL, all at once (together a Poisson stream of
    the workload's rate), their requests summarised together."""
    from concurrent.futures import ThreadPoolExecutor

    n = len(base_urls)
    shares = [
        Workload(
            workload.input_tokens,
            workload.output_tokens,
            -(-workload.num_requests // n),
            workload.rate / n,
            workload.seed + i,
        )
        for i in range(n)
    ]
    with ThreadPoolExecutor(n) as pool:
        results = list(
            pool.map(
                lambda i: load_result(
                    base_urls[i], model, shares[i], out_dir, timeout_s=timeout_s,
                    label=f"{label or 'load'}-{i}",
                ),
                range(n),
            )
        )  # fmt: skip
    merged: dict[str, Any] = {
        key: [v for r in results for v in r[key]]
        for key in ("ttfts", "itls", "output_lens", "input_lens", "errors")
    }
    merged["duration"] = max(float(r["duration"]) for r in results)
    return summarize(merged, workload.rate, itl_target_ms)


def load_result(
    base_url: str, model: Path, workload: Workload, out_dir: Path, *, timeout_s: float, label: str
) -> dict[str, Any]:
    """SGLang's detailed result of `workload` against `base_url` (seconds)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = f"{label or 'load'}-{workload.rate:g}rps"
    result_file, log_file = out_dir / f"{stem}.jsonl", out_dir / f"{stem}.log"
    result_file.unlink(missing_ok=True)  # SGLang appends
    with log_file.open("w") as log:
        proc = subprocess.run(
            bench_serving_argv(base_url, model, workload, result_file),
            stdout=log,
            stderr=subprocess.STDOUT,
            timeout=timeout_s,
            check=False,
        )
    if proc.returncode != 0 or not result_file.exists():
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"sglang.benchmark.serving failed ({log_file}):\n{tail}")
    lines = result_file.read_text().splitlines()
    result: dict[str, Any] = json.loads(lines[-1])
    return result


def summarize(result: dict[str, Any], rate: float, itl_target_ms: float) -> StreamStats:
    """Per-stream figures from one `sglang.benchmark.serving` result with details
    (seconds in its lists, ms in ours)."""
    done = [
        (ttft, itls, out_len)
        for ttft, itls, out_len, error in zip(
            result["ttfts"], result["itls"], result["output_lens"], result["errors"], strict=True
        )
        if not error and out_len > 0
    ]
    failed = len(result["errors"]) - len(done)
    if not done:
        raise RuntimeError(f"no request completed: {result['errors'][:3]}")
    ttfts = np.array([ttft for ttft, _, _ in done]) * 1e3
    gaps = np.concatenate([np.asarray(itls, dtype=float) for _, itls, _ in done]) * 1e3
    if gaps.size == 0:
        raise RuntimeError("no request streamed more than one chunk: no inter-token gaps")
    speeds = [(out_len - 1) / sum(itls) for _, itls, out_len in done if len(itls) and sum(itls) > 0]
    good = sum(1 for _, itls, _ in done if len(itls) and max(itls) * 1e3 <= itl_target_ms)
    duration = float(result["duration"])
    return StreamStats(
        rate=rate,
        completed=len(done),
        failed=failed,
        input_tokens=float(np.mean(result["input_lens"])),
        tps_per_stream=statistics.median(speeds) if speeds else 0.0,
        ttft_p50=float(np.percentile(ttfts, 50)),
        ttft_p99=float(np.percentile(ttfts, 99)),
        itl_p50=float(np.percentile(gaps, 50)),
        itl_p99=float(np.percentile(gaps, 99)),
        itl_max=float(gaps.max()),
        goodput=good / duration if duration > 0 else 0.0,
        itl_target_ms=itl_target_ms,
        duration_s=duration,
    )


TABLE_HEAD = (
    f"{'setup':<14} {'req/s':>6} {'prompt':>6} {'done':>5} {'tok/s/stream':>12} {'TTFT p50':>9} "
    f"{'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'ITL max':>8} {'goodput':>8}"
)


def table_row(setup: str, s: StreamStats) -> str:
    return (
        f"{setup:<14} {s.rate:>6g} {s.input_tokens:>6.0f} {s.completed:>5d} "
        f"{s.tps_per_stream:>12.1f} {s.ttft_p50:>9.0f} {s.ttft_p99:>9.0f} "
        f"{s.itl_p50:>8.1f} {s.itl_p99:>8.1f} {s.itl_max:>8.0f} {s.goodput:>8.3f}"
    )


def print_table(rows: Sequence[tuple[str, StreamStats]]) -> None:
    print(TABLE_HEAD)
    print("-" * len(TABLE_HEAD))
    for setup, stats in rows:
        print(table_row(setup, stats))


SETUP_LABELS = {"mixed": "mixed (2 servers)", "pd": "PD (1 prefill + 1 decode)"}


def plot_setups(
    results: dict[str, list[StreamStats]], itl_target_ms: float, path: Path, title: str
) -> None:
    """ITL p50/p99 and per-stream speed against request rate, one line per setup."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (itl, tps) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (name, runs), marker in zip(results.items(), "osd^", strict=False):
        rates = [s.rate for s in runs]
        label = SETUP_LABELS.get(name, name)
        line = itl.plot(rates, [s.itl_p99 for s in runs], f"{marker}-", label=f"{label} p99")
        itl.plot(
            rates,
            [s.itl_p50 for s in runs],
            f"{marker}:",
            color=line[0].get_color(),
            label=f"{label} p50",
        )
        tps.plot(rates, [s.tps_per_stream for s in runs], f"{marker}-", label=label)
    itl.axhline(itl_target_ms, color="grey", lw=0.8, ls="--", label="ITL target")
    itl.set_yscale("log")
    itl.set_xlabel("request rate (req/s)")
    itl.set_ylabel("inter-token latency, ms")
    itl.set_title("Decode stutter")
    tps.set_xlabel("request rate (req/s)")
    tps.set_ylabel("tokens/s per stream (median)")
    tps.set_title("Per-stream speed")
    for ax in (itl, tps):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def plot_grouped_bars(
    bars: dict[str, list[float]],
    sizes: Sequence[object],
    path: Path,
    *,
    ylabel: str,
    title: str,
    log_scale: bool = False,
    xlabel: str = "prompt tokens",
) -> None:
    """One group of bars per prompt length (or whatever `xlabel` names), one bar per
    series (label -> value per group)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.6, 4.2))
    width = 0.8 / len(bars)
    middle = (len(bars) - 1) / 2
    for i, (label, values) in enumerate(bars.items()):
        xs = [x + (i - middle) * width for x in range(len(sizes))]
        ax.bar(xs, values, width, label=label)
    ax.set_xticks(range(len(sizes)), [str(n) for n in sizes])
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if log_scale:
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(axis="y", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def run_rates(
    setup: str,
    url: str,
    model: Path,
    workloads: Sequence[Workload],
    out_dir: Path,
    *,
    itl_target_ms: float,
    timeout_s: float,
) -> list[StreamStats]:
    """`run_load` for each workload in turn against one setup, a table row after each."""
    runs = []
    for workload in workloads:
        print(f"[bench] {setup}: {workload.describe()} ...", flush=True)
        stats = run_load(
            url, model, workload, out_dir, itl_target_ms=itl_target_ms, timeout_s=timeout_s,
            label=setup,
        )  # fmt: skip
        runs.append(stats)
        print_table([(setup, stats)])
    return runs
