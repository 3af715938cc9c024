"""Reading the lines sgl_pd's servers log for tests, benchmarks and operators."""

from __future__ import annotations

import re
from pathlib import Path

from sgl_pd.backend.pool_report import POOL_LINE_PREFIX
from sgl_pd.backend.prefill_messenger import TIMING_LINE_PREFIX

TimingLine = dict[str, str | float]


def timing_lines(log: Path) -> list[TimingLine]:
    """The prefill messenger's per-request lines, oldest first: `mode` is a string, every
    other field a number (times are time.monotonic() seconds, shared by all processes)."""
    out: list[TimingLine] = []
    for line in log.read_text(errors="replace").splitlines():
        if TIMING_LINE_PREFIX in line:
            fields = re.findall(r"(\w+)=(\S+)", line.split(TIMING_LINE_PREFIX, 1)[1])
            out.append({k: (v if k == "mode" else float(v)) for k, v in fields})
    return out


def pool_states(log: Path) -> dict[str, tuple[int, bool]]:
    """Per scheduler process (SGLang's log tag, "TP0", "TP1", "DP1 TP1"...): (tokens in
    use, no leak) from its last idle-pool line; empty before the first line."""
    states: dict[str, tuple[int, bool]] = {}
    for line in log.read_text(errors="replace").splitlines():
        if POOL_LINE_PREFIX not in line:
            continue
        head, tail = line.split(POOL_LINE_PREFIX, 1)
        tag = re.search(r"((?:[A-Z]+\d+ ?)+)\]\s*$", head)
        used = re.search(r"used (\d+) tokens", tail)
        states[tag.group(1).strip() if tag else ""] = (
            int(used.group(1)) if used else -1,
            "no leak" in tail,
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
