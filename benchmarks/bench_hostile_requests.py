"""Hostile request bodies against the HTTP APIs: no body takes a server down.

Servers (bundled tiny Llama, started with sgl_pd's launcher, each on its own cores where
there are enough): a monolithic server, and a prefill + decode pair with SGLang's router
in PD mode over it, whose decoder also takes requests directly (direct mode). Three
targets get the same bodies: `monolithic`, `router` (the PD pair through the router: the
body reaches both servers) and `direct` (the decoder, which submits the prefill itself).

Bodies (`sgl_pd.cluster.hostile_requests.draw_bodies`): Schemathesis over the servers'
own OpenAPI schema (`/openapi.json`), bodies that fit it laid over a small valid request
and bodies that break it, plus Hypothesis strategies for the fields the schema leaves
loose (token ids around the vocabulary, non-finite numbers, grammars, logprob options,
batches), for /generate, /v1/completions, /v1/chat/completions and, fewer, the other
request endpoints.

After every batch, for each target: every server process alive, `/health` 200, a known
greedy request answered with the tokens it got before the campaign, and the PD servers'
pools idle (no page, room or staging held). A server that is gone is restarted; the
bodies of that batch that got no answer are replayed one by one against the fresh
servers to find which one killed it.

Every body that got a 5xx, no answer, or killed a server is saved as a regression case
(JSON lines, `--out`/cases.jsonl, new ones added); copied into
`tests/e2e/hostile_request_cases.jsonl`, the suite replays it.

    python benchmarks/bench_hostile_requests.py [--quick] [--bodies N] [--seed S] [--out DIR]

--quick: 250 bodies per main endpoint, 40 per other endpoint, per target (a few thousand
sends in a few minutes); the full run 2,200 and 350 (8,700 bodies, 26,100 sends over the
three targets, about 90 minutes). The last line is JSON: bodies (sends), distinct_bodies,
servers_lost, server_errors_5xx, regression_cases (new ones saved), and the counts per
target and endpoint.
SGLPD_LOCAL_PATIENCE=3 makes every wait three times longer on a loaded machine.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import requests
from tqdm import tqdm

from sgl_pd.cluster.client import generate_ids
from sgl_pd.cluster.hostile import gone_pids, health_status, process_tree
from sgl_pd.cluster.hostile_requests import (
    MAIN_ENDPOINTS,
    OTHER_ENDPOINTS,
    Body,
    Case,
    Outcome,
    draw_bodies,
    save_cases,
    send,
)
from sgl_pd.cluster.local import (
    DirectCluster,
    Patience,
    Server,
    direct_cluster,
    local_patience,
    monolithic_server,
)
from sgl_pd.cluster.logs import pools_idle, wait_pools_idle
from sgl_pd.cluster.prompts import long_prompt_ids
from sgl_pd.models import TINY_LLAMA_PATH

GOOD_PROMPT = long_prompt_ids(24, start=7)  # the known request, greedy
GOOD_TOKENS = 6
BASE_PROMPT = long_prompt_ids(6, start=900)  # what drawn fields are laid over
TARGETS = ("monolithic", "router", "direct")
# a short context bounds what a valid body may ask to generate (tokens at CPU speed)
SERVER_ARGS = ("--context-length", "2048", "--log-level", "info")  # info: idle-pool lines
DEFAULT_OUT = Path("benchmarks/out/bench_hostile_requests")


@dataclass
class Group:
    """Servers started together, and the targets they serve."""

    name: str
    servers: dict[str, Server]
    urls: dict[str, str]  # target -> base URL
    pd: bool  # the servers are a PD pair (their pools report idle lines)
    pids: dict[str, set[int]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.pids = {name: process_tree(s) for name, s in self.servers.items()}


@dataclass
class Tally:
    bodies: int = 0
    by_status: collections.Counter[str] = field(default_factory=collections.Counter)
    server_errors: int = 0

    def add(self, outcome: Outcome) -> None:
        self.bodies += 1
        status = outcome.status
        bucket = f"{status // 100}xx" if isinstance(status, int) else str(status)
        self.by_status[bucket] += 1
        self.server_errors += outcome.server_error


class Servers:
    """The monolithic server and the PD group, (re)started on demand."""

    def __init__(self, log_root: Path, patience: Patience) -> None:
        self._root = log_root
        self._patience = patience
        self._stacks: dict[str, contextlib.ExitStack] = {}
        self.groups: dict[str, Group] = {}
        self.starts = collections.Counter[str]()

    def start(self, name: str) -> Group:
        self.stop(name)
        self.starts[name] += 1
        log_dir = self._root / f"{name}-{self.starts[name]}"
        log_dir.mkdir(parents=True)
        stack = contextlib.ExitStack()
        if name == "monolithic":
            server = stack.enter_context(
                monolithic_server(log_dir, extra=SERVER_ARGS, patience=self._patience)
            )
            group = Group(name, {"monolithic": server}, {"monolithic": server.url}, pd=False)
        else:
            cluster: DirectCluster = stack.enter_context(
                direct_cluster(
                    log_dir,
                    prefill_extra=SERVER_ARGS,
                    decode_extra=SERVER_ARGS,
                    decoders=1,
                    with_router=True,
                    patience=self._patience,
                )
            )
            assert cluster.router_url is not None
            group = Group(
                name,
                {"prefill": cluster.prefill, "decode": cluster.decoders[0]},
                {"router": cluster.router_url, "direct": cluster.decoders[0].url},
                pd=True,
            )
        self._stacks[name] = stack
        self.groups[name] = group
        return group

    def stop(self, name: str) -> None:
        stack = self._stacks.pop(name, None)
        if stack is not None:
            stack.close()

    def close(self) -> None:
        for name in list(self._stacks):
            self.stop(name)

    def group_of(self, target: str) -> Group:
        return next(g for g in self.groups.values() if target in g.urls)


def problems(group: Group, expected: list[int], patience: Patience) -> list[str]:
    """What is wrong with a group's servers now; [] when all is well."""
    found = []
    for name, server in group.servers.items():
        gone = gone_pids(group.pids[name])
        if gone:
            found.append(f"{name}: processes {sorted(gone)} are gone")
            continue
        status = health_status(server, patience.seconds(30))
        if status != 200:
            found.append(f"{name} /health: {status}")
    if found:
        return found
    for target, url in group.urls.items():
        try:
            got = generate_ids(url, GOOD_PROMPT, GOOD_TOKENS)
        except requests.RequestException as e:
            found.append(f"{target}: the known request failed: {e}"[:300])
            continue
        if got != expected:
            found.append(f"{target}: the known request gave {got}, not {expected}")
    if group.pd:
        states = wait_pools_idle(group.servers, patience.seconds(60))
        if not pools_idle(group.servers, states):
            found.append(f"pools still hold pages: {states}")
    return found


def send_all(
    url: str,
    bodies: Sequence[Body],
    timeout_s: float,
    concurrency: int,
    progress: Callable[[], None],
) -> list[Outcome]:
    local = threading.local()

    def one(body: Body) -> Outcome:
        if not hasattr(local, "session"):
            local.session = requests.Session()
        try:
            return send(url, body, timeout_s, local.session)
        finally:
            progress()

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, bodies))


def batches(items: Sequence[Body], size: int) -> Iterator[Sequence[Body]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few thousand bodies")
    parser.add_argument("--bodies", type=int, help="bodies per main endpoint and target")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch", type=int, default=200, help="bodies between checks")
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=60.0, help="seconds per body")
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="where cases.jsonl gathers the cases found"
    )
    parser.add_argument("--targets", nargs="+", choices=TARGETS, default=list(TARGETS))
    args = parser.parse_args(argv)
    main_count = args.bodies or (250 if args.quick else 2200)
    other_count = max(10, main_count // 7) if args.bodies else (40 if args.quick else 350)
    patience = local_patience()
    log_root = Path(tempfile.mkdtemp(prefix="bench_hostile_requests_"))
    print(f"[bench] hostile request campaign ({'quick' if args.quick else 'full'}); "
          f"logs in {log_root}")  # fmt: skip
    vocab_size = json.loads((TINY_LLAMA_PATH / "config.json").read_text())["vocab_size"]
    servers = Servers(log_root, patience)
    tallies: dict[tuple[str, str], Tally] = collections.defaultdict(Tally)
    cases: list[Case] = []
    lost: list[str] = []
    started = time.monotonic()
    try:
        for name in sorted({"monolithic" if t == "monolithic" else "pd" for t in args.targets}):
            servers.start(name)
        first = next(iter(servers.groups.values()))
        first_url = next(iter(first.urls.values()))
        openapi = requests.get(f"{first_url.rstrip('/')}/openapi.json", timeout=60).json()
        info = requests.get(f"{first_url}/v1/models", timeout=60).json()
        context_len = int(info["data"][0].get("max_model_len") or 8192)
        expected = generate_ids(first_url, GOOD_PROMPT, GOOD_TOKENS)
        print(f"[bench] servers up in {time.monotonic() - started:.0f} s; vocabulary "
              f"{vocab_size}, context {context_len}")  # fmt: skip
        for group in servers.groups.values():
            found = problems(group, expected, patience)
            if found:
                raise SystemExit(f"{group.name} is not healthy before the campaign: {found}")
        endpoints = [(e, main_count) for e in MAIN_ENDPOINTS]
        endpoints += [(e, other_count) for e in OTHER_ENDPOINTS]
        for endpoint, count in endpoints:
            t0 = time.monotonic()
            bodies = draw_bodies(
                endpoint, count, openapi=openapi, prompt_ids=BASE_PROMPT,
                vocab_size=vocab_size, context_len=context_len, seed=args.seed,
                negative_budget_s=10.0 if args.quick else 120.0,
            )  # fmt: skip
            kinds = collections.Counter(b.kind for b in bodies)
            print(f"[bench] {endpoint}: {len(bodies)} bodies drawn in "
                  f"{time.monotonic() - t0:.0f} s ({dict(kinds)})")  # fmt: skip
            for target in args.targets:
                with tqdm(total=len(bodies), desc=f"{target} {endpoint}", unit="body") as bar:
                    for batch in batches(bodies, args.batch):
                        group = servers.group_of(target)
                        outcomes = send_all(
                            group.urls[target], batch, patience.seconds(args.timeout),
                            args.concurrency, lambda: bar.update(1),
                        )  # fmt: skip
                        tally = tallies[(target, endpoint)]
                        for body, outcome in zip(batch, outcomes, strict=True):
                            tally.add(outcome)
                            if outcome.server_error or outcome.status == "connection":
                                cases.append(_case(target, body, outcome, killed=False))
                        found = problems(group, expected, patience)
                        if found:
                            lost.append(f"{target} {endpoint}: {'; '.join(found)}")
                            tqdm.write(f"[bench] {target} {endpoint}: {found}")
                            suspects = [b for b, o in zip(batch, outcomes, strict=True)
                                        if o.no_answer or o.server_error]  # fmt: skip
                            cases += _replay(servers, group.name, target, suspects, expected,
                                             patience, args.timeout)  # fmt: skip
    finally:
        servers.close()

    saved = save_cases(args.out / "cases.jsonl", cases)
    summary = report(tallies, cases, lost, saved, args.targets, time.monotonic() - started)
    print(json.dumps(summary))
    return 0


def report(
    tallies: dict[tuple[str, str], Tally],
    cases: Sequence[Case],
    lost: Sequence[str],
    saved: int,
    targets: Sequence[str],
    campaign_s: float,
) -> dict[str, object]:
    """Prints the table of answers per target and endpoint, the servers lost and the
    cases found; returns the headline figures."""
    print(f"\n{'target':11s} {'endpoint':22s} {'bodies':>7s} {'2xx':>6s} {'4xx':>6s} "
          f"{'5xx':>5s} {'timeout':>8s} {'no answer':>9s}")  # fmt: skip
    for (target, endpoint), t in sorted(tallies.items()):
        s = t.by_status
        print(f"{target:11s} {endpoint:22s} {t.bodies:7d} {s['2xx']:6d} {s['4xx']:6d} "
              f"{s['5xx']:5d} {s['timeout']:8d} {s['connection']:9d}")  # fmt: skip
    for note in lost:
        print(f"  server lost: {note}")
    for case in cases:
        print(f"  case: {case.target} {case.endpoint} {case.status} killed={case.killed} "
              f"{json.dumps(case.body)[:160]} -> {case.excerpt[:160]}")  # fmt: skip
    per_endpoint: dict[str, int] = collections.Counter()
    for (_, endpoint), t in tallies.items():
        per_endpoint[endpoint] += t.bodies
    summary = {
        # A body goes to every target: `bodies` counts sends, `distinct_bodies` drawings.
        "bodies": sum(t.bodies for t in tallies.values()),
        "distinct_bodies": sum(t.bodies for t in tallies.values()) // max(1, len(targets)),
        "servers_lost": len(lost),
        "server_errors_5xx": sum(t.server_errors for t in tallies.values()),
        "regression_cases": saved,
        "bodies_per_endpoint": dict(per_endpoint),
        "status_per_target": {target: dict(_statuses(tallies, target)) for target in targets},
        "campaign_s": round(campaign_s, 1),
    }
    return summary


def _statuses(tallies: dict[tuple[str, str], Tally], target: str) -> collections.Counter[str]:
    total: collections.Counter[str] = collections.Counter()
    for (name, _), tally in tallies.items():
        if name == target:
            total.update(tally.by_status)
    return total


def _case(target: str, body: Body, outcome: Outcome, *, killed: bool) -> Case:
    return Case(body.endpoint, body.body, target, outcome.status, killed, outcome.excerpt)


def _replay(
    servers: Servers,
    group_name: str,
    target: str,
    suspects: Sequence[Body],
    expected: list[int],
    patience: Patience,
    timeout_s: float,
) -> list[Case]:
    """Restarts the group and sends each suspect alone: the ones after which a server is
    gone or unhealthy are the cases that kill one (the group is restarted after each)."""
    found: list[Case] = []
    group = servers.start(group_name)
    for body in suspects:
        outcome = send(group.urls[target], body, patience.seconds(timeout_s))
        after = problems(group, expected, patience)
        if after:
            tqdm.write(f"[bench] killed by {json.dumps(body.body)[:200]}: {after}")
            found.append(_case(target, body, outcome, killed=True))
            group = servers.start(group_name)
    return found


if __name__ == "__main__":
    raise SystemExit(main())
