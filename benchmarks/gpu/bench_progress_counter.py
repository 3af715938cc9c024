"""Observation lag and forward-time cost of `CudaProgress` under CUDA-graph replay (D8).

Workload: `--layers` prefill-shaped layers on (tokens, hidden) bf16 activations, each a
GEMM-only stand-in for a transformer layer: o_proj (hidden x hidden), then an MLP
(hidden -> ffn -> hidden). `record_layer(i)` follows o_proj, where the SGLang glue hooks
it. One weight set is shared by all layers (same FLOPs per layer, ~0.6 GB instead of
~38 GB at R1's sizes). Three CUDA graphs are captured from the same forward: with the
counter (A), without it (B), and with the counter plus one timing event before each
`record_layer` (C, for lag only).

Lag (how long after a layer ended the host knew): per replay of C, the event E_i records
on the device the moment layer i's o_proj ended (just before its counter copy). The
host's view comes from a poller: (a) the real `LayerStreamer` (default poll interval),
whose `on_layers` callback stamps `time.monotonic()` for each layer it reports, and (b) a
bare spin loop reading the counter (the floor, what the pinned-memory path costs alone).
Event times are device times; they are mapped to host time with brackets taken before
and after each replay on the idle stream: t0 = host time; record event R; wait for it;
t1 = host time. R ran on the device between t0 and t1, so the host-minus-device offset
lies in [t0 - d_R, t1 - d_R]; intersecting K brackets gives a tight interval whose
midpoint is used, interpolated linearly between the "before" and "after" sets (absorbs
the drift of the GPU timer against CLOCK_MONOTONIC over one replay). The half-width is
printed as the clock-mapping uncertainty. lag_i = seen_i - (d_Ei + offset(d_Ei)); p50 and
p99 are over all layers of all replays.

Cost: A and B are replayed in interleaved pairs (order alternating), each timed with
events around `begin_forward` (A only) + replay, after a ~0.5 ms GPU sleep so host launch
gaps are not timed. Cost = median over pairs of (t_A / t_B - 1), in %. No poller runs
then: the poller only reads host memory and never touches the device.

Targets: lag p99 < 50 us, cost < 1 %. The last line printed is one JSON object with
`lag_p50_us`, `lag_p99_us` (streamer), `overhead_pct` (first --tokens size) and more.

    python benchmarks/gpu/bench_progress_counter.py --quick   # ~1 minute with CUDA init
    python benchmarks/gpu/bench_progress_counter.py           # R1-like sizes, ~2 minutes

Needs torch >= 2.8 for timing events inside graphs (`torch.cuda.Event(external=True)`);
on older torch the lag columns are null and the cost is still measured.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a bare checkout

import numpy as np

from sgl_pd.core.clock import SystemClock
from sgl_pd.layerwise import (
    CudaProgress,
    ForwardJob,
    LayerStreamer,
    decode,
    encode,
)

LAG_TARGET_US = 50.0  # us, p99
COST_TARGET_PCT = 1.0  # % of forward time
GPU_SLEEP_CYCLES = 1_000_000  # GPU cycles (~0.5 ms) queued before a timed replay
US = 1e6  # us per s


@dataclass(frozen=True)
class Shape:
    layers: int
    tokens: int
    hidden: int
    ffn: int


@dataclass
class Result:
    shape: Shape
    fwd_ms: float | None = None  # median replay time without the counter, ms
    fwd_counter_ms: float | None = None  # median replay time with it, ms
    overhead_pct: float | None = None
    overhead_iqr_pct: tuple[float, float] | None = None
    lag_us: dict[str, tuple[float, float] | None] | None = None  # poller -> (p50, p99) us
    sync_uncertainty_us: float | None = None
    note: str = ""


class Model:
    """Shared weights and a static input; `forward` is what every graph captures."""

    def __init__(self, torch: Any, shape: Shape, counter: CudaProgress) -> None:
        self.torch = torch
        self.shape = shape
        self.counter = counter
        bf16, h, f = torch.bfloat16, shape.hidden, shape.ffn
        self.w_o = torch.randn(h, h, device="cuda", dtype=bf16) / h**0.5  # (hidden, hidden)
        self.w_up = torch.randn(h, f, device="cuda", dtype=bf16) / h**0.5  # (hidden, ffn)
        self.w_down = torch.randn(f, h, device="cuda", dtype=bf16) / f**0.5  # (ffn, hidden)
        self.x = torch.randn(shape.tokens, h, device="cuda", dtype=bf16)  # (tokens, hidden)

    def forward(self, record: bool, events: list[Any] | None) -> Any:
        h = self.x
        for i in range(self.shape.layers):
            a = h @ self.w_o  # (tokens, hidden): the attention output projection
            if events is not None:
                events[i].record()
            if record:
                self.counter.record_layer(i)
            m = self.torch.relu_(a @ self.w_up)  # (tokens, ffn)
            h = m @ self.w_down  # (tokens, hidden)
        return h

    def capture(self, record: bool, events: list[Any] | None) -> Any:
        torch = self.torch
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up cuBLAS and the allocator off the capture
            self.counter.begin_forward(0)
            for _ in range(2):
                self.forward(record, events)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.forward(record, events)
        torch.cuda.synchronize()
        return graph


class Generations:
    def __init__(self) -> None:
        self._next = 1  # 0 is the warm-up's

    def take(self) -> int:
        self._next += 1
        return self._next - 1


class StreamerObserver:
    """The real LayerStreamer; per-layer host times stamped in its `on_layers`."""

    def __init__(self, counter: CudaProgress, poll_interval_s: float) -> None:
        self._seen: dict[int, list[float]] = {}
        self._done: dict[int, threading.Event] = {}
        self._streamer = LayerStreamer(
            counter,
            self._on_layers,
            lambda job: self._done[job.generation].set(),
            clock=SystemClock(),
            poll_interval_s=poll_interval_s,
            name="sgl-pd-layer-streamer-bench",
        )
        self._streamer.start()

    def _on_layers(self, job: ForwardJob, layers: range) -> None:
        now = time.monotonic()
        self._seen[job.generation].extend(now for _ in layers)

    def arm(self, generation: int) -> None:
        self._seen[generation] = []
        self._done[generation] = threading.Event()
        self._streamer.submit(ForwardJob(generation, None))

    def wait(self, generation: int, timeout_s: float) -> list[float]:
        if not self._done[generation].wait(timeout_s):
            raise TimeoutError(f"the streamer did not finish generation {generation}")
        return self._seen.pop(generation)

    def close(self) -> None:
        if not self._streamer.stop(5.0) or self._streamer.errors:
            raise RuntimeError(f"streamer: stop failed or {self._streamer.errors} errors")


class SpinObserver:
    """A bare loop reading the counter and stamping every change (GIL yielded each read)."""

    def __init__(self, counter: CudaProgress, num_layers: int) -> None:
        self._read = counter.read
        self._num_layers = num_layers
        self._changes: list[tuple[float, int]] = []  # (host s, value), appended by the thread
        self._target = -1
        self._reached = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="bench-spin-poller", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        previous = -1
        while not self._stop.is_set():
            value = self._read()
            if value != previous:
                self._changes.append((time.monotonic(), value))
                previous = value
                if value >= self._target >= 0:
                    self._reached.set()
            time.sleep(0)

    def arm(self, generation: int) -> None:
        self._changes.clear()
        self._reached.clear()
        self._target = encode(generation, self._num_layers)

    def wait(self, generation: int, timeout_s: float) -> list[float]:
        if not self._reached.wait(timeout_s):
            raise TimeoutError(f"the spin poller never saw generation {generation} end")
        seen: list[float] = []
        for t, value in list(self._changes):
            gen, done = decode(value)
            if gen < generation:
                continue
            done = self._num_layers if gen > generation else done
            seen.extend(t for _ in range(len(seen), done))
        return seen

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5.0)


class ClockMap:
    """Device event time -> host monotonic time, from brackets around idle-stream events."""

    def __init__(self, torch: Any, brackets: int) -> None:
        self._torch = torch
        self._k = brackets
        self.base = torch.cuda.Event(enable_timing=True)  # device time 0 of this replay

    def start(self) -> tuple[float, float, float]:
        self.base.record()
        self.base.synchronize()
        return self._offset()

    def _offset(self) -> tuple[float, float, float]:
        """(device s, offset s, half-width s) from K brackets taken now."""
        lo, hi, ds = -np.inf, np.inf, []
        for _ in range(self._k):
            ev = self._torch.cuda.Event(enable_timing=True)
            t0 = time.monotonic()
            ev.record()
            ev.synchronize()
            t1 = time.monotonic()
            d = self.base.elapsed_time(ev) / 1e3  # s since base, device clock
            lo, hi = max(lo, t0 - d), min(hi, t1 - d)
            ds.append(d)
        if lo > hi:  # clocks disagree beyond a bracket (rounding of 0.5 us event times)
            lo, hi = hi, lo
        return float(np.mean(ds)), (lo + hi) / 2, (hi - lo) / 2

    def finish(self, pre: tuple[float, float, float]) -> tuple[Callable[[float], float], float]:
        """A device-s -> host-s mapping interpolated between `pre` and brackets taken now."""
        post = self._offset()
        (d0, o0, h0), (d1, o1, h1) = pre, post
        slope = (o1 - o0) / (d1 - d0) if d1 > d0 else 0.0

        def to_host(d: float) -> float:
            return d + o0 + slope * (d - d0)

        return to_host, max(h0, h1)


def measure_lag(
    torch: Any,
    model: Model,
    graph: Any,
    events: list[Any],
    observer: StreamerObserver | SpinObserver,
    gens: Generations,
    reps: int,
    brackets: int,
    timeout_s: float,
) -> tuple[list[float], float]:
    lags: list[float] = []  # us
    uncertainty = 0.0  # us
    for _ in range(reps):
        generation = gens.take()
        observer.arm(generation)
        model.counter.begin_forward(generation)
        clock = ClockMap(torch, brackets)
        pre = clock.start()
        graph.replay()
        torch.cuda.synchronize()
        seen = observer.wait(generation, timeout_s)
        to_host, half = clock.finish(pre)
        uncertainty = max(uncertainty, half * US)
        for i, ev in enumerate(events):
            ended = to_host(clock.base.elapsed_time(ev) / 1e3)
            lags.append((seen[i] - ended) * US)
    return lags, uncertainty


def measure_cost(
    torch: Any, model: Model, with_counter: Any, without: Any, gens: Generations, pairs: int
) -> tuple[float, float, float, tuple[float, float]]:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    sleep = getattr(torch.cuda, "_sleep", None)

    def timed(counter: bool) -> float:
        if sleep is not None:
            sleep(GPU_SLEEP_CYCLES)
        start.record()
        if counter:
            model.counter.begin_forward(gens.take())
            with_counter.replay()
        else:
            without.replay()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))  # ms

    for _ in range(2):  # clocks up, caches warm
        timed(True)
        timed(False)
    a_ms, b_ms, ratios = [], [], []
    for k in range(pairs):
        if k % 2 == 0:
            a, b = timed(True), timed(False)
        else:
            b, a = timed(False), timed(True)
        a_ms.append(a)
        b_ms.append(b)
        ratios.append((a / b - 1.0) * 100.0)
    q1, q3 = np.percentile(ratios, [25, 75])
    return (
        float(np.median(b_ms)),
        float(np.median(a_ms)),
        float(np.median(ratios)),
        (float(q1), float(q3)),
    )


def run_shape(torch: Any, shape: Shape, args: argparse.Namespace) -> Result:
    result = Result(shape)
    counter = CudaProgress(shape.layers)
    model = Model(torch, shape, counter)
    gens = Generations()
    graph_a = model.capture(record=True, events=None)
    graph_b = model.capture(record=False, events=None)
    fwd, fwd_counter, cost, iqr = measure_cost(
        torch, model, graph_a, graph_b, gens, args.overhead_pairs
    )
    result.fwd_ms, result.fwd_counter_ms = fwd, fwd_counter
    result.overhead_pct, result.overhead_iqr_pct = cost, iqr

    try:
        events = [torch.cuda.Event(enable_timing=True, external=True) for _ in range(shape.layers)]
        graph_c = model.capture(record=True, events=events)
    except (TypeError, RuntimeError) as e:
        result.note = f"no lag: timing events inside CUDA graphs need torch >= 2.8 ({e})"
        return result
    result.lag_us = {}
    uncertainty = 0.0
    observers: list[tuple[str, Callable[[], StreamerObserver | SpinObserver]]] = [
        ("streamer", lambda: StreamerObserver(counter, args.poll_interval_us / US)),
        ("spin", lambda: SpinObserver(counter, shape.layers)),
    ]
    for name, make in observers:
        observer = make()
        try:
            lags, half = measure_lag(
                torch,
                model,
                graph_c,
                events,
                observer,
                gens,
                args.lag_reps,
                args.brackets,
                args.timeout_s,
            )
        finally:
            observer.close()
        p50, p99 = np.percentile(lags, [50, 99])
        result.lag_us[name] = (float(p50), float(p99))
        uncertainty = max(uncertainty, half)
    result.sync_uncertainty_us = uncertainty
    del graph_a, graph_b, graph_c
    return result


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(results: list[Result]) -> None:
    head = (
        f"{'layers':>6} {'tokens':>6} {'hidden':>6} {'ffn':>6} {'fwd ms':>9} {'+ctr ms':>9} "
        f"{'cost %':>7} {'cost IQR %':>14} {'lag p50/p99 us':>15} {'spin p50/p99':>13} "
        f"{'+/- us':>6}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        s = r.shape
        lag = (r.lag_us or {}).get("streamer")
        spin = (r.lag_us or {}).get("spin")
        iqr = r.overhead_iqr_pct
        print(
            f"{s.layers:>6} {s.tokens:>6} {s.hidden:>6} {s.ffn:>6} {_fmt(r.fwd_ms, '.3f'):>9} "
            f"{_fmt(r.fwd_counter_ms, '.3f'):>9} {_fmt(r.overhead_pct, '.3f'):>7} "
            f"{('-' if iqr is None else f'{iqr[0]:.2f}..{iqr[1]:.2f}'):>14} "
            f"{('-' if lag is None else f'{lag[0]:.1f}/{lag[1]:.1f}'):>15} "
            f"{('-' if spin is None else f'{spin[0]:.1f}/{spin[1]:.1f}'):>13} "
            f"{_fmt(r.sync_uncertainty_us):>6}"
        )
        if r.note:
            print(f"  note: {r.note}")
    print(f"targets: lag p99 < {LAG_TARGET_US:.0f} us (streamer), cost < {COST_TARGET_PCT} %")


def summary(results: list[Result]) -> dict[str, Any]:
    first = results[0]
    lag = (first.lag_us or {}).get("streamer")
    spin = (first.lag_us or {}).get("spin")
    out: dict[str, Any] = {
        "lag_p50_us": None if lag is None else round(lag[0], 2),
        "lag_p99_us": None if lag is None else round(lag[1], 2),
        "overhead_pct": None if first.overhead_pct is None else round(first.overhead_pct, 4),
        "spin_lag_p50_us": None if spin is None else round(spin[0], 2),
        "spin_lag_p99_us": None if spin is None else round(spin[1], 2),
        "clock_sync_uncertainty_us": first.sync_uncertainty_us,
        "by_shape": [
            {
                "layers": r.shape.layers,
                "tokens": r.shape.tokens,
                "hidden": r.shape.hidden,
                "ffn": r.shape.ffn,
                "fwd_ms": r.fwd_ms,
                "overhead_pct": r.overhead_pct,
                "lag_us": r.lag_us,
                "note": r.note or None,
            }
            for r in results
        ],
    }
    if lag is not None and first.overhead_pct is not None:
        out["meets_targets"] = lag[1] < LAG_TARGET_US and first.overhead_pct < COST_TARGET_PCT
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--layers", type=int, default=61)
    p.add_argument("--hidden", type=int, default=7168)
    p.add_argument("--ffn", type=int, default=18432)
    p.add_argument("--tokens", default="4096,512", help="comma list; the first is reported")
    p.add_argument("--lag-reps", type=int, default=20, help="replays per poller")
    p.add_argument("--overhead-pairs", type=int, default=30)
    p.add_argument("--brackets", type=int, default=16, help="clock brackets per side")
    p.add_argument("--poll-interval-us", type=float, default=20.0, help="the streamer's")
    p.add_argument("--timeout-s", type=float, default=30.0, help="wait for a poller, s")
    p.add_argument("--quick", action="store_true", help="small sizes, few reps (~1 minute)")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.ffn, args.tokens = 2048, 4096, "1024"
        args.lag_reps, args.overhead_pairs = 5, 8
    return args


def _no_cuda_result(reason: str) -> dict[str, Any]:
    return {"lag_p50_us": None, "lag_p99_us": None, "overhead_pct": None, "skipped": reason}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import torch
    except ImportError:
        print("torch is not installed: nothing to measure")
        print(json.dumps(_no_cuda_result("no CUDA device")))
        return 0
    if not torch.cuda.is_available():
        print("no CUDA device (torch.cuda.is_available() is False): nothing to measure")
        print(json.dumps(_no_cuda_result("no CUDA device")))
        return 0
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    results = []
    try:
        for tokens in (int(t) for t in args.tokens.split(",")):
            shape = Shape(args.layers, tokens, args.hidden, args.ffn)
            print(f"measuring {shape} ...", flush=True)
            results.append(run_shape(torch, shape, args))
            torch.cuda.empty_cache()
    except Exception as e:  # still end with the JSON line the caller parses
        if results:
            print_table(results)
        out = summary(results) if results else _no_cuda_result("")
        out.pop("skipped", None)
        out["error"] = f"{type(e).__name__}: {e}"
        print(json.dumps(out))
        return 1
    print_table(results)
    print(json.dumps(summary(results)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
