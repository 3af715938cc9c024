"""Reading the lines sgl_pd's servers log for tests, benchmarks and operators."""

from __future__ import annotations

import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from sgl_pd.backend.pool_report import POOL_LINE_PREFIX
from sgl_pd.backend.prefill.messenger import TIMING_LINE_PREFIX
from sgl_pd.cluster.local import Server, scheduler_ranks, warnings_path

TimingLine = dict[str, str | float]


def _number(text: str) -> float:
    """An int stays exact (room ids are 64-bit: a float would round them)."""
    return int(text) if text.isdigit() else float(text)


def timing_lines(log: Path) -> list[TimingLine]:
    """The prefill messenger's per-request lines, oldest first: `mode` is a string, every
    other field a number, exact for integers (times are time.monotonic() seconds, shared
    by all processes)."""
    out: list[TimingLine] = []
    for line in log.read_text(errors="replace").splitlines():
        if TIMING_LINE_PREFIX in line:
            fields = re.findall(r"(\w+)=(\S+)", line.split(TIMING_LINE_PREFIX, 1)[1])
            out.append({k: (v if k == "mode" else _number(v)) for k, v in fields})
    return out


# SGLang's decode scheduler, when a request's KV transfer fails (the exception is ours)
_DECODE_FAILURE = re.compile(
    r"Decode transfer failed for request .*?rid='([^']*)'.*? with exception (.*)$"
)


def decode_failures(logs: Iterable[Path]) -> dict[str, str]:
    """rid -> why the decoder failed the request's KV transfer, from decode server logs
    (the first reason logged for each)."""
    out: dict[str, str] = {}
    for log in logs:
        for line in log.read_text(errors="replace").splitlines():
            match = _DECODE_FAILURE.search(line)
            if match:
                out.setdefault(match.group(1), match.group(2))
    return out


def pool_states(log: Path) -> dict[str, tuple[int, bool]]:
    """Per scheduler process (SGLang's log tag, "TP0", "TP1", "DP1 TP1"...): (tokens in
    use, no leak and no staging held) from its last idle-pool line; empty before the
    first line."""
    states: dict[str, tuple[int, bool]] = {}
    for line in log.read_text(errors="replace").splitlines():
        if POOL_LINE_PREFIX not in line:
            continue
        head, tail = line.split(POOL_LINE_PREFIX, 1)
        tag = re.search(r"((?:[A-Z]+\d+ ?)+)\]\s*$", head)
        used = re.search(r"used (\d+) tokens", tail)
        staged = re.search(r"staging (\d+) bytes", tail)
        states[tag.group(1).strip() if tag else ""] = (
            int(used.group(1)) if used else -1,
            "no leak" in tail and not (staged and int(staged.group(1))),
        )
    return states


def last_pool_state(log: Path) -> tuple[int, bool] | None:
    """(tokens in use, no leak) over every scheduler process of one server, from each
    one's last idle-pool line: the tokens summed, "no leak" only if every rank says so.
    None before the first line."""
    states = pool_states(log)
    if not states:
        return None
    used = [u for u, _ in states.values()]
    return (-1 if -1 in used else sum(used)), all(ok for _, ok in states.values())


PoolStates = dict[str, dict[str, tuple[int, bool]]]  # server -> rank tag -> (used, no leak)


def wait_pools_idle(servers: Mapping[str, Server], timeout_s: float) -> PoolStates:
    """Every scheduler process of every server: its last idle-pool line, once each server
    has a line from all its ranks and all report nothing in use and no leak - or the
    states when `timeout_s` ran out, for the caller to show."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = {name: pool_states(s.process.log_path) for name, s in servers.items()}
        if pools_idle(servers, states) or time.monotonic() > deadline:
            return states
        time.sleep(1)


def pools_idle(servers: Mapping[str, Server], states: PoolStates) -> bool:
    """Every rank of every server reported, with nothing in use and no leak."""
    return all(
        len(states[name]) == scheduler_ranks(s.process.argv)
        and all(state == (0, True) for state in states[name].values())
        for name, s in servers.items()
    )


# Warnings SGLang logs on a healthy local server whatever sgl_pd's settings, with why
# (`sgl_pd.warnings_log` gathers them, with their logger, beside the server's log):
EXPECTED_WARNINGS = tuple(
    re.compile(pattern)
    for pattern in (
        # SGLang's CPU engine (the CPU harness): what a host without CUDA cannot do
        r"sglang\.srt\.models\.registry: Ignore import error when loading",
        r"Cannot detect CUDA architecture",
        r"shared memory based AllReduce is disabled",
        r"Cuda graph is disabled because of using torch native attention backend",
        # local clusters pin each rank's threads to its cores (`Placement`), on a host
        # with one NUMA node however many ranks
        r"SGLANG_CPU_OMP_THREADS_BIND is set for explicit control",
        r"total number of ranks \(\d+\) is larger than numa node number",
        # this host's open-file limit
        r"Fail to set RLIMIT_NOFILE",
        # the bundled tiny model's tokenizer has no yes/no tokens for SGLang's rerank API
        r"Using fallback token IDs for yes/no",
        # SGLang's note on its own decode prefix cache, which tests turn on
        r"EXPERIMENTAL: Radix cache is enabled for decode server",
        # a prefill server's SGLang reports a request whose client went away mid-transfer
        # (its decoder aborted it) as a failed bootstrap or transfer
        r"Prefill (bootstrap|transfer) failed for request .*failed: decoder aborted: client$",
        # ... and its copy of a router's request that the decoder prefilled itself,
        # aborted in SGLang's bootstrap queue once the decoder said so (`prefill/skips`)
        r"Prefill bootstrap failed for request .*failed: aborted by the prefill scheduler$",
        # ... and the decoder's SGLang, polling the request it aborted, as a failed one
        r"Decode (handshake|transfer) failed for request .*did not arrive: aborted by the "
        r"decode scheduler$",
    )
)


def unexpected_warnings(server: Server) -> list[str]:
    """The warnings a local server's processes logged (sgl_pd's and SGLang's) that
    `EXPECTED_WARNINGS` does not explain."""
    path = warnings_path(server.process.log_path)
    lines = path.read_text(errors="replace").splitlines() if path.exists() else []
    return [line for line in lines if not any(p.search(line) for p in EXPECTED_WARNINGS)]
