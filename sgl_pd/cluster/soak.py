"""A soak: steady traffic against a server for a long while, and what it watches.

`Traffic` keeps `concurrency` greedy streaming requests in flight against one URL (a
router, a decoder), prompts of random token ids, and cancels a share of them after
their first token as a client that goes away does; it records each request's TTFT, its
inter-token gaps and how it ended. `sample_server` reads what a server holds at one
moment: its processes' resident memory, threads and open file descriptors (the whole
process tree: SGLang's scheduler ranks and detokenizer included) and its gauges of
requests and sgl_pd tables. The arithmetic of the report - growth per hour after a
warm-up, latency drift from the first tenth of the run to the last - is pure
(`growth_pct_per_hour`, `p99_drift`).
"""

from __future__ import annotations

import itertools
import json
import math
import random
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psutil
import requests
from prometheus_client.parser import text_string_to_metric_families

# sgl_pd's gauges of what a server holds, and SGLang's of its requests; all back to 0
# once traffic stops. `sgl_pd_table_entries` is read per table ("table:NAME").
TABLE_ENTRIES = "sgl_pd_table_entries"
TABLE_GAUGES = (
    "sgl_pd_rooms",
    "sgl_pd_writes_in_flight",
    "sgl_pd_staging_bytes",
    "sglang:num_running_reqs",
    "sglang:num_queue_reqs",
)
WARMUP_SHARE = 0.2  # the first fifth of a soak: caches, pools and allocators filling


@dataclass(frozen=True)
class ProcessSample:
    """A server's process tree at one moment."""

    rss_bytes: int
    threads: int
    fds: int


def process_tree(root_pid: int) -> list[psutil.Process]:
    """`root_pid` and its descendants (NoSuchProcess where the root is gone)."""
    root = psutil.Process(root_pid)
    return [root, *root.children(recursive=True)]


def tree_sample(root_pid: int) -> ProcessSample:
    """Resident memory, threads and open file descriptors summed over `root_pid` and
    its descendants (those that exit while read are skipped)."""
    rss = threads = fds = 0
    for process in process_tree(root_pid):
        try:
            with process.oneshot():
                rss += process.memory_info().rss
                threads += process.num_threads()
                fds += process.num_fds()
        except psutil.NoSuchProcess:
            continue
    return ProcessSample(rss, threads, fds)


def gauges(url: str, names: Iterable[str] = TABLE_GAUGES) -> dict[str, float]:
    """The named gauges of the server's /metrics, summed over labels and ranks, and the
    entries of each of sgl_pd's tables ("table:NAME", summed over ranks)."""
    wanted = set(names)
    out = dict.fromkeys(wanted, 0.0)
    text = requests.get(f"{url}/metrics", timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted:
                out[sample.name] += sample.value
            elif sample.name == TABLE_ENTRIES and "table" in sample.labels:
                key = f"table:{sample.labels['table']}"
                out[key] = out.get(key, 0.0) + sample.value
    return out


@dataclass(frozen=True)
class ServerSample:
    at_s: float  # since the soak began
    processes: ProcessSample
    tables: dict[str, float]


def sample_server(url: str, root_pid: int, at_s: float) -> ServerSample:
    return ServerSample(at_s, tree_sample(root_pid), gauges(url))


@dataclass(frozen=True)
class Outcome:
    """One soak request: when it began (s since the soak began), its first token's wait
    and gaps between tokens (s), and how it ended: ok, cancelled (by the client, after
    its first token) or the error."""

    start_s: float
    ttft_s: float
    gaps_s: tuple[float, ...]
    ended: str


@dataclass
class Traffic:
    """`concurrency` requests kept in flight against `url` until `stop`."""

    url: str
    concurrency: int
    vocab_size: int
    prompt_tokens: int = 200
    output_tokens: int = 64
    cancel_share: float = 0.05  # requests the client abandons after their first token
    timeout_s: float = 600.0
    seed: int = 0
    outcomes: list[Outcome] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)
    _began: float = field(default_factory=time.monotonic)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        self._began = time.monotonic()
        for i in range(self.concurrency):
            thread = threading.Thread(target=self._client, args=(i,), daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float) -> None:
        """No new request; waits for those in flight (at most `timeout_s`)."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            thread.join(max(0.0, deadline - time.monotonic()))

    def _client(self, index: int) -> None:
        rng = random.Random(self.seed * 100_003 + index)
        while not self._stop.is_set():
            ids = [rng.randrange(self.vocab_size) for _ in range(self.prompt_tokens)]
            cancel = rng.random() < self.cancel_share
            outcome = self._one(ids, cancel)
            with self._lock:
                self.outcomes.append(outcome)

    def _one(self, ids: Sequence[int], cancel: bool) -> Outcome:
        body: dict[str, Any] = {
            "input_ids": list(ids),
            "sampling_params": {
                "temperature": 0,
                "max_new_tokens": self.output_tokens,
                "ignore_eos": True,
            },
            "stream": True,
        }
        began = time.monotonic()
        start_s = began - self._began
        stamps: list[float] = []
        try:
            with requests.post(
                f"{self.url}/generate", json=body, stream=True, timeout=self.timeout_s
            ) as r:
                if r.status_code != 200:
                    return Outcome(start_s, math.nan, (), f"HTTP {r.status_code}")
                seen = 0
                finish: Any = None  # the last chunk's finish reason (an abort's says why)
                for line in r.iter_lines():
                    if not line.startswith(b"data:") or line.strip() == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[len(b"data:") :])
                    finish = (chunk.get("meta_info") or {}).get("finish_reason") or finish
                    tokens = len(chunk.get("output_ids") or ())
                    now = time.monotonic()
                    stamps.extend([now] * max(0, tokens - seen))
                    seen = max(seen, tokens)
                    if cancel and stamps:
                        break  # (the connection closes: SGLang aborts the request)
        except requests.RequestException as e:
            return Outcome(start_s, math.nan, (), type(e).__name__)
        if not stamps:
            why = finish.get("message") if isinstance(finish, dict) else None
            return Outcome(start_s, math.nan, (), f"no tokens: {why}" if why else "no tokens")
        gaps = tuple(float(b - a) for a, b in itertools.pairwise(stamps) if b > a)
        if cancel:
            return Outcome(start_s, stamps[0] - began, gaps, "cancelled")
        ended = "ok" if len(stamps) >= self.output_tokens else f"{len(stamps)} tokens"
        return Outcome(start_s, stamps[0] - began, gaps, ended)


def growth_pct_per_hour(
    times_s: Sequence[float], values: Sequence[float], warmup_share: float = WARMUP_SHARE
) -> float:
    """The least-squares slope of `values` over time after the first `warmup_share` of
    the run, in percent of their mean per hour (NaN with fewer than 3 samples left)."""
    t = np.asarray(times_s, dtype=float)
    v = np.asarray(values, dtype=float)
    if t.size == 0:
        return math.nan
    kept = t >= t[0] + warmup_share * (t[-1] - t[0])
    t, v = t[kept], v[kept]
    if t.size < 3 or np.ptp(t) <= 0 or v.mean() == 0:
        return math.nan
    slope = np.polyfit(t, v, 1)[0]  # per second
    return float(100.0 * slope * 3600.0 / v.mean())


def p99_drift(
    starts_s: Sequence[float], values: Sequence[Sequence[float]], share: float = 0.1
) -> float:
    """p99 of the values of the requests in the last `share` of the run (by start time)
    over that of the first `share`: 1.0 when latency did not drift. `values`: per
    request, its samples (a TTFT, or its gaps)."""
    if not starts_s:
        return math.nan
    first_end = min(starts_s) + share * (max(starts_s) - min(starts_s))
    last_begin = max(starts_s) - share * (max(starts_s) - min(starts_s))
    first = [x for s, xs in zip(starts_s, values, strict=True) if s <= first_end for x in xs]
    last = [x for s, xs in zip(starts_s, values, strict=True) if s >= last_begin for x in xs]
    if not first or not last:
        return math.nan
    base = float(np.percentile(first, 99))
    return float(np.percentile(last, 99)) / base if base > 0 else math.nan
