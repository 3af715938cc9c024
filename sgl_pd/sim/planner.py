"""Cheapest PD deployment that meets latency targets at a given load.

Candidates: decode as TP over one node, or DP attention + EP over 1-4 nodes (one rank per
GPU); prefill as TP nodes. For each decode shape the planner finds the fewest decode
instances whose ITL p99 meets its target (more decode instances never slow decoding),
then the fewest prefill nodes whose TTFT p99 meets its target (more prefill nodes never
delay a prefill), and ranks what passed by GPU count. Every simulated candidate is kept
for the frontier plot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from sgl_pd.sim.deploy import Figures, PdSetup, figures
from sgl_pd.sim.engine import TransferModel
from sgl_pd.sim.hardware import GPUS, Efficiency, Nics
from sgl_pd.sim.model import ModelSpec
from sgl_pd.sim.roofline import RooflineCost
from sgl_pd.sim.trace import Lengths, poisson, with_follow_ups


@dataclass(frozen=True)
class Slo:
    itl_p99_ms: float
    ttft_p99_ms: float

    def met_by(self, f: Figures) -> bool:
        return f.itl_p99_ms <= self.itl_p99_ms and f.ttft_p99_ms <= self.ttft_p99_ms


@dataclass(frozen=True)
class Candidate:
    prefill_nodes: int
    decode_instances: int
    decode_gpus: int  # per decode instance
    decode_dp: int  # 1: TP over decode_gpus
    gpus_per_node: int
    figures: Figures

    @property
    def gpus(self) -> int:
        return self.prefill_nodes * self.gpus_per_node + self.decode_instances * self.decode_gpus

    @property
    def shape(self) -> str:
        decode = (
            f"TP{self.decode_gpus}"
            if self.decode_dp == 1
            else f"DP{self.decode_dp}+EP{self.decode_gpus}"
        )
        return f"{self.prefill_nodes}P(TP{self.gpus_per_node}) : {self.decode_instances}D({decode})"


@dataclass(frozen=True)
class PlanInputs:
    model: ModelSpec
    gpu: str
    rate: float  # requests/s
    prompt: Lengths
    output: Lengths
    slo: Slo
    gpus_per_node: int = 8
    max_nodes: int = 32
    requests: int = 800
    seed: int = 1
    eff: Efficiency = field(default_factory=Efficiency)
    follow_up_share: float = 0.0  # conversations' follow-up turns (`trace.with_follow_ups`)
    follow_up_new_tokens: int = 200
    local_prefill_max_tokens: int = 0  # decoders prefill short uncached suffixes (0 = off)


def plan(inputs: PlanInputs, *, progress: bool = True) -> tuple[Candidate | None, list[Candidate]]:
    """The cheapest candidate meeting the SLOs (None if none within max_nodes) and every
    candidate simulated."""
    g = inputs.gpus_per_node
    gpu = GPUS[inputs.gpu]
    prefill_cost = RooflineCost(inputs.model, gpu, g, 1, inputs.eff)
    transfer = TransferModel(
        inputs.model.kv_bytes_per_token,
        inputs.model.num_layers,
        Nics(per_node=g).node_bytes_s(inputs.eff.nic),
        inputs.eff.transfer_latency_ms / 1e3,
    )
    trace = with_follow_ups(
        poisson(inputs.rate, inputs.requests, inputs.prompt, inputs.output, seed=inputs.seed),
        inputs.follow_up_share,
        inputs.follow_up_new_tokens,
        seed=inputs.seed + 1,
    )
    tried: dict[tuple[int, int, int, int], Candidate] = {}

    def simulate(prefills: int, decodes: int, gpus: int, dp: int) -> Candidate:
        if (prefills, decodes, gpus, dp) in tried:
            return tried[prefills, decodes, gpus, dp]
        decode_cost = RooflineCost(inputs.model, gpu, gpus, dp, inputs.eff)
        setup = PdSetup(
            prefill_cost,
            decode_cost,
            prefills,
            decodes,
            transfer,
            decode_ranks=dp,
            max_running=_max_running(decode_cost, inputs),
            local_prefill_max_tokens=inputs.local_prefill_max_tokens,
        )
        fresh = [
            type(r)(r.id, r.arrival, r.prompt_tokens, r.output_tokens, r.held_tokens) for r in trace
        ]
        c = Candidate(prefills, decodes, gpus, dp, g, figures(*setup.run(fresh)))
        tried[prefills, decodes, gpus, dp] = c
        if progress:
            f = c.figures
            print(
                f"  {c.shape:<28} {c.gpus:>4} GPUs  ITL p99 {f.itl_p99_ms:8.1f} ms  "
                f"TTFT p99 {f.ttft_p99_ms:9.0f} ms  {f.tps_per_stream:6.1f} tok/s",
                flush=True,
            )
        return c

    passed: list[Candidate] = []
    prefill_guess = _prefill_guess(prefill_cost, inputs)
    for gpus, dp in ((g, 1), (g, g), (2 * g, 2 * g), (4 * g, 4 * g)):

        def decode_ok(n: int, gpus: int = gpus, dp: int = dp) -> bool:
            return simulate(prefill_guess, n, gpus, dp).figures.itl_p99_ms <= inputs.slo.itl_p99_ms

        decodes = _first(decode_ok, max(1, inputs.max_nodes * g // gpus))
        if decodes is None:
            continue

        def all_ok(n: int, gpus: int = gpus, dp: int = dp, d: int = decodes) -> bool:
            return inputs.slo.met_by(simulate(n, d, gpus, dp).figures)

        prefills = _first(all_ok, inputs.max_nodes)
        if prefills is not None:
            passed.append(tried[prefills, decodes, gpus, dp])
    best = min(passed, key=lambda c: (c.gpus, c.figures.ttft_p99_ms), default=None)
    return best, list(tried.values())


def _first(ok: Callable[[int], bool], limit: int) -> int | None:
    """Smallest n in [1, limit] with ok(n), for monotone ok: doubling, then bisection."""
    hi = 1
    while not ok(hi):
        if hi >= limit:
            return None
        hi = min(limit, hi * 2)
    lo = hi // 2 + 1 if hi > 1 else 1
    while lo < hi:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid + 1
    return hi


def _prefill_guess(cost: RooflineCost, inputs: PlanInputs) -> int:
    """Enough prefill nodes to stay under 70% busy: decode sizing should not wait on them."""
    from sgl_pd.sim.roofline import Work

    per_request = cost.step_s([[Work(int(inputs.prompt.mean), 0)]])
    return max(1, int(inputs.rate * per_request / 0.7) + 1)


def _max_running(cost: RooflineCost, inputs: PlanInputs) -> int:
    """Requests a decode rank holds: its KV capacity over a request's mean length."""
    per_request = inputs.prompt.mean + inputs.output.mean
    return max(1, min(1024, int(cost.kv_capacity_tokens() / per_request)))


def plot_frontier(tried: list[Candidate], best: Candidate | None, slo: Slo, path: Path) -> None:
    """GPUs against ITL p99 and TTFT p99 of every simulated candidate; the cheapest that
    met both targets circled."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (itl, ttft) = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, target, label in (
        (itl, "itl_p99_ms", slo.itl_p99_ms, "ITL p99 (ms)"),
        (ttft, "ttft_p99_ms", slo.ttft_p99_ms, "TTFT p99 (ms)"),
    ):
        for dp, marker in ((1, "o"), (0, "^")):
            pts = [c for c in tried if (c.decode_dp == 1) == (dp == 1)]
            ax.scatter(
                [c.gpus for c in pts],
                [getattr(c.figures, key) for c in pts],
                marker=marker,
                label="TP decode" if dp == 1 else "DP+EP decode",
                alpha=0.7,
            )
        if best is not None:
            ax.scatter(
                [best.gpus],
                [getattr(best.figures, key)],
                s=200,
                facecolors="none",
                edgecolors="red",
                label=f"cheapest: {best.shape}",
            )
        ax.axhline(target, color="grey", ls="--", lw=0.8, label="target")
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
    itl.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
