"""Deployments to simulate (mixed, or prefill + decode), and their served figures."""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from sgl_pd.core.dispatch import PrefillerLoad
from sgl_pd.core.placement import prefill_locally
from sgl_pd.sim.engine import (
    Clock,
    DecodeInstance,
    MixedInstance,
    PrefillInstance,
    SimRequest,
    TransferModel,
    run_trace,
)
from sgl_pd.sim.roofline import StepCost


@dataclass(frozen=True)
class Figures:
    """What a user reads off a deployment; times in ms, rates per second."""

    requests: int
    ttft_p50_ms: float
    ttft_p99_ms: float
    itl_p50_ms: float
    itl_p99_ms: float
    itl_max_ms: float
    tps_per_stream: float  # median over requests of (output - 1) / (last - first token)
    exposed_p50_ms: float  # PD: last prefill forward's end -> KV complete on the decoder
    served_qps: float  # requests finished per second over the measured window
    busiest_utilisation: float  # busiest instance's busy fraction

    def as_dict(self) -> dict[str, float]:
        return {k: round(float(v), 3) for k, v in self.__dict__.items()}


@dataclass(frozen=True)
class MixedSetup:
    cost: StepCost
    instances: int
    chunk_tokens: int = 8192
    ranks: int = 1
    max_running: int = 256

    def run(self, requests: list[SimRequest]) -> tuple[list[SimRequest], list[float]]:
        clock = Clock()
        nodes = [
            MixedInstance(
                clock,
                self.cost,
                f"mixed{i}",
                chunk_tokens=self.chunk_tokens,
                ranks=self.ranks,
                max_running=self.max_running,
            )
            for i in range(self.instances)
        ]
        run_trace(clock, requests, lambda r: min(nodes, key=lambda n: n.load).submit(r))
        return requests, [n.busy_s / max(clock.now, 1e-9) for n in nodes]


@dataclass(frozen=True)
class PdSetup:
    prefill_cost: StepCost
    decode_cost: StepCost
    prefills: int
    decodes: int
    transfer: TransferModel
    chunk_tokens: int = 16384
    decode_ranks: int = 1
    max_running: int = 256
    # local prefill (`core.placement.prefill_locally`): the largest uncached suffix a
    # decoder prefills itself, one step of that many tokens at most; 0 = off
    local_prefill_max_tokens: int = 0
    saturated_tokens: int = 8192

    def run(self, requests: list[SimRequest]) -> tuple[list[SimRequest], list[float]]:
        clock = Clock()
        decoders = [
            DecodeInstance(
                clock,
                self.decode_cost,
                f"decode{i}",
                ranks=self.decode_ranks,
                max_running=self.max_running,
                local_step_tokens=self.local_prefill_max_tokens,
            )
            for i in range(self.decodes)
        ]
        target: dict[int, DecodeInstance] = {}

        def deliver(r: SimRequest) -> None:
            target.pop(r.id).receive(r)

        prefills = [
            PrefillInstance(
                clock,
                self.prefill_cost,
                f"prefill{i}",
                chunk_tokens=self.chunk_tokens,
                transfer=self.transfer,
                deliver=deliver,
            )
            for i in range(self.prefills)
        ]

        def submit(r: SimRequest) -> None:
            # the router picks both sides at arrival: fewest queued prefill tokens, and the
            # decoder holding the fewest requests (received and not finished; one still
            # prefilling elsewhere is not counted)
            decoder = min(decoders, key=lambda d: d.streams.load + len(d.local))
            loads = {p.name: PrefillerLoad(True, p.outstanding_tokens) for p in prefills}
            if prefill_locally(
                r.prompt_tokens, r.held_tokens, max_tokens=self.local_prefill_max_tokens,
                loads=loads, saturated_tokens=self.saturated_tokens,
            ):  # fmt: skip
                decoder.prefill_here(r)
                return
            target[r.id] = decoder
            min(prefills, key=lambda p: p.outstanding_tokens).submit(r)

        run_trace(clock, requests, submit)
        busy = [n.busy_s / max(clock.now, 1e-9) for n in (*prefills, *decoders)]
        return requests, busy


def figures(requests: list[SimRequest], busy: list[float], *, warmup: float = 0.2) -> Figures:
    """Figures over the requests after the first `warmup` fraction (the system filling)."""
    measured = [r for r in requests[int(len(requests) * warmup) :] if r.done]
    if not measured:
        raise ValueError("no request finished")
    ttft = np.array([(r.first_token or 0.0) - r.arrival for r in measured]) * 1e3
    gaps = np.concatenate([np.diff(r.token_times) for r in measured]) * 1e3
    rates = [
        (len(r.token_times) - 1) / (r.token_times[-1] - r.token_times[0])
        for r in measured
        if len(r.token_times) > 1 and r.token_times[-1] > r.token_times[0]
    ]
    exposed = [
        (r.kv_complete - r.forward_end) * 1e3
        for r in measured
        if r.kv_complete is not None and r.forward_end is not None
    ]
    gaps = gaps if gaps.size else np.zeros(1)
    return Figures(
        requests=len(measured),
        ttft_p50_ms=float(np.percentile(ttft, 50)),
        ttft_p99_ms=float(np.percentile(ttft, 99)),
        itl_p50_ms=float(np.percentile(gaps, 50)),
        itl_p99_ms=float(np.percentile(gaps, 99)),
        itl_max_ms=float(gaps.max()),
        tps_per_stream=statistics.median(rates) if rates else 0.0,
        exposed_p50_ms=statistics.median(exposed) if exposed else 0.0,
        served_qps=_served_qps(requests, warmup),
        busiest_utilisation=max(busy) if busy else 0.0,
    )


def _served_qps(requests: list[SimRequest], warmup: float) -> float:
    """Requests finished per second between the end of the warm-up and the last arrival:
    the offered rate when the deployment keeps up, less when work piles up."""
    start = requests[int(len(requests) * warmup)].arrival
    stop = requests[-1].arrival
    if stop <= start:
        return 0.0
    finished = sum(1 for r in requests if r.done and start <= r.token_times[-1] <= stop)
    return finished / (stop - start)
