"""Fault campaign: requests through a real PD pair while faults are injected on purpose.

Starts a monolithic server (for the expected greedy tokens) and a prefill + decode +
router cluster whose prefiller slows every KV write batch and fails a few, then:

1. runs the campaign: N requests at concurrency 16, 10% of them aborted at the decoder
   after a random delay (SGLang's /abort_request, what a client disconnect triggers),
   while the prefill and the decode server are stopped in turn (SIGSTOP, then SIGCONT)
   for 12 s - past ZMQ's own 10 s heartbeat, under the 20 s hang timeout: a live but
   stopped server must fail nothing - and 5% of control frames are dropped both ways
   (each control message whose loss matters is sent until acknowledged); every
   request's KV is verified by checksum (--pd-kv-checksum) before it is decoded;
2. restarts the idle prefiller and sends one request at once: it must reach the new
   ranks (a decoder's table of the old ones is never used for it);
3. kills the prefiller with SIGKILL while a long prompt's layers stream, measures how
   long the client waits for its error, restarts it, and checks a request succeeds;
4. does the same to the decoder (the prefiller must stop writing and free its pages);
5. reads both servers' idle-pool lines: every page must be back.

    python benchmarks/bench_faults.py [--quick] [--requests N] [--corruption-rate P]

With --corruption-rate, that share of KV write batches has bytes overwritten after it
landed: each such request must fail its checksum (never decode), and nothing else.

Prints a table (client answer after each kind of fault, aborts split by whether a server
was stopped when they were sent) and ends with one JSON line: faults_injected,
requests_lost, wrong_tokens, pages_leaked, fault_to_error_p99_s, false_failures
(requests that failed though no fault but a pause or a dropped frame hit them: target 0),
control_frames_dropped, checksum_mismatches (0 without corruption; with it, the requests
corrupted). SGLPD_LOCAL_PATIENCE scales every start-up wait.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
from tqdm import tqdm

from sgl_pd.cluster.campaign import (
    Outcome,
    expected_tokens,
    first_success,
    kill_mid_transfer,
    periodic_pauses,
    run_campaign,
)
from sgl_pd.cluster.client import generate_ids
from sgl_pd.cluster.local import PdCluster, Server, local_patience, monolithic_server, pd_cluster
from sgl_pd.cluster.logs import decode_failures, last_pool_state
from sgl_pd.cluster.prompts import long_prompt_ids, prompt_ids, varied_prompts

WRITE_DELAY_MS = 20
FAILURE_RATE = 0.004
LONG_PROMPT_TOKENS = 1024
PAUSE_S = 12.0  # each SIGSTOP, past ZMQ's 10 s heartbeat; the hang timeout stays at 20 s
CONTROL_DROP_RATE = 0.05
SERVER_ARGS = [
    "--chunked-prefill-size", "128", "--log-level", "info", "--enable-metrics",
    "--pd-kv-checksum", "--pd-inject-control-drop-rate", str(CONTROL_DROP_RATE),
]  # fmt: skip
MISMATCH = "KV checksum mismatch"
ROUTER_HEALTH_WAIT_S = 30.0  # the router's health check sees a restarted server within it


def kill_round(cluster: PdCluster, mono: Server, victim: str, n: int) -> dict[str, object]:
    """SIGKILL `victim` ("prefill" or "decode") mid-transfer, restart it; seconds from the
    kill to the client's answer, and whether a request succeeds afterwards."""
    server = cluster.prefill if victim == "prefill" else cluster.decode
    ids = long_prompt_ids(LONG_PROMPT_TOKENS, start=1 + 1000 * n)
    killed = kill_mid_transfer(cluster.router_url, server.process, ids, f"kill-{victim}-{n}")
    server.process.restart(f"restart{n}")
    server.process.wait_http_ready(f"{server.url}/health", local_patience().server_ready_s)
    expected = generate_ids(mono.url, "Count: 11 12 13", 6)
    recovered = first_success(cluster.router_url, "Count: 11 12 13", 6, budget_s=180) == expected
    return {"victim": victim, "to_error_s": killed.kill_to_answer_s, "recovered": recovered}


def idle_prefill_restart(cluster: PdCluster, mono: Server, n: int) -> dict[str, object]:
    """Restart the prefiller while nothing is in flight, then send one request at once:
    it must be served (by the new ranks) on its first try."""
    time.sleep(2.0)  # idle: no liveness check has reason to look at the prefiller
    cluster.prefill.process.stop()
    cluster.prefill.process.restart(f"idle{n}")
    cluster.prefill.process.wait_http_ready(
        f"{cluster.prefill.url}/health", local_patience().server_ready_s
    )
    prompt = f"Count: {20 + n} {21 + n} {22 + n}"
    expected = generate_ids(mono.url, prompt, 6)
    started = time.monotonic()
    served = False
    while time.monotonic() - started < ROUTER_HEALTH_WAIT_S:
        try:
            served = generate_ids(cluster.router_url, prompt, 6) == expected
            break
        except requests.HTTPError as e:
            # the router answers 503 until its health check saw the restarted server:
            # that request never reached sgl_pd; anything else is the first one's fate
            if e.response is None or e.response.status_code != 503:
                print(f"   idle restart {n}: first request failed: {e}")
                break
            time.sleep(0.5)
    return {"served": served, "answer_s": time.monotonic() - started}


def control_counts(cluster: PdCluster) -> dict[str, float]:
    """Both servers' control-message counters, by event (since their last start)."""
    counts: dict[str, float] = {}
    for server, role in ((cluster.prefill, "prefill"), (cluster.decode, "decode")):
        text = requests.get(f"{server.url}/metrics", timeout=30).text
        pattern = rf'^sgl_pd_control_messages_total\{{([^}}]*role="{role}"[^}}]*)\}} (\S+)$'
        for labels, value in re.findall(pattern, text, re.M):
            event = re.search(r'event="(\w+)"', labels)
            if event:
                counts[event.group(1)] = counts.get(event.group(1), 0.0) + float(value)
    return counts


def log_count(server: Server, name: str, needle: str) -> int:
    logs = sorted(server.process.log_path.parent.glob(f"{name}.log*"))
    return sum(p.read_text(errors="replace").count(needle) for p in logs)


def logged_rooms(server: Server, name: str, needle: str) -> set[str]:
    """The requests (rooms) whose log lines say `needle` (a request is logged more than
    once: by sgl_pd, by its receiver, by SGLang)."""
    logs = sorted(server.process.log_path.parent.glob(f"{name}.log*"))
    pattern = re.compile(rf"request (\d+): [^\n]*{re.escape(needle)}")
    return {m.group(1) for p in logs for m in pattern.finditer(p.read_text(errors="replace"))}


def paused_at(t: float, intervals: list[tuple[str, float, float]]) -> bool:
    return any(start <= t <= end for _, start, end in intervals)


def pages_in_use(cluster: PdCluster, timeout_s: float = 90.0) -> int:
    """Tokens still held by both pools once idle (0 means no leak)."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [last_pool_state(s.process.log_path) for s in (cluster.prefill, cluster.decode)]
        used = sum(s[0] if s is not None else 1 for s in states)
        leak = any(s is not None and not s[1] for s in states)
        if (used == 0 and not leak) or time.monotonic() > deadline:
            return used + (1 if leak else 0)
        with contextlib.suppress(requests.RequestException):  # (an injected failure)
            generate_ids(cluster.router_url, "Count: 1 2", 1)  # a batch makes a fresh idle line
        time.sleep(1.0)


def injected_failures(cluster: PdCluster) -> int:
    logs = sorted(cluster.prefill.process.log_path.parent.glob("prefill.log*"))
    return sum(len(re.findall("injected failure", p.read_text(errors="replace"))) for p in logs)


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 requests, one kill per side")
    parser.add_argument("--requests", type=int, default=None, help="campaign size")
    parser.add_argument("--out", type=Path, default=None, help="unused: no files written")
    parser.add_argument(
        "--corruption-rate", type=float, default=0.0, help="of KV write batches, corrupted"
    )
    args = parser.parse_args(argv)
    count = args.requests or (100 if args.quick else 1000)
    kills = 1 if args.quick else 3
    idle_restarts = 1 if args.quick else 3
    pause_every_s = 15.0 if args.quick else 30.0
    log_dir = Path(tempfile.mkdtemp(prefix="bench_faults_"))
    print(
        f"[bench] {count} requests, 10% aborted, write delay {WRITE_DELAY_MS} ms, failure "
        f"rate {FAILURE_RATE} per batch, a {PAUSE_S:g} s SIGSTOP every {pause_every_s:g} s, "
        f"{CONTROL_DROP_RATE:g} of control frames dropped, KV checksums on (corruption rate "
        f"{args.corruption_rate:g}), {idle_restarts} idle prefill restart(s), {kills} kill(s)"
        f" per side; logs in {log_dir}"
    )
    prompts = [prompt_ids(p) for p in varied_prompts(count, seed=31)]
    pd_args = list(SERVER_ARGS)
    with monolithic_server(log_dir / "mono", extra=SERVER_ARGS) as mono, pd_cluster(
        log_dir / "pd",
        prefill_extra=[
            *pd_args,
            "--pd-inject-write-delay-ms", str(WRITE_DELAY_MS),
            "--pd-inject-write-failure-rate", str(FAILURE_RATE),
            "--pd-inject-kv-corruption-rate", str(args.corruption_rate),
        ],
        decode_extra=[*pd_args, "--max-total-tokens", "4096"],
        router_retries=False,
    ) as cluster:  # fmt: skip
        with ThreadPoolExecutor(max_workers=16) as pool:
            expected = list(
                tqdm(
                    pool.map(lambda p: expected_tokens(mono.url, p, 6), prompts),
                    total=count,
                    desc="monolithic",
                    unit="req",
                )
            )
        bar = tqdm(total=count, desc="campaign", unit="req")

        def done(_: Outcome) -> None:
            bar.update(1)

        started = time.monotonic()
        victims = [cluster.prefill.process, cluster.decode.process]
        intervals: list[tuple[str, float, float]] = []
        with periodic_pauses(
            victims, every_s=pause_every_s, pause_s=PAUSE_S, intervals=intervals
        ) as paused:
            result = run_campaign(
                cluster.router_url,
                cluster.decode.url,
                prompts,
                expected,
                max_new_tokens=6,
                abort_fraction=0.1,
                concurrency=16,
                seed=7,
                on_done=done,
            )
        bar.close()
        causes = decode_failures(sorted(cluster.decode.process.log_path.parent.glob("decode.log*")))
        false_failures = result.false_failures(causes, excused=("injected failure", MISMATCH))
        campaign_s = time.monotonic() - started
        control = control_counts(cluster)  # before any restart resets them
        mismatches = len(logged_rooms(cluster.decode, "decode", MISMATCH))
        corruptions = log_count(cluster.prefill, "prefill", "injected corruption")
        restarts = [idle_prefill_restart(cluster, mono, n) for n in range(idle_restarts)]
        rounds = []
        for n in range(kills):
            for victim in ("prefill", "decode"):
                rounds.append(kill_round(cluster, mono, victim, n))
        leaked = pages_in_use(cluster)
        failures = injected_failures(cluster)

    abort_to_end = result.fault_to_end_s()
    kill_to_error = [float(str(r["to_error_s"])) for r in rounds]
    all_to_error = abort_to_end + kill_to_error
    dropped = int(control.get("injected_drop", 0))
    faults = result.aborts_sent + failures + len(rounds) + len(paused) + len(restarts) + corruptions
    lost = (
        result.count("lost")
        + sum(not r["recovered"] for r in rounds)
        + sum(not r["served"] for r in restarts)
    )
    print(f"\ncampaign: {count} requests in {campaign_s:.0f} s")
    print(" fault kind              injected  client answer after fault p50 / p99 (s)")
    p50, p99 = _percentile(abort_to_end, 0.5), _percentile(abort_to_end, 0.99)
    print(f" abort at decoder        {result.aborts_sent:8d}  {p50:6.2f} / {p99:.2f}")
    for label, hit in (("  ... a server stopped", True), ("  ... none stopped", False)):
        times = sorted(
            o.fault_to_end_s
            for o in result.outcomes
            if o.fault_to_end_s is not None
            and o.fault_at_s is not None
            and paused_at(o.fault_at_s, intervals) == hit
        )
        print(f" {label:22s}  {len(times):8d}  "
              f"{_percentile(times, 0.5):6.2f} / {_percentile(times, 0.99):.2f}")  # fmt: skip
    print(f" injected write failure  {failures:8d}  (client sees an error)")
    print(f" SIGSTOP {PAUSE_S:g} s (either)   {len(paused):8d}  (nothing may fail)")
    print(f" control frame dropped   {dropped:8d}  (resent: {int(control.get('resent', 0))},"
          f" given up: {int(control.get('given_up', 0))}; nothing may fail)")  # fmt: skip
    print(f" KV batch corrupted      {corruptions:8d}  (requests failing their checksum:"
          f" {mismatches}; a request may have several corrupted batches)")  # fmt: skip
    served = [float(str(r["answer_s"])) for r in restarts]
    print(f" idle prefill restart    {len(restarts):8d}  first request served:"
          f" {sum(bool(r['served']) for r in restarts)}/{len(restarts)},"
          f" p50 {_percentile(served, 0.5):.2f} s")  # fmt: skip
    for victim in ("prefill", "decode"):
        mine = [r["to_error_s"] for r in rounds if r["victim"] == victim]
        print(f" SIGKILL {victim:8s}        {len(mine):8d}  "
              f"{_percentile(mine, 0.5):6.2f} / {_percentile(mine, 0.99):.2f}")  # fmt: skip
    print("\n outcome          requests")
    for kind in ("ok", "near_tie", "aborted", "error", "wrong_tokens", "lost"):
        print(f" {kind:15s}  {result.count(kind):8d}")
    for outcome in result.wrong():
        print(f"   wrong: request {outcome.index} (aborted: {outcome.aborted_on_purpose}): "
              f"{outcome.detail}")  # fmt: skip
    for outcome in false_failures:
        print(f"   false failure: {outcome.rid}: {causes.get(outcome.rid, 'no cause logged')}")
    print(f" false failures (failed, though only paused or not hit): {len(false_failures)}")
    print(f" recovered after restart: {sum(r['recovered'] for r in rounds)}/{len(rounds)}")
    print(f" pages (tokens) still in use when idle: {leaked}")
    summary = {
        "faults_injected": faults,
        "requests_lost": lost,
        "wrong_tokens": result.count("wrong_tokens"),
        "pages_leaked": leaked,
        "fault_to_error_p99_s": round(_percentile(all_to_error, 0.99), 3),
        "fault_to_error_p50_s": round(statistics.median(all_to_error), 3) if all_to_error else 0,
        "false_failures": len(false_failures),
        "pauses": len(paused),
        "control_frames_dropped": dropped,
        "checksum_mismatches": mismatches,
        "corruptions_injected": corruptions,
        "idle_restarts_served": sum(bool(r["served"]) for r in restarts),
        "requests": count,
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
