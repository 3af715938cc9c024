"""Local prefill on the decoder: follow-up turns prefilled where their conversation is
held, long fresh prompts on the prefill server, over running decode streams - placement
on vs off vs a monolithic server, side by side in one run.

Servers (bundled tiny Llama, each on its own cores where there are enough), one set at
a time:

- mono: one monolithic SGLang server (radix cache on): the reference tokens;
- on: direct mode, one prefill + one decode server, the decoder's prefix cache on and
  `--pd-local-prefill-max-tokens` (a follow-up's new tokens fit it);
- off: the same with `--pd-local-prefill-max-tokens 0`: every prompt goes to the prefill
  server (which transfers only what the decoder lacks).

Each set is warmed up first (`warm_up`): short fresh prompts of a few lengths and a
conversation while two streams run, and for `on` until its decoder's step model is
fitted - its first local steps, planned before any was measured, are measurements.
Then two streams run alone for a few seconds: the set's idle decode pace. Server sets of
the same settings have been seen to decode 1.28x apart on this kind of machine, which
would read as a ratio between modes; so `on` and `off` each start `--rounds` sets (2 in
the full run), alternating which goes first, and their figures pool the rounds, each
round's ratios and each set's idle pace (and the CPU time the host took, where
/proc/stat tells, and each server process's CPU seconds over the sweep) printed beside
them. `--paired` removes that spread instead: one server set a round, local prefill on,
switched off and on again between conversations as the decoder serves (SGLang's
`/set_internal_state`), so both modes meet the same machine at the same moments
(`run_paired`).

Workload, the same for each, once per running stream count of the sweep (`--streams`,
2 and 20 with --quick; 2, 20, 64 and 300 in the full run): that many decode streams run
throughout (a 100-token prompt, `--stream-tokens` output tokens, restarted when done;
each decoding before the first conversation starts);
meanwhile `--conversations` conversations run one after another, each a fresh prompt of
`--fresh-tokens` tokens then `--follow-ups` turns adding the answer and a message of
`--message-tokens` tokens. Every request is streamed /generate, greedy, EOS ignored
(`sgl_pd.cluster.streaming.send`).

Reports per stream count and mode: TTFT p50/p99 of fresh prompts and of follow-ups, the
running streams' inter-token gaps p50/p99, the follow-ups placed for local prefill (the
decoder's `sgl_pd_local_prefills_total`) and those sent to the prefill server after all
(`sgl_pd_local_prefills_sent_out_total`), and whether every request got monolithic's
tokens (a first divergence where monolithic's top two logprobs were within 0.05 nat is a
near tie, as `sgl_pd.cluster.streaming.TIE_NATS` counts them). PNGs and a JSON file go
under --out.

    python benchmarks/bench_placement.py [--quick] [--paired] [--rounds N] [--streams N ...]
        [--out benchmarks/out]

The last line is JSON, each ratio the worst over the sweep: tokens_identical,
followup_ttft_p50_on_over_off (target <= 1.0: never slower than always remote),
followup_ttft_p50_on_over_mono_at_<fewest>_streams (target <= 1.2),
fresh_ttft_p50_on_over_off (target <= 1.1), itl_p99_on_over_off (target <= 1.2),
local_prefills_on, sent_out_on, followup_ttft_p50_on_over_off_by_round, each set's
idle pace (idle_itl_ms), and the stream counts of the worst cases.
SGLPD_LOCAL_PATIENCE=3 makes every wait three times longer on a loaded machine.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sgl_pd.cluster.client import set_local_prefill_limit, stream_generate
from sgl_pd.cluster.load import plot_grouped_bars
from sgl_pd.cluster.local import direct_cluster, local_patience, monolithic_server
from sgl_pd.cluster.multiturn import Request
from sgl_pd.cluster.prompts import long_prompt_ids
from sgl_pd.cluster.streaming import Answer, judge, metric_by_label, metric_sums, send
from sgl_pd.core.local_budget import MIN_SAMPLES

MODES = ("mono", "on", "off")
COMMON = ["--chunked-prefill-size", "512", "--log-level", "warning"]
LOCAL_MAX_TOKENS = 128
OUTPUT_TOKENS = 8  # per conversation turn


@dataclass
class ModeResult:
    answers: dict[str, Answer] = field(default_factory=dict)
    gaps_s: list[float] = field(default_factory=list)  # running streams' inter-token gaps
    local_prefills: float = 0.0
    sent_out: float = 0.0  # of the local prefills, sent to the prefill server after all
    sent_out_why: Counter[str] = field(default_factory=Counter)  # the same, by reason
    mixed_steps: float = 0.0  # local steps that decoded the running streams in their forward
    unmixed_steps: float = 0.0  # local steps that ran the local tokens alone

    def add(self, other: ModeResult, round_: int) -> None:
        """`other`, one round's result of the same mode and stream count, pooled in (its
        answers keyed by round: the same conversations run in each)."""
        self.answers.update({f"r{round_}/{k}": a for k, a in other.answers.items()})
        self.gaps_s.extend(other.gaps_s)
        self.local_prefills += other.local_prefills
        self.sent_out += other.sent_out
        self.sent_out_why.update(other.sent_out_why)
        self.mixed_steps += other.mixed_steps
        self.unmixed_steps += other.unmixed_steps

    def count_local(self, before: dict[str, float], after: dict[str, float]) -> None:
        """Adds the decoder's local prefill counters' growth (`_local_counts`)."""
        self.local_prefills += after["local"] - before["local"]
        self.sent_out += after["sent_out"] - before["sent_out"]
        for key, count in after.items():
            if key.startswith("out:") and (n := count - before.get(key, 0.0)):
                self.sent_out_why[key.removeprefix("out:")] += n
        self.mixed_steps += after["mixed"] - before["mixed"]
        self.unmixed_steps += after["unmixed"] - before["unmixed"]

    def ttft_ms(self, kind: str, q: float) -> float:
        values = [a.ttft_s for k, a in self.answers.items() if k.endswith(kind)]
        return float(np.percentile(values, q)) * 1000 if values else float("nan")

    def gap_ms(self, q: float) -> float:
        return float(np.percentile(self.gaps_s, q)) * 1000 if self.gaps_s else float("nan")


class Streams:
    """Decode streams kept running in the background; their token arrival gaps."""

    def __init__(self, url: str, count: int, tokens: int) -> None:
        # (when it ended, time.perf_counter(); the gap, seconds): one append each, as
        # the streams' threads add theirs
        self.timed_gaps: list[tuple[float, float]] = []
        self._stop = threading.Event()
        self._decoding = threading.Semaphore(0)  # released by each stream's first token
        self._failed: list[BaseException] = []
        self._threads = [
            threading.Thread(target=self._run, args=(url, i, tokens), daemon=True)
            for i in range(count)
        ]

    def _run(self, url: str, i: int, tokens: int) -> None:
        try:
            prompt = long_prompt_ids(100, start=500_000 + 1000 * i)
            first = True
            while not self._stop.is_set():
                last = None
                for at, _ in stream_generate(url, prompt, tokens, ignore_eos=True):
                    if last is not None and not self._stop.is_set():
                        self.timed_gaps.append((at, at - last))
                    elif first:
                        self._decoding.release()
                        first = False
                    last = at
        except BaseException as e:
            self._failed.append(e)
            self._decoding.release()  # (`running` stops waiting and says why)
            raise

    @contextlib.contextmanager
    def running(self, timeout_s: float) -> Iterator[None]:
        """The streams decoding - every one has had its first token (at 300 streams the
        prefill server takes many seconds over their prompts: a conversation started
        before would measure that queue) - while the body runs."""
        for t in self._threads:
            t.start()
        try:
            deadline = time.monotonic() + timeout_s
            for _ in self._threads:
                left = deadline - time.monotonic()
                if not self._decoding.acquire(timeout=max(0.0, left)):
                    raise RuntimeError(f"the streams were not all decoding in {timeout_s:.0f} s")
                if self._failed:
                    raise RuntimeError(f"a stream failed: {self._failed[0]!r}")
            yield
        finally:
            self._stop.set()
            for t in self._threads:
                t.join(timeout=600)

    @property
    def gaps_s(self) -> list[float]:
        return [gap for _, gap in self.timed_gaps]

    def gaps_within(self, windows: list[tuple[float, float]]) -> list[float]:
        """The gaps that ended inside any of `windows` ((start, end), perf_counter)."""
        return [
            gap
            for end, gap in list(self.timed_gaps)
            if any(start <= end < stop for start, stop in windows)
        ]


def conversation_turns(
    url: str,
    conversations: range,
    follow_ups: int,
    fresh: int,
    message: int,
    timeout_s: float,
    seed: int,
    *,
    logprobs: bool = False,
) -> dict[str, Answer]:
    """Runs the conversations (their indices) one after another;
    answers keyed "c<i>t<turn>/fresh" or "/follow_up". The follow-up prompts are built
    from this server's answers; `seed` makes each sweep point's conversations its own
    (nothing cached from another).
    `logprobs`: the top two per token (the reference's margins, for near ties); SGLang
    does not mix a logprob request's prefill into running decode, so PD asks for none."""
    answers: dict[str, Answer] = {}
    for c in conversations:
        prompt = tuple(long_prompt_ids(fresh, start=10_000 + 20_000 * c + 997 * seed))
        for turn in range(follow_ups + 1):
            kind = "fresh" if turn == 0 else "follow_up"
            request = Request(f"c{c}t{turn}/{kind}", prompt, OUTPUT_TOKENS)
            answer = send(url, request, timeout_s, logprobs=logprobs, extra_key=None)
            answers[request.key] = answer
            new = long_prompt_ids(message, start=200_000 + 20_000 * c + 500 * turn)
            prompt = (*prompt, *answer.output_ids, *new)
    return answers


@dataclass
class Phase:
    """One server set's run: its results per stream count, how fast it decoded before
    any conversation ran, and the CPU time the machine's host took from it."""

    results: dict[int, ModeResult]
    idle_itl_ms: float  # 2 streams' ITL p50 after warm-up, nothing else running
    steal_pct: float  # of the CPU time while it ran, start-up included (/proc/stat)
    # CPU seconds each server process used over the sweep (after warm-up), by role and
    # process name: where a set that runs slow spends its time
    cpu_s: dict[str, float] = field(default_factory=dict)
    paired: bool = False  # `run_paired`: one set ran both modes (the figures above, its)


def servers_of(mode: str, args: argparse.Namespace, work: Path) -> Any:
    """A mode's server set, to start (`with`): the monolithic server, or 1P1D direct
    mode with local prefill on or off."""
    patience = local_patience()
    # room for the most streams the sweep runs, beside the conversations
    common = [
        *COMMON, "--max-running-requests", str(max(args.streams) + 32),
        # a pool for them all (SGLang's decoder reserves 512 tokens for each by default)
        "--max-total-tokens", str(max(32768, 640 * (max(args.streams) + 32))),
    ]  # fmt: skip
    if mode == "mono":
        return monolithic_server(work, extra=common, patience=patience)
    local = str(LOCAL_MAX_TOKENS if mode == "on" else 0)
    step = args.local_step_tokens if mode == "on" and args.local_step_tokens else None
    slo = args.itl_slo if mode == "on" else None
    burst = args.burst_every if mode == "on" else None
    return direct_cluster(
        work,
        prefill_extra=COMMON,
        decode_extra=[
            *common, "--enable-metrics", "--disaggregation-decode-enable-radix-cache",
            "--pd-local-prefill-max-tokens", local,
            *(["--pd-local-prefill-step-tokens", str(step)] if step else []),
            *(["--pd-local-prefill-itl-slo", str(slo)] if slo is not None else []),
            *(["--pd-local-prefill-burst-every", str(burst)] if burst is not None else []),
        ],
        decoders=1,
        patience=patience,
    )  # fmt: skip


def _url_and_roles(mode: str, started: Any) -> tuple[str, dict[str, int | None]]:
    """Where requests go, and the processes whose CPU time is read."""
    if mode == "mono":
        return started.url, {"server": _pid(started)}
    decoder = started.decoders[0]
    return decoder.url, {"decode": _pid(decoder), "prefill": _pid(started.prefill)}


def _warmed_up(mode: str, url: str, args: argparse.Namespace, timeout_s: float) -> float:
    """`warm_up`, then the set's idle decode pace (ms), printed."""
    warm_up(url, mode, args, timeout_s)
    idle_itl_ms = idle_pace_ms(url, timeout_s)
    print(f"[bench] {mode}: 2 streams alone step {idle_itl_ms:.1f} ms apart", flush=True)
    return idle_itl_ms


def run_mode(mode: str, args: argparse.Namespace, work: Path) -> Phase:
    """One mode's servers, every stream count of the sweep in turn (the monolithic
    reference runs each conversation the other modes run)."""
    timeout_s = local_patience().seconds(600)
    conversations = args.conversations * (2 if args.paired and mode == "mono" else 1)
    results: dict[int, ModeResult] = {}
    steal_before = cpu_steal()
    with servers_of(mode, args, work) as started:
        url, roles = _url_and_roles(mode, started)
        idle_itl_ms = _warmed_up(mode, url, args, timeout_s)
        cpu_before = cpu_seconds(roles)
        for count in args.streams:
            print(f"[bench] {mode}: {count} running streams ...", flush=True)
            result = ModeResult()
            before = _local_counts(url) if mode != "mono" else {}
            streams = Streams(url, count, args.stream_tokens)
            with streams.running(timeout_s):
                result.answers = conversation_turns(
                    url, range(conversations), args.follow_ups, args.fresh_tokens,
                    args.message_tokens, timeout_s, count, logprobs=mode == "mono",
                )  # fmt: skip
            result.gaps_s = streams.gaps_s
            if mode != "mono":
                result.count_local(before, _local_counts(url))
            results[count] = result
        cpu_after = cpu_seconds(roles)
    cpu_s = cpu_used(cpu_before, cpu_after)
    return Phase(results, idle_itl_ms, steal_share(steal_before, cpu_steal()), cpu_s)


def paired_modes(conversations: int, round_: int) -> list[str]:
    """Paired design: the mode of each conversation in turn, on and off alternating as
    ABBA (on, off, off, on, on, ...: a drift over the run weighs on both alike), the
    other way round in odd rounds; each mode gets `conversations`."""
    first, second = ("on", "off") if round_ % 2 == 0 else ("off", "on")
    return [first if ((j + 1) // 2) % 2 == 0 else second for j in range(2 * conversations)]


def run_paired(args: argparse.Namespace, work: Path, round_: int) -> dict[str, Phase]:
    """One server set with local prefill on, switched off and on again between
    conversations (`/set_internal_state`, `sgl_pd/backend/decode/local_switch.py`):
    both modes meet the same machine at the same time, so a set that runs slow as a
    whole weighs on both alike. Each conversation is its own (the monolithic reference
    runs them all); the streams' gaps count for the mode of the conversation running
    when each gap ended. The set's pace, steal and CPU time are both modes' (reported
    once, under `on`).

    What `off` is here: local prefill switched off, its machinery still running (step
    timing, the offers the HTTP process reads - the set-per-mode design measures that
    cost: the decode schedulers' CPU seconds alike within the spread), and the remote
    rates both modes teach the decoder shared, as on a decoder switched at run time. A
    stream's restart may be placed here just before a switch and prefilled just after
    it, in the other mode's window: conversations do not wait for it."""
    timeout_s = local_patience().seconds(600)
    modes = paired_modes(args.conversations, round_)
    results: dict[str, dict[int, ModeResult]] = {"on": {}, "off": {}}
    steal_before = cpu_steal()
    with servers_of("on", args, work) as started:
        url, roles = _url_and_roles("on", started)
        idle_itl_ms = _warmed_up("on", url, args, timeout_s)
        cpu_before = cpu_seconds(roles)
        for count in args.streams:
            print(f"[bench] paired: {count} running streams ...", flush=True)
            for mode in results:
                results[mode][count] = ModeResult()
            windows: dict[str, list[tuple[float, float]]] = {"on": [], "off": []}
            streams = Streams(url, count, args.stream_tokens)
            with streams.running(timeout_s):
                for c, mode in enumerate(modes):
                    switch_local_prefill(url, LOCAL_MAX_TOKENS if mode == "on" else 0)
                    result = results[mode][count]
                    before, start = _local_counts(url), time.perf_counter()
                    result.answers |= conversation_turns(
                        url, range(c, c + 1), args.follow_ups, args.fresh_tokens,
                        args.message_tokens, timeout_s, count,
                    )  # fmt: skip
                    windows[mode].append((start, time.perf_counter()))
                    result.count_local(before, _local_counts(url))
            switch_local_prefill(url, LOCAL_MAX_TOKENS)
            for mode, by_count in results.items():
                by_count[count].gaps_s = streams.gaps_within(windows[mode])
        cpu_after = cpu_seconds(roles)
    cpu_s = cpu_used(cpu_before, cpu_after)
    steal = steal_share(steal_before, cpu_steal())
    return {mode: Phase(results[mode], idle_itl_ms, steal, cpu_s, paired=True) for mode in results}


def switch_local_prefill(url: str, tokens: int) -> None:
    """The decoder's local prefill limit from now on (0: off), on every rank."""
    took = set_local_prefill_limit(url, tokens)
    if not all(took):
        raise RuntimeError(f"the decoder refused local prefill limit {tokens}: {took}")


def _pid(server: Any) -> int | None:
    popen = server.process.process
    return None if popen is None else popen.pid


def cpu_seconds(roles: dict[str, int | None]) -> dict[str, float]:
    """CPU seconds (user and system) each process of each role's process tree used so
    far, keyed "role/name" (SGLang names its scheduler and detokenizer processes; a
    name shared by several processes sums them)."""
    import psutil

    from sgl_pd.cluster.soak import process_tree

    used: dict[str, float] = {}
    for role, pid in roles.items():
        if pid is None:
            continue
        try:
            tree = process_tree(pid)
        except psutil.NoSuchProcess:
            continue
        for process in tree:
            try:
                with process.oneshot():
                    times = process.cpu_times()
                    key = f"{role}/{process.name()}"
            except psutil.NoSuchProcess:
                continue
            used[key] = used.get(key, 0.0) + times.user + times.system
    return used


def cpu_used(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds used between two `cpu_seconds` readings, per process key."""
    return {k: round(v - before.get(k, 0.0), 1) for k, v in after.items()}


IDLE_PACE_S = 3.0  # how long 2 streams run alone to time a server set's decode steps
IDLE_PACE_TOKENS = 512  # each stream's answer: longer than the window at >= 6 ms a step


def idle_pace_ms(url: str, timeout_s: float) -> float:
    """The ITL p50 of 2 streams with nothing else running and no prompt arriving (their
    answers outlast the window, so neither restarts in it - on `on` a restart is a local
    prefill): how fast this server set decodes. Where two sets of the same settings
    differ, the machine does, and a round's ratios carry that."""
    streams = Streams(url, 2, IDLE_PACE_TOKENS)
    with streams.running(timeout_s):
        time.sleep(IDLE_PACE_S)
    return float(np.percentile(streams.gaps_s, 50)) * 1000 if streams.gaps_s else float("nan")


def cpu_steal() -> tuple[int, int] | None:
    """(steal, total) jiffies of every CPU since boot (/proc/stat), None where unknown."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    except (OSError, ValueError):
        return None
    if len(fields) < 8:
        return None
    # (guest time, fields 9 and 10, is counted in user and nice already)
    return fields[7], sum(fields[:8])


def steal_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float:
    """Percent of the CPU time between two `cpu_steal` readings the host took."""
    if before is None or after is None or after[1] <= before[1]:
        return float("nan")
    return 100.0 * (after[0] - before[0]) / (after[1] - before[1])


# warm-up: the short fresh prompts (remote on a PD decoder) that teach it a remote
# prefill's rate a token besides its fixed cost - as a decoder serving for a while has
# seen prompts of many lengths - and the local steps its step model is fitted from
WARM_UP_PROMPTS = (48, 96, 192, 384)
WARM_UP_MIXED_STEPS = 2 * MIN_SAMPLES
WARM_UP_ROUNDS = 8  # at most, each a conversation with its follow-ups and the prompts


def warm_up(url: str, mode: str, args: argparse.Namespace, timeout_s: float) -> None:
    """Before anything is measured: kernels compiled and connections open, and the `on`
    decoder's models fitted (a decoder's first local steps, before them, are planned
    without an SLO: they are its measurements), as on a decoder that has served for a
    while. Two streams run meanwhile (mixed steps need streams); every mode gets the
    first round, `on` more until its decoder ran `WARM_UP_MIXED_STEPS` mixed local steps
    (or `WARM_UP_ROUNDS` rounds)."""
    with Streams(url, 2, args.stream_tokens).running(timeout_s):
        for round_ in range(WARM_UP_ROUNDS):
            conversation_turns(
                url, range(1), 3, args.fresh_tokens, args.message_tokens, timeout_s, 50 + round_
            )
            for i, tokens in enumerate(WARM_UP_PROMPTS):
                start = 700_000 + 10_000 * (len(WARM_UP_PROMPTS) * round_ + i)
                prompt = tuple(long_prompt_ids(tokens, start=start))
                request = Request(f"warm{round_}/{tokens}", prompt, 1)
                answer = send(url, request, timeout_s, logprobs=False, extra_key=None)
                if answer.error:
                    raise RuntimeError(f"warm-up request {request.key}: {answer.error}")
            if mode != "on" or _local_counts(url)["mixed"] >= WARM_UP_MIXED_STEPS:
                break
    if mode == "on":
        print(f"[bench] on: warmed up ({_local_counts(url)['mixed']:.0f} mixed local steps)")


def _local_counts(url: str) -> dict[str, float]:
    """The decoder's local prefill counters: requests placed for local prefill (`local`),
    of them sent to the prefill server after all (`sent_out`, and by reason "out:<why>"),
    and the local steps it ran mixed into the streams' decode (`mixed`) or alone
    (`unmixed`)."""
    names = ["sgl_pd_local_prefills_total", "sgl_pd_local_prefills_sent_out_total"]
    sums = metric_sums(url, names)
    steps = metric_by_label(url, "sgl_pd_local_prefill_steps_total", "kind")
    why = metric_by_label(url, names[1], "why")
    return {
        "local": sums[names[0]],
        "sent_out": sums[names[1]],
        "mixed": steps.get("mixed", 0.0),
        "unmixed": steps.get("unmixed", 0.0),
    } | {f"out:{reason}": n for reason, n in why.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few conversations")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    parser.add_argument("--conversations", type=int, default=None)
    parser.add_argument("--follow-ups", type=int, default=None)
    parser.add_argument("--fresh-tokens", type=int, default=1024)
    parser.add_argument("--message-tokens", type=int, default=40)
    parser.add_argument(
        "--streams", type=int, nargs="+", default=None,
        help="running stream counts swept (default: 2 20 with --quick, else 2 20 64 300)",
    )  # fmt: skip
    parser.add_argument("--stream-tokens", type=int, default=64)
    parser.add_argument(
        "--local-step-tokens", type=int, default=None,
        help="--pd-local-prefill-step-tokens of the `on` decoder (default: one step a suffix)",
    )  # fmt: skip
    parser.add_argument(
        "--itl-slo", type=float, default=None,
        help="--pd-local-prefill-itl-slo of the `on` decoder (default: the server's)",
    )  # fmt: skip
    parser.add_argument(
        "--burst-every", type=int, default=None,
        help="--pd-local-prefill-burst-every of the `on` decoder (default: the server's)",
    )  # fmt: skip
    parser.add_argument(
        "--rounds", type=int, default=None,
        help="server sets started for each of on and off, alternating which goes first"
        " (default: 1 with --quick, else 2): a set that runs slow as a whole then shows as"
        " a spread between rounds rather than as a ratio",
    )  # fmt: skip
    parser.add_argument(
        "--paired", action="store_true",
        help="on and off in one server set per round, local prefill switched between"
        " conversations (`run_paired`), rather than a server set each",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.rounds is not None and args.rounds < 1:
        parser.error("--rounds must be at least 1")
    args.rounds = args.rounds or (1 if args.quick else 2)
    args.conversations = args.conversations or (3 if args.quick else 12)
    args.follow_ups = args.follow_ups or (3 if args.quick else 5)
    args.streams = args.streams or ([2, 20] if args.quick else [2, 20, 64, 300])
    args.out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="bench_placement_"))
    print(
        f"[bench] {args.conversations} conversations x ({args.fresh_tokens}-token fresh prompt"
        f" + {args.follow_ups} follow-ups of {args.message_tokens} tokens) while"
        f" {', '.join(map(str, args.streams))} streams run; local prefill limit"
        f" {LOCAL_MAX_TOKENS} ({args.local_step_tokens or LOCAL_MAX_TOKENS} a step at most);"
        f" logs in {work}",
        flush=True,
    )
    phases: dict[str, list[Phase]] = {mode: [] for mode in MODES}
    for mode in run_order(args.rounds, paired=args.paired):
        if mode == "paired":
            round_ = len(phases["on"])
            for m, phase in run_paired(args, work / f"paired{round_}", round_).items():
                phases[m].append(phase)
            continue
        phase = run_mode(mode, args, work / f"{mode}{len(phases[mode])}")
        phases[mode].append(phase)
    results = {"mono": phases["mono"][0].results} | {
        mode: pooled(phases[mode], args.streams) for mode in ("on", "off")
    }

    verdicts = {
        (mode, count): [
            judge(results["mono"][count].answers[k.split("/", 1)[1]], a)
            for k, a in results[mode][count].answers.items()
        ]
        for mode in ("on", "off")
        for count in args.streams
    }
    print(
        f"\n{'streams':>7} {'mode':<6}{'fresh p50':>11}{'fresh p99':>11}{'follow p50':>12}"
        f"{'follow p99':>12}{'ITL p50':>10}{'ITL p99':>10}{'local':>7}{'out':>5}  tokens"
    )
    for count in args.streams:
        for mode in MODES:
            r = results[mode][count]
            verdict = "reference" if mode == "mono" else _summary(verdicts[(mode, count)])
            print(
                f"{count:>7} {mode:<6}{r.ttft_ms('fresh', 50):>11.1f}"
                f"{r.ttft_ms('fresh', 99):>11.1f}{r.ttft_ms('follow_up', 50):>12.1f}"
                f"{r.ttft_ms('follow_up', 99):>12.1f}{r.gap_ms(50):>10.1f}{r.gap_ms(99):>10.1f}"
                f"{r.local_prefills:>7.0f}{r.sent_out:>5.0f}  {verdict}"
            )
    print(
        "(milliseconds; ITL: the running streams' gaps between tokens; local: follow-ups"
        " placed for local prefill, out: of them sent to the prefill server after all;"
        + (
            f" on and off alternate within each of {args.rounds} server set(s))"
            if args.paired
            else f" on and off pooled over {args.rounds} server set(s) each)"
        )
    )
    by_round = round_ratios(phases, args.streams)
    print_rounds(phases, by_round)
    png = args.out / "placement_ttft.png"
    plot_grouped_bars(
        {
            f"{mode} p50": [results[mode][c].ttft_ms("follow_up", 50) for c in args.streams]
            for mode in MODES
        },
        [f"{c} streams" for c in args.streams],
        png,
        ylabel="follow-up TTFT p50 (ms)",
        title="Local prefill on vs off vs monolithic (1P1D, direct mode)",
        xlabel="running streams",
    )
    itl_png = args.out / "placement_itl.png"
    plot_grouped_bars(
        {f"{mode} p99": [results[mode][c].gap_ms(99) for c in args.streams] for mode in MODES},
        [f"{c} streams" for c in args.streams],
        itl_png,
        ylabel="running streams' ITL p99 (ms)",
        title="Inter-token gaps of the running streams",
        xlabel="running streams",
    )
    per_count = {
        count: {
            **on_over_off(results["on"][count], results["off"][count]),
            "followup_ttft_p50_on_over_mono": _ratio(
                results["on"][count].ttft_ms("follow_up", 50),
                results["mono"][count].ttft_ms("follow_up", 50),
            ),
            "local_prefills_on": results["on"][count].local_prefills,
            "sent_out_on": results["on"][count].sent_out,
            "sent_out_why_on": results["on"][count].sent_out_why,
            "local_steps_mixed_on": results["on"][count].mixed_steps,
            "local_steps_unmixed_on": results["on"][count].unmixed_steps,
        }
        for count in args.streams
    }
    details = args.out / "placement.json"
    details.write_text(
        json.dumps(
            {
                str(count): {
                    m: {
                        "ttft_ms": {
                            k: [r[count].ttft_ms(k, q) for q in (50, 99)]
                            for k in ("fresh", "follow_up")
                        },
                        # each request's, in the order sent (a slow one is found here)
                        "ttft_each_ms": {
                            k: round(a.ttft_s * 1000, 1) for k, a in r[count].answers.items()
                        },
                        "itl_ms": [r[count].gap_ms(50), r[count].gap_ms(99)],
                        "local_prefills": r[count].local_prefills,
                        "sent_out": r[count].sent_out,
                        "verdicts": _summary(verdicts[(m, count)])
                        if (m, count) in verdicts
                        else "reference",
                    }
                    for m, r in results.items()
                }
                | {"ratios": per_count[count]}
                for count in args.streams
            },
            indent=2,
        )
    )
    print(f"plots: {png}, {itl_png}\ndetails: {details}")
    for count in args.streams:
        print(f"{count:>4} streams: {json.dumps(per_count[count])}")
    fewest = min(args.streams)

    def worst(key: str) -> float:
        return max(per_count[c][key] for c in args.streams)

    headline = {
        "design": "paired" if args.paired else "server sets",
        "tokens_identical": all(v in ("ok", "near_tie") for vs in verdicts.values() for v in vs),
        "followup_ttft_p50_on_over_off": worst("followup_ttft_p50_on_over_off"),
        f"followup_ttft_p50_on_over_mono_at_{fewest}_streams": per_count[fewest][
            "followup_ttft_p50_on_over_mono"
        ],
        "fresh_ttft_p50_on_over_off": worst("fresh_ttft_p50_on_over_off"),
        "itl_p99_on_over_off": worst("itl_p99_on_over_off"),
        "local_prefills_on": sum(per_count[c]["local_prefills_on"] for c in args.streams),
        "sent_out_on": sum(per_count[c]["sent_out_on"] for c in args.streams),
        "followup_ttft_p50_on_over_off_by_round": [
            max(r["followup_ttft_p50_on_over_off"].values()) for r in by_round
        ],
        "idle_itl_ms": {
            m: [round(p.idle_itl_ms, 2) for p in phases[m]]
            for m in MODES
            if not (args.paired and m == "off")  # (paired: the `on` sets')
        },
        "worst_streams": {
            key: max(args.streams, key=lambda c, key=key: per_count[c][key])
            for key in ("followup_ttft_p50_on_over_off", "itl_p99_on_over_off")
        },
    }
    print(json.dumps(headline))
    return 0


def run_order(rounds: int, *, paired: bool = False) -> list[str]:
    """The server sets in the order they run: the monolithic reference once, then `on`
    and `off` per round, alternating which goes first (a machine slowing down over the
    run slows each mode alike) - or, `paired`, one set a round that runs both."""
    order = ["mono"]
    if paired:
        return order + ["paired"] * rounds
    for r in range(rounds):
        order += ["on", "off"] if r % 2 == 0 else ["off", "on"]
    return order


def pooled(mode_phases: list[Phase], counts: list[int]) -> dict[int, ModeResult]:
    """A mode's results per stream count over every round, its answers keyed
    "r<round>/<key>"."""
    results = {count: ModeResult() for count in counts}
    for i, phase in enumerate(mode_phases):
        for count in counts:
            results[count].add(phase.results[count], i)
    return results


# on over off: follow-up and fresh TTFT p50, and the streams' ITL p50 (how fast each
# set decoded with the same load) and p99
ON_OVER_OFF = (
    ("followup_ttft_p50_on_over_off", lambda r: r.ttft_ms("follow_up", 50)),
    ("fresh_ttft_p50_on_over_off", lambda r: r.ttft_ms("fresh", 50)),
    ("itl_p99_on_over_off", lambda r: r.gap_ms(99)),
    ("itl_p50_on_over_off", lambda r: r.gap_ms(50)),
)


def on_over_off(on: ModeResult, off: ModeResult) -> dict[str, float]:
    """`ON_OVER_OFF`'s ratios of one stream count."""
    return {name: _ratio(measure(on), measure(off)) for name, measure in ON_OVER_OFF}


def round_ratios(phases: dict[str, list[Phase]], counts: list[int]) -> list[dict]:
    """Per round, `ON_OVER_OFF`'s ratios by name, then by stream count."""
    ratios = []
    for on, off in zip(phases["on"], phases["off"], strict=True):
        by_count = {c: on_over_off(on.results[c], off.results[c]) for c in counts}
        ratios.append({name: {c: by_count[c][name] for c in counts} for name, _ in ON_OVER_OFF})
    return ratios


def print_rounds(phases: dict[str, list[Phase]], by_round: list[dict]) -> None:
    """Each server set's idle decode pace and host steal, and each round's on/off
    ratios: the spread the pooled figures above average over."""
    shown = [m for m in MODES if not (m == "off" and all(p.paired for p in phases[m]))]
    for mode in shown:
        sets = ", ".join(f"{p.idle_itl_ms:.1f} ms (steal {p.steal_pct:.1f}%)" for p in phases[mode])
        paired = (
            " (paired: on and off ran in these sets)" if mode == "on" and "off" not in shown else ""
        )
        print(f"{mode:>4} server sets, 2 streams alone step apart: {sets}{paired}")
    for mode in shown:
        for i, p in enumerate(phases[mode]):
            busiest = sorted(p.cpu_s.items(), key=lambda kv: -kv[1])[:6]
            cells = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in busiest)
            print(f"{mode:>4} set {i} CPU over the sweep: {cells or 'unknown'}")
    for i, ratios in enumerate(by_round):
        cells = "; ".join(
            f"{name.removesuffix('_on_over_off')} "
            + " ".join(f"{c}:{v:.2f}x" for c, v in values.items())
            for name, values in ratios.items()
        )
        print(f"round {i} on/off by streams: {cells}")


def _ratio(a: float, b: float) -> float:
    return round(a / b, 3) if b else float("nan")


def _summary(verdicts: list[str]) -> str:
    counts = {v: verdicts.count(v) for v in sorted(set(verdicts))}
    return ", ".join(f"{n} {v}" for v, n in counts.items())


if __name__ == "__main__":
    sys.exit(main())
