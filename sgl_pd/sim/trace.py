"""Request traces: Poisson arrivals with length distributions, or published trace files.

File formats read:
  Mooncake (FAST'25 traces, JSON lines):
    {"timestamp": ms, "input_length": n, "output_length": m, ...}
  Azure LLM inference (CSV): TIMESTAMP (date-time), ContextTokens, GeneratedTokens
"""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

import numpy as np
import numpy.typing as npt

from sgl_pd.sim.engine import SimRequest


@dataclass(frozen=True)
class Lengths:
    """Token counts drawn from a log-normal of this mean and coefficient of variation
    (cv 0: every request has `mean` tokens), clipped to [low, high]."""

    mean: float
    cv: float = 0.0
    low: int = 1
    high: int = 1 << 20

    def draw(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
        if self.cv <= 0:
            values = np.full(n, self.mean)
        else:
            sigma2 = np.log1p(self.cv**2)
            values = rng.lognormal(np.log(self.mean) - sigma2 / 2, np.sqrt(sigma2), n)
        clipped: npt.NDArray[np.int64] = np.clip(np.rint(values), self.low, self.high).astype(
            np.int64
        )
        return clipped


def poisson(
    rate: float, count: int, prompt: Lengths, output: Lengths, *, seed: int = 0
) -> list[SimRequest]:
    """`count` requests arriving as a Poisson process of `rate` per second."""
    if rate <= 0 or count < 1:
        raise ValueError("a trace needs rate > 0 and at least one request")
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(1.0 / rate, count))
    prompts, outputs = prompt.draw(rng, count), output.draw(rng, count)
    return [
        SimRequest(i, float(t), int(p), int(o))
        for i, (t, p, o) in enumerate(zip(arrivals, prompts, outputs, strict=True))
    ]


def load_trace(path: Path, *, limit: int | None = None, speedup: float = 1.0) -> list[SimRequest]:
    """Mooncake JSON lines or an Azure CSV, arrivals from 0; `speedup` compresses time."""
    rows: list[tuple[float, int, int]] = []
    if path.suffix == ".csv":
        with path.open(newline="") as f:
            for row in csv.DictReader(f):
                t = datetime.fromisoformat(row["TIMESTAMP"].strip()[:26]).timestamp()
                rows.append((t, int(row["ContextTokens"]), int(row["GeneratedTokens"])))
    else:
        for line in path.read_text().splitlines():
            if line.strip():
                d = json.loads(line)
                rows.append((d["timestamp"] / 1e3, int(d["input_length"]), int(d["output_length"])))
    if not rows:
        raise ValueError(f"{path}: no requests in the trace")
    rows = rows[:limit] if limit else rows
    t0 = rows[0][0]
    return [
        SimRequest(i, (t - t0) / speedup, max(1, p), max(1, o)) for i, (t, p, o) in enumerate(rows)
    ]


def with_follow_ups(
    requests: list[SimRequest], share: float, new_tokens: int, *, seed: int = 0
) -> list[SimRequest]:
    """Marks a `share` of the requests as conversations' follow-up turns: all of the
    prompt but its last `new_tokens` is held where the conversation is served."""
    if not 0 <= share <= 1 or new_tokens < 1:
        raise ValueError("a follow-up share within [0, 1] and at least one new token")
    rng = np.random.default_rng(seed)
    for r in requests:
        if rng.random() < share:
            r.held_tokens = max(0, r.prompt_tokens - new_tokens)
    return requests
