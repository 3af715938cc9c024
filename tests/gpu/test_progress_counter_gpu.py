"""CudaProgress inside a captured CUDA graph: a host thread sees per-layer values of the
generation set before each replay (D8). Skipped without a CUDA device."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from gpu_marks import GPU_ONLY

from sgl_pd.core.clock import SystemClock
from sgl_pd.layerwise import (
    CudaProgress,
    ForwardJob,
    LayerStreamer,
    ProgressError,
    decode,
    encode,
)

pytestmark = GPU_ONLY

NUM_LAYERS = 8
HIDDEN = 2048
TOKENS = 4096  # (TOKENS, HIDDEN) activations: ~34 GFLOP per layer
SLEEP_CYCLES = 200_000  # GPU cycles (~0.1 ms) of spin per layer, so layers are far apart
WAIT_S = 10.0  # seconds a test waits for the host side before failing


@dataclass
class Captured:
    counter: CudaProgress
    graph: Any  # torch.cuda.CUDAGraph, replays NUM_LAYERS layers with record_layer after each


@pytest.fixture(scope="module")
def captured() -> Iterator[Captured]:
    torch: Any = pytest.importorskip("torch")

    torch.manual_seed(0)
    counter = CudaProgress(NUM_LAYERS)
    weights = [
        torch.randn(HIDDEN, HIDDEN, device="cuda", dtype=torch.bfloat16) / HIDDEN**0.5
        for _ in range(NUM_LAYERS)
    ]
    x = torch.randn(TOKENS, HIDDEN, device="cuda", dtype=torch.bfloat16)

    def forward() -> Any:
        h = x
        for layer, w in enumerate(weights):
            h = h @ w  # stands in for attention + o_proj
            if hasattr(torch.cuda, "_sleep"):
                torch.cuda._sleep(SLEEP_CYCLES)
            counter.record_layer(layer)
        return h

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up kernels and the allocator off the capture
        counter.begin_forward(0)
        for _ in range(2):
            forward()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        forward()
    torch.cuda.synchronize()
    yield Captured(counter, graph)
    del graph


class Poller:
    """Spins on the counter, keeping each distinct value, until it reads `last`."""

    def __init__(self, read: Callable[[], int], last: int) -> None:
        self.values: list[int] = []
        self._read = read
        self._last = last
        self._thread = threading.Thread(target=self._run, name="test-progress-poller")

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), f"never saw {decode(self._last)}: {self.decoded()}"

    def _run(self) -> None:
        deadline = time.monotonic() + WAIT_S
        previous = -1
        while time.monotonic() < deadline:
            value = self._read()
            if value != previous:
                self.values.append(value)
                previous = value
                if value == self._last:
                    return
            time.sleep(0)  # yields the GIL to the thread launching the replay

    def decoded(self) -> list[tuple[int, int]]:
        return [decode(v) for v in self.values]


def test_replay_publishes_layers_of_the_current_generation(captured: Captured) -> None:
    import torch

    for generation in (1, 2, 3):
        with Poller(captured.counter.read, encode(generation, NUM_LAYERS)) as poller:
            captured.counter.begin_forward(generation)
            captured.graph.replay()
            torch.cuda.synchronize()
        mine = [n for g, n in poller.decoded() if g == generation]
        assert all(g <= generation for g, _ in poller.decoded())
        assert mine == sorted(set(mine)), "values of one forward must be distinct and rising"
        assert mine[-1] == NUM_LAYERS
        assert len(mine) >= 2, f"only the end was seen, not per-layer progress: {mine}"


def test_back_to_back_replays_publish_in_generation_order(captured: Captured) -> None:
    import torch

    with Poller(captured.counter.read, encode(6, NUM_LAYERS)) as poller:
        # The host runs ahead of the device: all three are queued before the first ends.
        for generation in (4, 5, 6):
            captured.counter.begin_forward(generation)
            captured.graph.replay()
        torch.cuda.synchronize()
    assert poller.values == sorted(poller.values)
    assert all(1 <= n <= NUM_LAYERS for _, n in poller.decoded())


def test_streamer_follows_graph_replays(captured: Captured) -> None:
    import torch

    done = {g: threading.Event() for g in (7, 8, 9)}
    layers: dict[int, list[int]] = {g: [] for g in done}
    streamer = LayerStreamer(
        captured.counter,
        lambda job, r: layers[job.generation].extend(r),
        lambda job: done[job.generation].set(),
        clock=SystemClock(),
        name="sgl-pd-layer-streamer-gpu-test",
    )
    streamer.start()
    try:
        for generation in done:
            streamer.submit(ForwardJob(generation, None))
            captured.counter.begin_forward(generation)
            captured.graph.replay()
        torch.cuda.synchronize()
        assert all(event.wait(WAIT_S) for event in done.values())
    finally:
        assert streamer.stop(WAIT_S)
    assert streamer.errors == 0
    for generation in done:
        assert layers[generation] == list(range(NUM_LAYERS))
        timeline = streamer.timeline(generation)
        assert timeline is not None and timeline.first_layers_s is not None
        assert timeline.done_s is not None and timeline.first_layers_s <= timeline.done_s


def test_begin_forward_inside_a_capture_is_refused(captured: Captured) -> None:
    import torch

    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ProgressError), torch.cuda.graph(graph):
        captured.counter.begin_forward(10)


def test_eager_record_layer_publishes_after_the_copy_lands() -> None:
    import torch

    counter = CudaProgress(3)
    counter.begin_forward(11)
    counter.record_layer(0)
    counter.record_layer(1)
    torch.cuda.synchronize()
    assert decode(counter.read()) == (11, 2)


def test_forward_on_another_stream_than_begin_forward_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import torch

    counter = CudaProgress(2)
    counter.begin_forward(1)  # on the default stream
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with caplog.at_level(logging.WARNING, "sgl_pd.layerwise.progress"), torch.cuda.stream(side):
        counter.record_layer(0)
    torch.cuda.synchronize()
    assert "begin_forward ran on" in caplog.text
