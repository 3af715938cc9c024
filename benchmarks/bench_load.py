"""Production load: many streams per decoder through SGLang's own serving benchmark, PD
beside a monolithic server - every request answered and right - then a soak.

Sweep. Each setup in turn on this machine's cores (bundled tiny Llama, room for the
most requests the sweep keeps in flight): a monolithic server; SGLang's router in PD mode
over one prefill server (layer-wise sends) and one decode server (its prefix cache on,
local prefill at its defaults); with `--tp2`, once more with a TP2 decoder. At each
concurrency point `sglang.benchmark.serving` drives the setup - its `random-ids` dataset,
200 -> 64 tokens (or `--trace FILE`: its `mooncake` dataset over a trace in Mooncake's
format), `--max-concurrency` requests in flight, three times that many requests - while
`PROBES` greedy probe requests go through the same entry point; each probe is judged
token for token against the monolithic server's answer at idle (near ties aside). Per
point: requests/s, output tokens/s, TTFT and ITL p50/p99, errors (requests that failed
or timed out, probes included), wrong probes, and the PD/monolithic throughput ratio;
a plot of the sweep.

Profile. At the highest point the PD decode (and prefill) scheduler processes are
sampled with py-spy; the share of their busy samples in sgl_pd's own frames is reported
(target <= 5%), with the top sgl_pd frames.

Soak (`--soak MINUTES`, 0 skips it). The PD pair alone under steady traffic - the
sweep's lowest concurrency, 5% of requests cancelled by their client after the first
token - sampled every `--sample-s` seconds: each server's processes' resident memory,
threads and open file descriptors, and its gauges of held requests and sgl_pd tables
(rooms, KV writes in flight, staging bytes, running and queued requests). Reported:
growth per hour after a warm-up (target: memory < 1% an hour, threads and descriptors
flat), every gauge back to 0 once traffic stops and both pools idle (the servers' own
leak check), and the p99 TTFT and ITL of the last tenth of the run over the first
(target <= 1.2). A plot of memory and tables over the soak.

    python benchmarks/bench_load.py [--quick] [--concurrency N ...] [--tp2] [--soak MIN]
        [--trace FILE] [--model llama|mellum|qwen3-next] [--out DIR]

`--model mellum` serves the tiny Mellum (sliding-window layers in SGLang's hybrid SWA
pool: each request's window moves as state), `--model qwen3-next` the tiny Qwen3-Next
(gated DeltaNet: its Mamba slot moves as state); the default, the tiny Llama.

Quick: 16 and 128 in flight, no TP2, a 3-minute soak; full: 16, 64, 256 and 512, TP2,
a 60-minute soak. The last line is JSON: max_concurrency, wrong_tokens, errors,
pd_over_mono_throughput_at_max, sgl_pd_scheduler_share_at_max, soak_minutes,
soak_rss_growth_pct_per_hour, soak_tables_back_to_idle, soak_p99_drift.
SGLPD_LOCAL_PATIENCE=3 makes every wait three times longer on a loaded machine.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import math
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from sgl_pd.cluster.load import StreamStats, Workload, bench_serving_argv, summarize
from sgl_pd.cluster.local import local_patience, monolithic_server, pd_cluster
from sgl_pd.cluster.logs import pools_idle, wait_pools_idle
from sgl_pd.cluster.multiturn import Request
from sgl_pd.cluster.soak import (
    TABLE_GAUGES,
    ServerSample,
    Traffic,
    gauges,
    growth_pct_per_hour,
    p99_drift,
    sample_server,
)
from sgl_pd.cluster.streaming import Answer, judge, send
from sgl_pd.config import SglPdConfig
from sgl_pd.models import TINY_LLAMA_PATH, TINY_MELLUM_PATH, TINY_QWEN3_NEXT_PATH

INPUT_TOKENS, OUTPUT_TOKENS = 200, 64
PROBES = 8  # greedy probe requests per point, judged against the monolithic server
PROBE_TOKENS = 32
PROFILE_S = 20.0  # py-spy's sampling of each scheduler at the highest point
# A receiver remembers each delivery a while, to tell resent copies from new messages
# (`TimingBounds.delivery_memory_s`): the last of the tables to empty once a soak's
# traffic stopped, which the wait outlasts by a minute.
IDLE_WAIT_S = SglPdConfig().bounds().delivery_memory_s + 60.0


@dataclass
class Point:
    """One setup at one concurrency."""

    stats: StreamStats
    requests: int
    output_tokens_per_s: float
    verdicts: collections.Counter[str] = field(default_factory=collections.Counter)

    @property
    def errors(self) -> int:
        return self.stats.failed + self.verdicts["error"]

    @property
    def requests_per_s(self) -> float:
        return self.stats.completed / self.stats.duration_s


# the bundled models a sweep can serve (--model): a dense one, one with sliding-window
# layers in SGLang's hybrid SWA pool (their window moves as state), a gated-DeltaNet
# hybrid (its Mamba slot moves as state)
MODELS = {
    "llama": TINY_LLAMA_PATH,
    "mellum": TINY_MELLUM_PATH,
    "qwen3-next": TINY_QWEN3_NEXT_PATH,
}


def model_args(model: Path, requests: int) -> list[str]:
    """What `model` needs beside the common flags to hold `requests` at once."""
    if model == TINY_QWEN3_NEXT_PATH:
        return ["--max-mamba-cache-size", str(requests)]  # a state slot per request
    return []


def probe_requests(vocab_size: int, count: int, seed: int) -> list[Request]:
    rng = random.Random(seed)
    return [
        Request(
            f"probe{seed}-{i}",
            tuple(rng.randrange(vocab_size) for _ in range(INPUT_TOKENS)),
            PROBE_TOKENS,
        )
        for i in range(count)
    ]


def serving_argv(
    url: str, model: Path, workload: Workload, out: Path, trace: Path | None
) -> list[str]:
    argv = bench_serving_argv(url, model, workload, out)
    if trace is None:
        return argv
    # SGLang's mooncake dataset replays the trace's sessions (its `hash_ids` as blocks)
    i = argv.index("--dataset-name")
    argv[i + 1] = "mooncake"
    return [*argv, "--dataset-path", str(trace), "--mooncake-workload", "conversation"]


def run_point(
    url: str, model: Path, workload: Workload, probes: list[Request], out: Path, label: str,
    timeout_s: float, trace: Path | None,
) -> tuple[dict[str, Any], list[Answer]]:  # fmt: skip
    """SGLang's serving benchmark against `url`, the probes sent meanwhile; its detailed
    result and the probes' answers."""
    result_file, log_file = out / f"{label}.jsonl", out / f"{label}.log"
    result_file.unlink(missing_ok=True)
    answers: list[Answer] = []

    def probe_all() -> None:
        time.sleep(1.0)  # (the benchmark's requests are in flight)
        for request in probes:
            answers.append(send(url, request, timeout_s, logprobs=False, extra_key=None))

    prober = threading.Thread(target=probe_all, daemon=True)
    prober.start()
    with log_file.open("w") as log:
        proc = subprocess.run(
            serving_argv(url, model, workload, result_file, trace),
            stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s, check=False,
        )  # fmt: skip
    prober.join(timeout_s)
    if proc.returncode != 0 or not result_file.exists():
        tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"sglang.benchmark.serving failed ({log_file}):\n{tail}")
    result = json.loads(result_file.read_text().splitlines()[-1])
    return result, answers


@contextlib.contextmanager
def setup(
    name: str, work: Path, room: list[str], model: Path
) -> Iterator[tuple[str, dict[str, object]]]:
    """(entry URL, {server name: Server}) of one setup serving `model`, stopped afterwards."""
    patience = local_patience()
    # (info: the servers log their pools' idle check, which the soak reads)
    common = ["--log-level", "info", "--enable-metrics", *room]
    if name == "mono":
        with monolithic_server(work / name, model=model, extra=common, patience=patience) as server:
            yield server.url, {"server": server}
        return
    decode = [*common, "--disaggregation-decode-enable-radix-cache"]
    if name == "pd_tp2":
        decode += ["--tp", "2"]
    with pd_cluster(
        work / name,
        model=model,
        prefill_extra=[*common, "--pd-kv-send", "layerwise"],
        decode_extra=decode,
        patience=patience,
    ) as cluster:
        yield cluster.router_url, {"prefill": cluster.prefill, "decode": cluster.decode}


def scheduler_pids(server: object) -> list[int]:
    """The SGLang scheduler processes of a server (one per rank)."""
    root = psutil.Process(server.process.process.pid)  # type: ignore[attr-defined]
    found = []
    for child in root.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "scheduler" in " ".join(child.cmdline()) or "scheduler" in child.name():
                found.append(child.pid)
    return found


@dataclass(frozen=True)
class Share:
    """Of a scheduler thread's py-spy samples, the share in sgl_pd's code: `own`, where
    the innermost sgl_pd-or-SGLang frame is sgl_pd's (what runs below it - the standard
    library, numpy - is sgl_pd's cost; SGLang's own work called from an sgl_pd hook is
    SGLang's, and so is the CPU harness, which stands in for its GPU kernels here), and
    `with_calls`, where any sgl_pd frame is on the stack (SGLang's work it wraps or asks
    for included: the step an AROUND hook runs, the radix lookup of a local placement);
    and the innermost sgl_pd frames seen most in `own`."""

    own: float
    with_calls: float
    frames: list[tuple[str, int]]


def profile(pid: int, seconds: float, out: Path) -> Share:
    """py-spy's samples of scheduler process `pid` for `seconds`, of its scheduler thread
    (SGLang's event loop, which every step runs on; sgl_pd's own threads - messengers,
    transfer writes - are left out), idle ones included: that thread waits on torch's
    worker threads through every forward, and on its queues between steps."""
    raw = out / f"py-spy-{pid}.txt"
    subprocess.run(
        [str(Path(sys.executable).parent / "py-spy"), "record", "--pid", str(pid),
         "--duration", str(int(seconds)), "--rate", "100", "--format", "raw", "--idle",
         "--full-filenames", "--nonblocking", "--output", str(raw)],
        capture_output=True, timeout=seconds + 120, check=False,
    )  # fmt: skip
    if not raw.exists():
        return Share(math.nan, math.nan, [])
    return sgl_pd_share(raw.read_text())


def sgl_pd_share(raw: str) -> Share:
    """`Share` of py-spy's raw samples (recorded with full file names)."""
    total = own = with_calls = 0
    frames: collections.Counter[str] = collections.Counter()

    def ours(frame: str) -> bool:
        return "sgl_pd/" in frame and "sgl_pd/harness/" not in frame

    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not count.isdigit():
            continue
        n = int(count)
        if "run_scheduler_process" not in stack:
            continue  # (another thread of the process)
        total += n
        stack_frames = stack.split(";")
        if any(ours(f) for f in stack_frames):
            with_calls += n
        owned = [f for f in stack_frames if "sgl_pd/" in f or "/sglang/" in f]
        if owned and ours(owned[-1]):
            own += n
            frames[owned[-1].split("site-packages/")[-1]] += n
    if not total:
        return Share(math.nan, math.nan, [])
    return Share(own / total, with_calls / total, frames.most_common(8))


def _profile_all(pids: dict[str, list[int]], shares: dict[str, Share], out: Path) -> None:
    """Each role's first scheduler, one after the other, once the load is up."""
    time.sleep(5.0)
    for role, found in pids.items():
        if found:
            shares[role] = profile(found[0], PROFILE_S, out)


@dataclass
class Soak:
    minutes: float
    samples: dict[str, list[ServerSample]]
    idle: dict[str, dict[str, float]]  # each server's gauges once traffic stopped
    pools_idle: bool
    traffic: Traffic

    def growth(self, server: str, what: str) -> float:
        s = self.samples[server]
        values = [getattr(x.processes, what) for x in s]
        return growth_pct_per_hour([x.at_s for x in s], values)

    def change(self, server: str, what: str) -> int:
        """After the warm-up to the end: threads or descriptors gained."""
        s = self.samples[server]
        kept = [x for x in s if x.at_s >= s[0].at_s + 0.2 * (s[-1].at_s - s[0].at_s)]
        return int(getattr(kept[-1].processes, what) - getattr(kept[0].processes, what))


def soak(
    url: str, servers: dict[str, object], minutes: float, concurrency: int, sample_s: float,
    vocab_size: int,
) -> Soak:  # fmt: skip
    traffic = Traffic(url, concurrency, vocab_size, INPUT_TOKENS, OUTPUT_TOKENS, seed=7)
    samples: dict[str, list[ServerSample]] = {name: [] for name in servers}
    began = time.monotonic()
    traffic.start()
    end = began + 60.0 * minutes
    next_report = began + 60.0
    while time.monotonic() < end:
        at = time.monotonic() - began
        for name, server in servers.items():
            pid = server.process.process.pid  # type: ignore[attr-defined]
            samples[name].append(sample_server(server.url, pid, at))  # type: ignore[attr-defined]
        if time.monotonic() >= next_report:
            next_report += 60.0
            done = len(traffic.outcomes)
            print(f"[bench] soak: {at / 60:.0f}/{minutes:g} min, {done} requests", flush=True)
        time.sleep(max(0.0, min(sample_s, end - time.monotonic())))
    traffic.stop(local_patience().seconds(600))
    patience = local_patience()
    pools = wait_pools_idle(servers, patience.seconds(120))  # type: ignore[arg-type]
    # the tables empty as their entries age out (deliveries are remembered a while, to
    # tell resent copies from new messages): read until all are 0, or the wait is over
    deadline = time.monotonic() + patience.seconds(IDLE_WAIT_S)
    while True:
        idle = {name: gauges(s.url) for name, s in servers.items()}  # type: ignore[attr-defined]
        if all(v == 0 for g in idle.values() for v in g.values()) or time.monotonic() > deadline:
            break
        time.sleep(5.0)
    return Soak(minutes, samples, idle, pools_idle(servers, pools), traffic)  # type: ignore[arg-type]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 and 128 in flight, 3-min soak")
    parser.add_argument("--concurrency", type=int, nargs="+", help="requests in flight")
    parser.add_argument(
        "--tp2", action=argparse.BooleanOptionalAction, help="a TP2 decoder too (full: yes)"
    )
    parser.add_argument("--soak", type=float, help="minutes (0: none; 60 full, 3 quick)")
    parser.add_argument("--sample-s", type=float, help="seconds between soak samples")
    parser.add_argument("--trace", type=Path, help="a Mooncake-format trace to replay")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument(
        "--model", choices=sorted(MODELS), default="llama", help="the bundled model served"
    )
    args = parser.parse_args(argv)
    model = MODELS[args.model]
    points = args.concurrency or ([16, 128] if args.quick else [16, 64, 256, 512])
    tp2 = args.tp2 if args.tp2 is not None else not args.quick
    soak_minutes = args.soak if args.soak is not None else (3.0 if args.quick else 60.0)
    sample_s = args.sample_s or (10.0 if args.quick else 30.0)
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_load_"))
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    top = max(points)
    room = [
        "--max-running-requests", str(top + 32),
        # SGLang's decoder reserves 512 tokens of pool for each running request
        "--max-total-tokens", str(max(32768, 640 * (top + 32))),
        *model_args(model, top + 32),
    ]  # fmt: skip
    setups = ["mono", "pd", *(["pd_tp2"] if tp2 else [])]
    print(
        f"[bench] load sweep of {args.model}: {points} in flight, {', '.join(setups)};"
        f" logs in {work}"
    )
    timeout_s = local_patience().seconds(3600)
    probes = {c: probe_requests(vocab, PROBES, seed=c) for c in points}
    reference: dict[str, Answer] = {}
    results: dict[str, dict[int, Point]] = {}
    shares: dict[str, Share] = {}
    soaked: Soak | None = None
    for name in setups:
        results[name] = {}
        with setup(name, work, room, model) as (url, servers):
            if name == "mono":  # the reference: each probe alone, with its top logprobs
                for request in (r for c in points for r in probes[c]):
                    reference[request.key] = send(
                        url, request, timeout_s, logprobs=True, extra_key=None
                    )
            for c in points:
                print(f"[bench] {name}: {c} in flight ...", flush=True)
                workload = Workload(INPUT_TOKENS, OUTPUT_TOKENS, 3 * c, math.inf, seed=c,
                                    max_concurrency=c)  # fmt: skip
                profiler = None
                if c == top and name == "pd":
                    pids = {s: scheduler_pids(servers[s]) for s in ("decode", "prefill")}
                    profiler = threading.Thread(
                        target=_profile_all, args=(pids, shares, work), daemon=True
                    )
                    profiler.start()
                result, answers = run_point(  # (SGLang's details stay with the logs)
                    url, model, workload, probes[c], work, f"{name}-{c}", timeout_s, args.trace
                )
                if profiler is not None:
                    profiler.join(PROFILE_S * 3 + 300)
                stats = summarize(result, math.inf, itl_target_ms=1000.0)
                point = Point(
                    stats, len(result["errors"]), sum(result["output_lens"]) / stats.duration_s
                )
                point.verdicts.update(judge(reference[a.key], a) for a in answers)
                results[name][c] = point
            if name == "pd" and soak_minutes > 0:
                print(f"[bench] soak: {soak_minutes:g} min at {min(points)} in flight", flush=True)
                soaked = soak(url, servers, soak_minutes, min(points), sample_s, vocab)
    return report(results, points, shares, soaked, args.out, args.model)


def report(
    results: dict[str, dict[int, Point]],
    points: list[int],
    shares: dict[str, Share],
    soaked: Soak | None,
    out: Path,
    model: str = "llama",
) -> int:
    print(
        f"\n{'setup':<8}{'in flight':>10}{'req/s':>8}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}"
        f"{'ITL p50':>9}{'ITL p99':>9}{'errors':>8}  probes"
    )
    for name, by_point in results.items():
        for c, p in by_point.items():
            s = p.stats
            print(
                f"{name:<8}{c:>10}{p.requests_per_s:>8.2f}{p.output_tokens_per_s:>8.0f}"
                f"{s.ttft_p50:>10.0f}{s.ttft_p99:>10.0f}{s.itl_p50:>9.1f}{s.itl_p99:>9.1f}"
                f"{p.errors:>8}  {dict(p.verdicts)}"
            )
    print("(ms; errors: requests that failed or timed out, probes included; probes: greedy")
    print(" requests judged against the monolithic server's answers at idle)")
    top = max(points)
    ratios = {
        c: results["pd"][c].requests_per_s / results["mono"][c].requests_per_s for c in points
    }
    print("PD/monolithic requests/s: " + ", ".join(f"{c}: {r:.2f}" for c, r in ratios.items()))
    _plot_sweep(results, points, out / "load_sweep.png")
    for role, share in shares.items():
        print(
            f"sgl_pd's share of the {role} scheduler thread at {top}: {share.own:.1%} in its"
            f" own code ({share.with_calls:.1%} with the SGLang calls its hooks make)"
        )
        for frame, n in share.frames:
            print(f"  {n:>6}  {frame}")
    headline: dict[str, object] = {
        "model": model,
        "max_concurrency": top,
        "wrong_tokens": sum(p.verdicts["wrong_tokens"] for p in _all(results)),
        "errors": sum(p.errors for p in _all(results)),
        "pd_over_mono_throughput_at_max": round(ratios[top], 3),
        "sgl_pd_scheduler_share_at_max": round(
            shares["decode"].own if "decode" in shares else math.nan, 4
        ),
    }  # fmt: skip
    if soaked is not None:
        headline |= _soak_report(soaked, out)
    print(json.dumps(headline))
    ok = headline["wrong_tokens"] == 0 and headline["errors"] == 0
    return 0 if ok else 1


def _all(results: dict[str, dict[int, Point]]) -> list[Point]:
    return [p for by_point in results.values() for p in by_point.values()]


def _soak_report(s: Soak, out: Path) -> dict[str, object]:
    outcomes = s.traffic.outcomes
    ended = collections.Counter(o.ended if o.ended in ("ok", "cancelled") else "error"
                                for o in outcomes)  # fmt: skip
    print(f"\nsoak: {s.minutes:g} min, {len(outcomes)} requests {dict(ended)}")
    failures = collections.Counter(o.ended for o in outcomes if o.ended not in ("ok", "cancelled"))
    for why, count in failures.most_common(5):
        print(f"  {count} failed: {why[:300]}")
    print(
        f"{'server':<9}{'RSS MiB':>9}{'RSS %/h':>9}{'threads':>9}{'+thr':>6}{'fds':>6}{'+fds':>6}"
    )
    growth = {}
    for name, samples in s.samples.items():
        last = samples[-1].processes
        growth[name] = s.growth(name, "rss_bytes")
        print(
            f"{name:<9}{last.rss_bytes / 2**20:>9.0f}{growth[name]:>9.2f}{last.threads:>9}"
            f"{s.change(name, 'threads'):>6}{last.fds:>6}{s.change(name, 'fds'):>6}"
        )
    for name, idle in s.idle.items():
        print(f"{name} once traffic stopped: {idle}")
    print(f"pools idle with no leak (the servers' own check): {s.pools_idle}")
    ok = [o for o in outcomes if o.ended in ("ok", "cancelled")]
    ttft = p99_drift([o.start_s for o in ok], [[o.ttft_s] for o in ok])
    itl = p99_drift([o.start_s for o in ok], [list(o.gaps_s) for o in ok])
    print(f"p99 drift, last tenth over first: TTFT {ttft:.2f}, ITL {itl:.2f}")
    _plot_soak(s, out / "load_soak.png")
    back = s.pools_idle and all(v == 0 for idle in s.idle.values() for v in idle.values())
    return {
        "soak_minutes": s.minutes,
        "soak_requests": len(outcomes),
        "soak_errors": ended["error"],
        "soak_rss_growth_pct_per_hour": round(max(growth.values()), 3),
        "soak_threads_gained": max(s.change(n, "threads") for n in s.samples),
        "soak_fds_gained": max(s.change(n, "fds") for n in s.samples),
        "soak_tables_back_to_idle": back,
        "soak_p99_drift": round(max(ttft, itl), 3),
    }


def _plot_sweep(results: dict[str, dict[int, Point]], points: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (rps, itl) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, by_point in results.items():
        rps.plot(points, [by_point[c].requests_per_s for c in points], marker="o", label=name)
        itl.plot(points, [by_point[c].stats.itl_p99 for c in points], marker="o", label=name)
    for ax, label in ((rps, "requests/s"), (itl, "ITL p99 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("requests in flight")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("SGLang's serving benchmark, 200 -> 64 tokens: PD vs monolithic")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


def _plot_soak(s: Soak, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (mem, tables) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, samples in s.samples.items():
        minutes = np.array([x.at_s for x in samples]) / 60
        mem.plot(minutes, [x.processes.rss_bytes / 2**20 for x in samples], label=name)
        for gauge in TABLE_GAUGES[:2]:
            tables.plot(minutes, [x.tables[gauge] for x in samples], label=f"{name} {gauge}")
    mem.set_ylabel("resident memory of the process tree (MiB)")
    tables.set_ylabel("held (requests)")
    for ax in (mem, tables):
        ax.set_xlabel("minutes")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Soak: the PD pair under steady traffic")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"plot: {path}")


if __name__ == "__main__":
    sys.exit(main())
