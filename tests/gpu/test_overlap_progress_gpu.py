"""Two forwards in flight, as SGLang's overlap scheduler runs them: forward A records its
layers slowly on the forward stream while the scheduler thread, whose current stream is
another one, publishes forward B's generation (D8). Skipped without a CUDA device.

Published on the forward's stream (what the glue does), B's generation waits behind all
of A's layer records, so the host never reads one of A's layers as B's. Published on the
scheduler's stream (the bug it fixes), it overtakes A and A's remaining layers come out
under B's generation before B has started.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
from gpu_marks import GPU_ONLY

from sgl_pd.backend.prefill.layerwise_glue import forward_stream_of
from sgl_pd.layerwise import CudaProgress, decode, encode

pytestmark = GPU_ONLY

NUM_LAYERS = 8
HIDDEN = 4096
TOKENS = 4096  # (TOKENS, HIDDEN) @ (HIDDEN, HIDDEN) in bf16: ~137 GFLOP per matmul
MATMULS_PER_LAYER = 2
SLEEP_CYCLES = 4_000_000  # GPU cycles (~2 ms) of spin per layer: A runs for ~20 ms
GEN_A, GEN_B = 1, 2
WAIT_S = 10.0  # seconds a test waits for the device or the poller before failing


@dataclass(frozen=True)
class Seen:
    """One distinct reading of the host: the counter, then whether B had begun."""

    generation: int
    layers_done: int
    b_started: bool


@dataclass
class Run:
    seen: list[Seen] = field(default_factory=list)
    published_b_at: tuple[int, int] = (0, 0)  # the counter when B's generation was published


class Poller:
    """Reads the counter, then B's start flag, keeping each distinct pair, until it reads
    B's last layer. The device writes the flag before any of B's layer records, on the same
    stream, so a value of B read before the flag is set cannot be one of B's layers."""

    def __init__(self, read: Any, b_started: Any) -> None:
        self.seen: list[Seen] = []
        self._read = read
        self._b_started = b_started
        self._thread = threading.Thread(target=self._run, name="test-overlap-poller")

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), f"never saw B's last layer: {self.seen}"

    def _run(self) -> None:
        deadline = time.monotonic() + WAIT_S
        last = encode(GEN_B, NUM_LAYERS)
        previous: Seen | None = None
        while time.monotonic() < deadline:
            value = self._read()
            started = bool(self._b_started[0])
            generation, layers_done = decode(value)
            seen = Seen(generation, layers_done, started)
            if seen != previous:
                self.seen.append(seen)
                previous = seen
            if value == last and started:
                return
            time.sleep(0)  # yields the GIL to the thread launching the forwards


def _wait_for_layer_of_a(counter: CudaProgress) -> tuple[int, int]:
    """Spins until A has published a layer, so B is published while A is running."""
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        generation, layers_done = decode(counter.read())
        if generation == GEN_A and layers_done >= 1:
            return generation, layers_done
        time.sleep(0)
    raise AssertionError("forward A published no layer")


def _two_forwards_in_flight(publish_b_on_forward_stream: bool) -> Run:
    torch: Any = pytest.importorskip("torch")

    torch.manual_seed(0)
    counter = CudaProgress(NUM_LAYERS)
    weights = [
        torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN**0.5
        for _ in range(NUM_LAYERS)
    ]
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)
    b_started = torch.zeros(1, dtype=torch.int64, pin_memory=True)  # (1,) 1 once B began
    one = torch.ones(1, dtype=torch.int64, device="cuda")
    # The streams of SGLang's overlap scheduler: the scheduler thread runs with
    # schedule_stream current; run_batch runs each forward on forward_stream.
    schedule_stream, forward_stream = torch.cuda.Stream(), torch.cuda.Stream()
    scheduler = SimpleNamespace(enable_overlap=True, forward_stream=forward_stream)

    def forward(slow: bool) -> None:
        h = x
        for layer, w in enumerate(weights):
            for _ in range(MATMULS_PER_LAYER):
                h = h @ w  # stands in for attention + o_proj
            if slow and hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(SLEEP_CYCLES)
            counter.record_layer(layer)

    with torch.cuda.stream(forward_stream):  # cuBLAS and the allocator warm, off the clock
        counter.begin_forward(0)
        forward(slow=False)
    torch.cuda.synchronize()

    run = Run()
    with Poller(counter.read, b_started.numpy()) as poller, torch.cuda.stream(schedule_stream):
        counter.begin_forward(GEN_A, stream=forward_stream_of(scheduler))
        with torch.cuda.stream(forward_stream):  # run_batch: forward_stream_ctx
            forward_stream.wait_stream(schedule_stream)
            forward(slow=True)
        run.published_b_at = _wait_for_layer_of_a(counter)
        b_stream = forward_stream_of(scheduler) if publish_b_on_forward_stream else None
        counter.begin_forward(GEN_B, stream=b_stream)
        with torch.cuda.stream(forward_stream):
            forward_stream.wait_stream(schedule_stream)
            b_started.copy_(one, non_blocking=True)
            forward(slow=True)
        torch.cuda.synchronize()
    run.seen = poller.seen
    return run


def _a_layers_read_as_b(run: Run) -> list[Seen]:
    return [s for s in run.seen if s.generation == GEN_B and not s.b_started]


def test_generation_on_the_forward_stream_keeps_a_layers_under_a() -> None:
    run = _two_forwards_in_flight(publish_b_on_forward_stream=True)
    assert run.published_b_at[1] < NUM_LAYERS, f"A had ended before B was published: {run}"
    assert _a_layers_read_as_b(run) == []
    values = [encode(s.generation, s.layers_done) for s in run.seen]
    assert values == sorted(values), f"published values went backwards: {run.seen}"
    assert (GEN_A, NUM_LAYERS) in [(s.generation, s.layers_done) for s in run.seen]
    assert (run.seen[-1].generation, run.seen[-1].layers_done) == (GEN_B, NUM_LAYERS)


def test_generation_on_the_scheduler_stream_relabels_a_layers(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The bug, kept as documentation: what the glue did before it passed the stream."""
    with caplog.at_level(logging.WARNING, "sgl_pd.layerwise.progress"):
        run = _two_forwards_in_flight(publish_b_on_forward_stream=False)
    assert run.published_b_at[1] < NUM_LAYERS, f"A had ended before B was published: {run}"
    wrong = _a_layers_read_as_b(run)
    assert wrong, f"expected A's later layers under B's generation: {run.seen}"
    assert all(1 <= s.layers_done <= NUM_LAYERS for s in wrong)
    assert "begin_forward ran on" in caplog.text  # the counter's own check noticed
