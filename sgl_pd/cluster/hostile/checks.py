"""How the servers took the campaign, read from the outside only: /health, their processes,
the greedy tokens of real requests (also sent during the member phase), and their logs.
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
import requests

from sgl_pd.cluster.client import generate_ids
from sgl_pd.cluster.hostile.bodies import INJECTED_LINE, RealRooms
from sgl_pd.cluster.local import HOST, PdCluster, Server


def direct_generate(
    cluster: PdCluster, ids: Sequence[int], room: int, max_new_tokens: int, timeout_s: float
) -> list[int]:
    """One greedy request sent to both servers with a request id (bootstrap room) of our
    choosing, as the router sends it: the campaign can then forge messages about it."""
    body: dict[str, Any] = {
        "input_ids": list(ids),
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        "bootstrap_host": HOST,
        "bootstrap_port": cluster.bootstrap_port,
        "bootstrap_room": room,
    }
    with ThreadPoolExecutor(max_workers=2) as pool:
        answers = [
            pool.submit(requests.post, f"{s.url}/generate", json=body, timeout=timeout_s)
            for s in (cluster.prefill, cluster.decode)
        ]
        _, decode = (a.result() for a in answers)
    decode.raise_for_status()
    return [int(t) for t in decode.json()["output_ids"]]


@dataclass
class LiveResult:
    requests: int = 0
    changed: int = 0  # other tokens than before the campaign
    failed: int = 0  # no tokens at all


class LiveTraffic:
    """Real requests with known ids, one after another on a thread, while the member
    phase forges messages about them; each must give the tokens it gave before."""

    def __init__(
        self,
        cluster: PdCluster,
        prompts: Sequence[Sequence[int]],
        expected: Sequence[Sequence[int]],
        rooms: RealRooms,
        *,
        max_new_tokens: int,
        timeout_s: float,
        seed: int = 0,
    ) -> None:
        self._args = (cluster, prompts, expected, rooms, max_new_tokens, timeout_s)
        self._rng = random.Random(seed)
        self.result = LiveResult()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hostile-live", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float) -> LiveResult:
        self._stop.set()
        self._thread.join(timeout_s)
        return self.result

    def _run(self) -> None:
        cluster, prompts, expected, rooms, max_new_tokens, timeout_s = self._args
        i = 0
        while not self._stop.is_set():
            room = self._rng.getrandbits(63)
            rooms.start(room)
            ids, want = prompts[i % len(prompts)], list(expected[i % len(prompts)])
            try:
                got = direct_generate(cluster, ids, room, max_new_tokens, timeout_s)
                self.result.changed += got != want
            except (requests.RequestException, KeyError, ValueError):
                self.result.failed += 1
            rooms.finish(room)
            self.result.requests += 1
            i += 1


# -- how the servers took it ----------------------------------------------------------


def process_tree(server: Server) -> set[int]:
    """Pids of the server's process and its children (SGLang's scheduler, detokenizer)."""
    assert server.process.process is not None
    root = psutil.Process(server.process.process.pid)
    return {root.pid, *(p.pid for p in root.children(recursive=True))}


@dataclass
class Checked:
    health_failures: int = 0  # /health answers other than 200
    server_crashes: int = 0  # processes of the servers that are gone
    output_changed: int = 0  # real requests whose tokens differ (or that failed)
    request_failures: int = 0  # of those, the ones that gave no tokens at all
    notes: list[str] = field(default_factory=list)

    def add(self, other: Checked) -> None:
        self.health_failures += other.health_failures
        self.server_crashes += other.server_crashes
        self.output_changed += other.output_changed
        self.request_failures += other.request_failures
        self.notes += other.notes


def health_status(server: Server, timeout_s: float) -> int | str:
    """The server's /health status code, or why there was none."""
    try:
        return requests.get(f"{server.url}/health", timeout=timeout_s).status_code
    except requests.RequestException as e:
        return f"no answer ({type(e).__name__})"


def gone_pids(pids: set[int]) -> set[int]:
    """Those of `pids` (a server's process tree, `process_tree`) no longer running."""
    return {p for p in pids if not psutil.pid_exists(p)}


def check_cluster(
    cluster: PdCluster,
    pids: dict[str, set[int]],
    prompts: Sequence[Sequence[int]],
    expected: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    timeout_s: float,
) -> Checked:
    """Both servers answer /health with 200, every process they started still runs, and
    the real requests through the router give the tokens they gave before."""
    out = Checked()
    for name, server in (("prefill", cluster.prefill), ("decode", cluster.decode)):
        status = health_status(server, timeout_s)
        if status != 200:
            out.health_failures += 1
            out.notes.append(f"{name} /health: {status}")
        gone = gone_pids(pids[name])
        if gone:
            out.server_crashes += len(gone)
            out.notes.append(f"{name}: processes {sorted(gone)} are gone")
    for ids, want in zip(prompts, expected, strict=True):
        try:
            got = generate_ids(cluster.router_url, list(ids), max_new_tokens)
        except requests.RequestException as e:
            out.output_changed += 1
            out.request_failures += 1
            out.notes.append(f"request failed: {e}")
            continue
        if got != list(want):
            out.output_changed += 1
            out.notes.append(f"tokens {got} != {list(want)}")
    return out


LOG_MARKERS = {
    "tracebacks": "Traceback (most recent call last)",
    "handler_failures": "handler failed on",
    "dead_workers": "died",
    "stopped_threads": "stopped",
}


def log_findings(paths: Sequence[Path]) -> dict[str, int]:
    """Lines of the servers' logs that a handler bug leaves, and injected log lines."""
    found = dict.fromkeys([*LOG_MARKERS, "injected_lines"], 0)
    for path in paths:
        for line in path.read_text(errors="replace").splitlines():
            for key, marker in LOG_MARKERS.items():
                found[key] += marker in line
            found["injected_lines"] += line.startswith(INJECTED_LINE)
    return found


def log_sizes(paths: Sequence[Path]) -> dict[str, int]:
    """Bytes of each log (0 when missing)."""
    return {p.name: p.stat().st_size if p.exists() else 0 for p in paths}
