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


def last_pool_state(log: Path) -> tuple[int, bool] | None:
    """(tokens in use, no leak) from the last idle-pool line, or None before the first."""
    lines = [
        line for line in log.read_text(errors="replace").splitlines() if POOL_LINE_PREFIX in line
    ]
    if not lines:
        return None
    used = re.search(r"used (\d+) tokens", lines[-1])
    return (int(used.group(1)) if used else -1), "no leak" in lines[-1]
