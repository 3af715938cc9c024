"""Multi-turn conversations through PD with the decoder's prefix cache on and off, against a
monolithic server: KV bytes moved, TTFT, request throughput, writes per request, tokens.

Workload (`sgl_pd.cluster.multiturn`), in token ids of the bundled tiny Llama (greedy, EOS
ignored: exact lengths):

- conversations: a shared system prompt; turn t's prompt is turn t-1's prompt, its answer
  (the token ids the monolithic server returned) and a new user message. `--concurrency`
  conversations are in flight, each sending its next turn once the last one is answered.
  Message lengths are drawn so that no two prompts share a length: the prefill's timing
  line (`tokens` = prompt length - 1) then names its request, hence its turn.
- a trace in Mooncake's public format (`--trace`, JSONL: timestamp ms, input_length,
  output_length, hash_ids of 512-token blocks), lengths and block size scaled by
  `--trace-scale`, sent at its timestamps (divided by `--trace-speedup`); a block id maps
  to the same token ids wherever it appears. Without `--trace`, a small synthetic trace of
  that format (written under --out) is replayed.

One server set at a time: a monolithic SGLang server (radix cache on) first, whose answers
make the conversations and are the reference (top-2 logprobs: a first divergence where its
top two were within 0.05 nat counts as a tie, not a mismatch); then router PD (one prefill
+ one decode server, `--enable-metrics`) with the decoder's prefix cache on
(`--disaggregation-decode-enable-radix-cache`), then off; both decoders get a pool of
`--decode-pool-tokens`. Last, the conversations once more through the router over one
prefill and two decoders with their caches on (`--decode-policy cache_aware`): the hit
rate when a turn must land on the decoder that holds its conversation, against one
decoder's (which holds them all). TTFT is timed on streamed /generate (`sgl_pd.cluster.streaming`):
the arrival of the first chunk that carries a token (a PD decoder that samples the first
token itself streams a chunk without one about a decode step earlier; the JSON has how
much earlier).

Per mode and workload: KV bytes moved per request (the prefill's timing lines: KV plus
the metadata row), the KV of the tokens the decoder did not hold (unheld tokens x KV bytes
per token, the slope of bytes over tokens of requests with nothing held), writes per
request, hit rate (the decoder's counters), TTFT p50/p99, requests/s.

Fragmentation (cache-on cluster): probe prompts go one at a time right after it starts
(a fresh pool); after the conversations and the trace, the conversations run again under
new cache namespaces (SGLang's `extra_key`: the same tokens, nothing held) until about
1.25 pools have been allocated, so that free pages lie between the pages the cache holds;
then the same probes under a namespace of their own. Writes per probe, fragmented / fresh.

    python benchmarks/bench_multiturn.py [--quick] [--out benchmarks/out] [--trace FILE]

Prints tables, writes two PNGs and a JSON file under --out, and ends with one JSON line.
SGLPD_LOCAL_PATIENCE=3 makes every wait three times longer on a loaded machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from sgl_pd.cluster.load import plot_grouped_bars
from sgl_pd.cluster.local import (
    Patience,
    direct_cluster,
    local_patience,
    monolithic_server,
    pd_cluster,
)
from sgl_pd.cluster.logs import TimingLine, timing_lines
from sgl_pd.cluster.multiturn import (
    Conversations,
    Request,
    build_conversations,
    load_trace,
    probe_requests,
    synthetic_trace,
    warmup_requests,
)
from sgl_pd.cluster.streaming import Answer, Client, judge, metric_sums
from sgl_pd.errors import ConfigError
from sgl_pd.models import TINY_LLAMA_PATH

MODES = ("monolithic", "pd_cache_on", "pd_cache_off")
TWO_DECODERS = "pd_2_decoders"  # cache on, two decoders, the router's cache-aware policy
PREFILL_ARGS = ("--log-level", "info", "--enable-metrics")  # info: the timing lines
# the decoder's prefix cache, every turn still sent to the prefill server (local prefill
# of short turns, `bench_placement.py`'s subject, would take them off the wire)
CACHE_ON = ("--disaggregation-decode-enable-radix-cache", "--pd-local-prefill-max-tokens", "0")
DECODE_COUNTERS = (  # the decoder's, summed over its ranks
    "sgl_pd_decode_prefix_tokens_total",
    "sgl_pd_decode_received_tokens_total",
    "sgl_pd_kv_bytes_not_sent_total",
)
CHURN_POOLS = 1.25  # decoder pools allocated before the fragmented probes
SGLANG_DECODE_RESERVE = 512  # tokens SGLang's decoder keeps free per running request


# -- phases ---------------------------------------------------------------------------------


@dataclass
class Phase:
    mode: str
    name: str  # conversations, trace, probes, probes_fresh, churn, probes_fragmented
    answers: dict[str, Answer]
    wall_s: float
    lines: list[TimingLine] = field(default_factory=list)  # the prefill's, this phase's
    counters: dict[str, float] = field(default_factory=dict)  # the decoder's growth


@dataclass(frozen=True)
class Workload:
    convs: Conversations
    trace: list[Request]
    trace_speedup: float
    probes: list[Request]
    decode_pool_tokens: int
    concurrency: int


@contextlib.contextmanager
def serve(
    mode: str, w: Workload, work: Path, patience: Patience
) -> Iterator[tuple[str, Path | None, list[str]]]:
    """(URL, prefill log, decode URLs) of `mode`'s servers, started and finally stopped."""
    if mode == "monolithic":
        with monolithic_server(work / mode, patience=patience) as server:
            yield server.url, None, []
        return
    decode_args = ["--enable-metrics", "--max-total-tokens", str(w.decode_pool_tokens)]
    if mode == TWO_DECODERS:
        with direct_cluster(
            work / mode,
            prefill_extra=PREFILL_ARGS,
            decode_extra=[*decode_args, *CACHE_ON],
            decoders=2,
            with_router=True,
            patience=patience,
            decode_policy="cache_aware",
        ) as two:
            assert two.router_url is not None
            yield two.router_url, two.prefill.process.log_path, [d.url for d in two.decoders]
        return
    with pd_cluster(
        work / mode,
        prefill_extra=PREFILL_ARGS,
        decode_extra=[*decode_args, *(CACHE_ON if mode == "pd_cache_on" else ())],
        patience=patience,
    ) as cluster:
        yield cluster.router_url, cluster.prefill.process.log_path, [cluster.decode.url]


def run_mode(
    mode: str, w: Workload, reference: dict[str, Answer] | None, work: Path, patience: Patience
) -> list[Phase]:
    """Every phase of `mode` on its own servers; `reference` None: this is the reference."""
    phases: list[Phase] = []
    with serve(mode, w, work, patience) as (url, log, decode_urls):
        client = Client(url, patience.seconds(600), reference is None, w.concurrency)
        # the first requests open connections and meet new batch shapes: not measured
        warm = warmup_requests()
        with ThreadPoolExecutor(len(warm)) as pool:
            list(pool.map(lambda r: client.one(r, extra_key="warm"), warm))

        def phase(name: str, total: int, job: Callable[[tqdm], dict[str, Answer]]) -> None:
            """`job` under a progress bar, with the prefill's timing lines it caused (one
            per answered request) and the decoder's counters' growth."""
            seen = len(timing_lines(log)) if log else 0
            before = decoder_counters(decode_urls)
            start = time.perf_counter()
            with tqdm(total=total, desc=f"{mode} {name}", unit="req", mininterval=2.0) as bar:
                answers = job(bar)
            done = Phase(mode, name, answers, time.perf_counter() - start)
            if log is not None and decode_urls:
                want = seen + sum(not a.error for a in answers.values())
                deadline = time.monotonic() + patience.seconds(30.0)
                while len(lines := timing_lines(log)) < want and time.monotonic() < deadline:
                    time.sleep(0.2)
                if len(lines) != want:
                    print(
                        f"[bench] {mode} {name}: {len(lines) - seen} timing lines for "
                        f"{want - seen} requests ({log})",
                        flush=True,
                    )
                time.sleep(1.0)  # a scheduler process's metrics reach /metrics through files
                after = decoder_counters(decode_urls)
                done.lines = lines[seen:]
                done.counters = {k: after[k] - before[k] for k in DECODE_COUNTERS}
            phases.append(done)

        def probes(key: str | None) -> Callable[[tqdm], dict[str, Answer]]:
            return lambda bar: {p.key: client.one(p, bar, key) for p in w.probes}  # one by one

        turns = sum(map(len, w.convs.messages))
        if mode == "pd_cache_on":
            phase("probes_fresh", len(w.probes), probes("probe-fresh"))
        phase("conversations", turns, lambda bar: client.converse(w.convs, reference, bar))
        if mode == TWO_DECODERS:  # the router's hit rate: the conversations alone
            return phases
        phase("trace", len(w.trace), lambda bar: client.replay(w.trace, w.trace_speedup, bar))
        if mode == "monolithic":
            phase("probes", len(w.probes), probes(None))
        if mode == "pd_cache_on":
            # what the decoder allocated so far: KV received and tokens generated
            allocated = sum(int(x["tokens"]) - int(x["held"]) for p in phases for x in p.lines)
            allocated += sum(len(a.output_ids) for p in phases for a in p.answers.values())
            left = CHURN_POOLS * w.decode_pool_tokens - allocated
            rounds = max(1, math.ceil(left / w.convs.unique_tokens()))
            print(
                f"[bench] churning the decoder's pool: the conversations {rounds} more "
                f"times, each under a new cache namespace",
                flush=True,
            )
            phase(
                "churn",
                rounds * turns,
                lambda bar: {
                    f"{r}:{k}": a
                    for r in range(rounds)
                    for k, a in client.converse(w.convs, reference, bar, f"churn{r}").items()
                },
            )
            phase("probes_fragmented", len(w.probes), probes("probe-fragmented"))
    return phases


def decoder_counters(urls: Sequence[str]) -> dict[str, float]:
    """DECODE_COUNTERS summed over the decoders at `urls` (each over its ranks)."""
    sums = [metric_sums(url, DECODE_COUNTERS) for url in urls]
    return {k: sum(s[k] for s in sums) for k in DECODE_COUNTERS}


# -- figures --------------------------------------------------------------------------------


def writes_by_prompt(phase: Phase) -> dict[int, int]:
    """Prompt tokens -> writes of the request, from the prefill's timing lines."""
    return {int(x["tokens"]) + 1: int(x["writes"]) for x in phase.lines}


def kv_bytes_per_token(phases: Sequence[Phase], config_bytes: int) -> tuple[float, float, str]:
    """(KV bytes per token, metadata bytes per request, source): the least-squares line
    through (tokens, bytes) of requests with nothing held, or the model config's."""
    pts = {(int(x["tokens"]), int(x["bytes"])) for p in phases for x in p.lines if not x["held"]}
    if len({t for t, _ in pts}) < 2:
        return float(config_bytes), 0.0, "model config"
    tokens, nbytes = np.array(sorted(pts), dtype=float).T
    slope, intercept = np.polyfit(tokens, nbytes, 1)
    return float(slope), float(intercept), f"fit over {len(pts)} requests with nothing held"


def percentile(values: Sequence[float], q: float) -> float:
    values = [v for v in values if not math.isnan(v)]
    return float(np.percentile(values, q)) if values else math.nan


def summarize(phase: Phase, bpt: float, reference: dict[str, Answer]) -> dict[str, Any]:
    answers = list(phase.answers.values())
    row: dict[str, Any] = {
        "requests": len(answers),
        "ttft_p50_ms": percentile([a.ttft_s * 1e3 for a in answers], 50),
        "ttft_p99_ms": percentile([a.ttft_s * 1e3 for a in answers], 99),
        "requests_per_s": len(answers) / phase.wall_s,
        "wall_s": phase.wall_s,
        "empty_first_chunks": sum(not math.isnan(a.empty_lead_s) for a in answers),
        "empty_first_chunk_lead_p50_ms": percentile([a.empty_lead_s * 1e3 for a in answers], 50),
    }
    if errors := [f"{k}: {a.error}" for k, a in phase.answers.items() if a.error]:
        row["errors"] = errors
    if phase.mode != "monolithic":
        verdicts = Counter(judge(reference[k.split(":")[-1]], a) for k, a in phase.answers.items())
        row["verdicts"] = dict(verdicts)
    if lines := phase.lines:
        moved = sum(int(x["bytes"]) for x in lines)
        tokens, held = (sum(int(x[k]) for x in lines) for k in ("tokens", "held"))
        row |= {
            "kv_bytes_moved": moved,
            "kv_bytes_moved_per_request": moved / len(lines),
            "unheld_kv_bytes_per_request": (tokens - held) * bpt / len(lines),
            "moved_over_unheld": moved / ((tokens - held) * bpt) if tokens > held else math.inf,
            "writes_per_request": statistics.mean(int(x["writes"]) for x in lines),
            "held_share_of_prefill_tokens": held / tokens,
        }
    if phase.counters:
        kept, received, not_sent = (phase.counters[k] for k in DECODE_COUNTERS)
        row["hit_rate"] = kept / (kept + received) if kept + received else 0.0
        row["decode_kv_bytes_not_sent"] = not_sent
    return row


def per_turn(phase: Phase, convs: Conversations, bpt: float) -> dict[str, list[float]]:
    """Per turn: mean KV bytes moved and not held per request, TTFT p50 (ms)."""
    turn_of = convs.turn_of()
    by_turn: dict[str, list[list[float]]] = {
        k: [[] for _ in convs.messages[0]] for k in ("kv_bytes_moved", "unheld_kv_bytes", "ttft")
    }
    for x in phase.lines:
        if (found := turn_of.get(int(x["tokens"]) + 1)) is not None:
            by_turn["kv_bytes_moved"][found[1]].append(int(x["bytes"]))
            by_turn["unheld_kv_bytes"][found[1]].append((int(x["tokens"]) - int(x["held"])) * bpt)
    for key, a in phase.answers.items():
        by_turn["ttft"][int(key.split("t")[-1])].append(a.ttft_s * 1e3)
    out = {
        k: [statistics.mean(v) if v else math.nan for v in by_turn[k]]
        for k in ("kv_bytes_moved", "unheld_kv_bytes")
    }
    return out | {"ttft_p50_ms": [percentile(v, 50) for v in by_turn["ttft"]]}


def print_summary(rows: dict[tuple[str, str], dict[str, Any]]) -> None:
    head = (
        f"{'mode':<13} {'workload':<17} {'reqs':>4} {'TTFT p50':>8} {'p99':>7} {'req/s':>6} "
        f"{'KiB moved':>9} {'KiB unheld':>10} {'moved/unh':>9} {'writes':>7} {'hit':>5} "
        f"{'ok/tie/wrong/err':>17}"
    )
    print(head + "\n" + "-" * len(head))
    for (mode, name), row in rows.items():
        r = defaultdict(lambda: math.nan, row)
        v = row.get("verdicts", {})
        tally = "/".join(str(v.get(k, 0)) for k in ("ok", "near_tie", "wrong_tokens", "error"))
        print(
            f"{mode:<13} {name:<17} {r['requests']:>4} {r['ttft_p50_ms']:>8.1f} "
            f"{r['ttft_p99_ms']:>7.1f} {r['requests_per_s']:>6.2f} "
            f"{r['kv_bytes_moved_per_request'] / 1024:>9.1f} "
            f"{r['unheld_kv_bytes_per_request'] / 1024:>10.1f} {r['moved_over_unheld']:>9.3f} "
            f"{r['writes_per_request']:>7.1f} {r['hit_rate']:>5.2f} {tally if v else '-':>17}"
        )


def plot_turns(turns: dict[str, dict[str, list[float]]], out: Path) -> list[Path]:
    labels = [str(t + 1) for t in range(len(turns[MODES[0]]["ttft_p50_ms"]))]
    pngs = [out / "multiturn_kv_per_turn.png", out / "multiturn_ttft_per_turn.png"]
    series = {
        "cache off: moved": ("pd_cache_off", "kv_bytes_moved"),
        "cache on: moved": ("pd_cache_on", "kv_bytes_moved"),
        "cache on: KV not held": ("pd_cache_on", "unheld_kv_bytes"),
    }
    plot_grouped_bars(
        {label: [b / 1024 for b in turns[m][k]] for label, (m, k) in series.items()},
        labels,
        pngs[0],
        ylabel="KiB per request (mean)",
        xlabel="turn",
        title="KV moved per request by turn, decoder prefix cache on vs off",
    )
    plot_grouped_bars(
        {m: turns[m]["ttft_p50_ms"] for m in MODES},
        labels,
        pngs[1],
        ylabel="TTFT p50 (ms)",
        xlabel="turn",
        title="Time to first token by turn (streamed)",
    )
    return pngs


def headline(
    rows: dict[tuple[str, str], dict[str, Any]], probes: dict[int, tuple[int, int]], bpt: float
) -> dict[str, Any]:
    """`probes`: prompt tokens -> (writes on the fresh pool, on the fragmented one)."""
    on, off = rows[("pd_cache_on", "conversations")], rows[("pd_cache_off", "conversations")]
    two = rows[(TWO_DECODERS, "conversations")]
    t_on, t_off = rows[("pd_cache_on", "trace")], rows[("pd_cache_off", "trace")]
    both = list(probes.values())  # probes answered on both pools
    fresh, fragmented = (statistics.mean(w[i] for w in both) if both else math.nan for i in (0, 1))
    verdicts: Counter[str] = Counter()
    for r in rows.values():
        verdicts.update(r.get("verdicts", {}))
    conv = {m: rows[(m, "conversations")] for m in MODES}
    return {
        "tokens_identical": verdicts["wrong_tokens"] + verdicts["error"] == 0,
        "kv_bytes_moved_over_unheld": round(on["moved_over_unheld"], 4),
        "kv_bytes_saved_share": round(1 - on["kv_bytes_moved"] / off["kv_bytes_moved"], 4),
        "ttft_p50_off_over_on": round(off["ttft_p50_ms"] / on["ttft_p50_ms"], 3),
        "writes_fragmented_over_fresh": round(fragmented / fresh, 2),
        "hit_rate": round(on["hit_rate"], 4),
        "router_hit_rate_two_decoders": round(two["hit_rate"], 4),
        "router_hit_rate_over_one_decoder": round(two["hit_rate"] / on["hit_rate"], 3),
        "trace_kv_bytes_saved_share": round(
            1 - t_on["kv_bytes_moved"] / t_off["kv_bytes_moved"], 4
        ),
        "trace_hit_rate": round(t_on["hit_rate"], 4),
        **{f"ttft_p50_ms_{m}": round(r["ttft_p50_ms"], 1) for m, r in conv.items()},
        **{f"ttft_p99_ms_{m}": round(r["ttft_p99_ms"], 1) for m, r in conv.items()},
        **{f"requests_per_s_{m}": round(r["requests_per_s"], 2) for m, r in conv.items()},
        "writes_per_request_on": round(on["writes_per_request"], 1),
        "writes_per_request_off": round(off["writes_per_request"], 1),
        "writes_fresh": round(fresh, 1),
        "writes_fragmented": round(fragmented, 1),
        "requests_compared": verdicts.total(),
        "near_ties": verdicts["near_tie"],
        "wrong_tokens": verdicts["wrong_tokens"],
        "errors": verdicts["error"],
        "kv_bytes_per_token": round(bpt, 1),
    }


DEFAULTS = {  # quick, full
    "conversations": (6, 24),
    "turns": (4, 6),
    "system_tokens": (96, 512),
    "message_tokens": ((16, 48), (32, 256)),
    "output_tokens": (12, 48),
    "concurrency": (2, 4),
    "trace_limit": (8, 100),  # also the synthetic trace's length
    "probe_tokens": ((160, 320), (512, 1024, 2048)),
    "decode_pool_tokens": (4096, 16384),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add = parser.add_argument
    add("--quick", action="store_true", help="a few short conversations, a tiny trace")
    add("--out", type=Path, default=Path("benchmarks/out"))
    add("--conversations", type=int)
    add("--turns", type=int)
    add("--system-tokens", type=int)
    add("--message-tokens", type=int, nargs=2, metavar=("MIN", "MAX"))
    add("--output-tokens", type=int)
    add("--concurrency", type=int, help="conversations in flight")
    add("--trace", type=Path, help="a JSONL trace in Mooncake's format (default: synthetic)")
    add("--trace-scale", type=float, default=1 / 16, help="trace lengths and block size x this")
    add("--trace-limit", type=int, help="requests of the trace replayed")
    add("--trace-speedup", type=float, default=1.0, help="trace arrivals this many times sooner")
    add("--probe-tokens", type=int, nargs="+", help="fragmentation probes' prompt lengths")
    add("--decode-pool-tokens", type=int, help="both PD decoders' KV pool, tokens")
    add("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    for name, (quick, full) in DEFAULTS.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def workload(args: argparse.Namespace) -> Workload:
    try:
        convs = build_conversations(
            args.conversations,
            args.turns,
            args.system_tokens,
            args.message_tokens,
            args.output_tokens,
            args.seed,
        )
        if args.trace is None:
            args.trace = synthetic_trace(
                args.out / "synthetic_trace.jsonl", args.trace_limit, args.seed
            )
        trace = load_trace(args.trace, args.trace_scale, args.trace_limit)
    except ConfigError as e:
        raise SystemExit(str(e)) from e
    probes = probe_requests(args.probe_tokens)
    pool = args.decode_pool_tokens
    longest = max(
        [
            *(len(r.ids) + r.max_new_tokens for r in (*trace, *probes)),
            *(n + convs.output_tokens for n in convs.turn_of()),
        ]
    )
    if longest + SGLANG_DECODE_RESERVE > pool:
        raise SystemExit(
            f"a {longest}-token request does not fit a decode pool of {pool} "
            "tokens: raise --decode-pool-tokens"
        )
    return Workload(convs, trace, args.trace_speedup, probes, pool, args.concurrency)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.perf_counter()
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_multiturn_"))
    w = workload(args)
    print(
        f"[bench] {args.conversations} conversations x {args.turns} turns ({args.concurrency} "
        f"in flight), system prompt {args.system_tokens}, messages {args.message_tokens}, "
        f"answers {args.output_tokens} tokens; trace {args.trace.name}: {len(w.trace)} "
        f"requests at scale {args.trace_scale:g}; decode pool {w.decode_pool_tokens} tokens; "
        f"logs in {work}",
        flush=True,
    )

    phases = run_mode(MODES[0], w, None, work, patience := local_patience())
    reference = {k: a for p in phases for k, a in p.answers.items()}
    if failed := [f"{k}: {a.error}" for k, a in reference.items() if a.error]:
        raise SystemExit(f"the reference failed {len(failed)} requests, first {failed[0]}")
    for mode in (*MODES[1:], TWO_DECODERS):
        phases += run_mode(mode, w, reference, work, patience)

    config = json.loads((TINY_LLAMA_PATH / "config.json").read_text())
    # K and V of every layer, 16-bit (SGLang's dtype "auto" serves a float32 model in fp16)
    layers, heads, dim = (
        config[k] for k in ("num_hidden_layers", "num_key_value_heads", "head_dim")
    )
    config_bpt = 2 * layers * heads * dim * 2  # bytes
    bpt, metadata, bpt_source = kv_bytes_per_token(phases, config_bpt)
    rows = {(p.mode, p.name): summarize(p, bpt, reference) for p in phases}
    print(
        f"\nKV bytes per token {bpt:.1f} ({bpt_source}; model config {config_bpt}); metadata "
        f"{metadata:.0f} B per request. TTFT (ms): streamed, the first chunk with a token. "
        "KiB per request: the prefill's timing lines; unheld: prompt tokens the decoder did "
        "not hold x KV bytes per token; hit: the decoder's held / (held + received) tokens"
    )
    print_summary(rows)
    for (mode, name), row in rows.items():
        if row.get("errors"):
            print(f"[bench] {mode} {name}: {len(row['errors'])} failed, first {row['errors'][0]}")
    by = {(p.mode, p.name): p for p in phases}
    fresh, frag = (by[("pd_cache_on", f"probes_{k}")] for k in ("fresh", "fragmented"))
    writes = (writes_by_prompt(fresh), writes_by_prompt(frag))
    print(f"\n{'probe tokens':>12} {'writes fresh pool':>17} {'writes fragmented pool':>22}")
    for n in (len(p.ids) for p in w.probes):
        a, b = (str(ws.get(n, "failed")) for ws in writes)
        print(f"{n:>12} {a:>17} {b:>22}")
    probes = {n: (writes[0][n], writes[1][n]) for n in writes[0].keys() & writes[1].keys()}
    turns = {m: per_turn(by[(m, "conversations")], w.convs, bpt) for m in MODES}
    pngs = plot_turns(turns, args.out)

    figures = headline(rows, probes, bpt)
    requests_out = {
        f"{p.mode}/{p.name}": {
            k: [a.prompt_tokens, round(a.ttft_s * 1e3, 2), judge(reference[k.split(":")[-1]], a)]
            for k, a in p.answers.items()
        }
        for p in phases
    }
    details = args.out / "multiturn.json"
    details.write_text(
        json.dumps(
            {
                "args": vars(args),
                "kv_bytes_per_token": {
                    "value": bpt,
                    "metadata_bytes": metadata,
                    "source": bpt_source,
                    "model_config": config_bpt,
                },
                "summary": {f"{m}/{n}": r for (m, n), r in rows.items()},
                "per_turn": turns,
                "probes": {"fresh": fresh.lines, "fragmented": frag.lines},
                "requests (prompt tokens, TTFT ms, verdict)": requests_out,
                "headline": figures,
            },
            indent=1,
            default=str,
        )
    )
    print(f"\nplots: {', '.join(map(str, pngs))}\ndetails: {details}")
    print(f"[bench] took {time.perf_counter() - started:.0f} s")
    print(json.dumps(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
