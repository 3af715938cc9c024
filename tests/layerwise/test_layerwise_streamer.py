"""LayerStreamer driven one poll at a time (`step`) against a scripted counter and a manual
clock; a few tests run the real thread, waiting on events, never sleeping."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_pd.core.clock import ManualClock
from sgl_pd.layerwise import (
    ForwardJob,
    HostProgress,
    LayerStreamer,
    StepOutcome,
    StreamerError,
    encode,
)

WAIT_S = 5.0  # seconds a test waits for the streamer thread before failing


class ScriptedProgress:
    """A counter whose published value the test sets directly, as a poller would see it."""

    def __init__(self, num_layers: int) -> None:
        self.num_layers = num_layers
        self.value = encode(0, 0)
        self.reads = 0
        self.fail_reads = 0  # the next this-many reads raise
        self._generation = 0

    def read(self) -> int:
        self.reads += 1
        if self.fail_reads:
            self.fail_reads -= 1
            raise RuntimeError("scripted read failure")
        return self.value

    def begin_forward(self, generation: int, stream: object = None) -> None:
        self._generation = generation

    def record_layer(self, layer: int) -> None:
        self.value = encode(self._generation, layer + 1)

    def show(self, generation: int, layers_done: int) -> None:
        self.value = encode(generation, layers_done)


Call = tuple[str, int, tuple[int, int] | None]  # (kind, generation, (start, stop) of layers)


@dataclass
class Recorder:
    calls: list[Call] = field(default_factory=list)
    fail_layers_of: set[int] = field(default_factory=set)  # generations whose on_layers raise
    done: dict[int, threading.Event] = field(default_factory=dict)

    def on_layers(self, job: ForwardJob, layers: range) -> None:
        assert layers.step == 1
        self.calls.append(("layers", job.generation, (layers.start, layers.stop)))
        if job.generation in self.fail_layers_of:
            raise RuntimeError("glue bug")

    def on_forward_done(self, job: ForwardJob) -> None:
        self.calls.append(("done", job.generation, None))
        self.done.setdefault(job.generation, threading.Event()).set()

    def wait_done(self, generation: int) -> bool:
        return self.done.setdefault(generation, threading.Event()).wait(WAIT_S)


def make(
    counter: ScriptedProgress | HostProgress,
    rec: Recorder,
    clock: ManualClock | None = None,
    **kwargs: object,
) -> LayerStreamer:
    return LayerStreamer(
        counter,
        rec.on_layers,
        rec.on_forward_done,
        clock=clock or ManualClock(),
        sleep=lambda _s: None,
        **kwargs,  # type: ignore[arg-type]
    )


def drain(streamer: LayerStreamer) -> StepOutcome:
    """Steps until the streamer has nothing more to do with what the counter shows."""
    for _ in range(1000):
        outcome = streamer.step()
        if outcome is not StepOutcome.PROGRESS:
            return outcome
    raise AssertionError("the streamer kept reporting progress")


def test_reports_each_layer_in_order_then_the_end() -> None:
    counter, rec = ScriptedProgress(4), Recorder()
    streamer = make(counter, rec)
    streamer.submit(ForwardJob(1, "batch"))
    assert streamer.step() is StepOutcome.PROGRESS  # took the job; counter still at gen 0
    assert streamer.step() is StepOutcome.WAITING
    counter.begin_forward(1)
    for layer in range(4):
        counter.record_layer(layer)
        assert streamer.step() is StepOutcome.PROGRESS
    assert rec.calls == [
        ("layers", 1, (0, 1)),
        ("layers", 1, (1, 2)),
        ("layers", 1, (2, 3)),
        ("layers", 1, (3, 4)),
        ("done", 1, None),
    ]
    assert streamer.step() is StepOutcome.IDLE


def test_a_jump_is_one_call_covering_all_new_layers() -> None:
    counter, rec = ScriptedProgress(6), Recorder()
    streamer = make(counter, rec)
    streamer.submit(ForwardJob(3, None))
    counter.show(3, 3)
    assert drain(streamer) is StepOutcome.WAITING
    counter.show(3, 3)
    assert streamer.step() is StepOutcome.WAITING  # no new layer, no call
    counter.show(3, 6)
    drain(streamer)
    assert rec.calls == [("layers", 3, (0, 3)), ("layers", 3, (3, 6)), ("done", 3, None)]
    timeline = streamer.timeline(3)
    assert timeline is not None and timeline.layer_calls == 2
    assert not timeline.completed_by_newer


def test_values_of_an_older_generation_are_ignored() -> None:
    counter, rec = ScriptedProgress(61), Recorder()
    streamer = make(counter, rec)
    counter.show(4, 61)  # the previous forward's last value is still in the counter
    streamer.submit(ForwardJob(5, None))
    assert drain(streamer) is StepOutcome.WAITING
    assert rec.calls == []
    counter.show(5, 2)
    drain(streamer)
    assert rec.calls == [("layers", 5, (0, 2))]


def test_a_newer_generation_completes_the_current_job() -> None:
    counter, rec = ScriptedProgress(4), Recorder()
    streamer = make(counter, rec)
    streamer.submit(ForwardJob(1, None))
    streamer.submit(ForwardJob(2, None))
    counter.show(1, 2)
    drain(streamer)
    counter.show(2, 1)  # forward 1 ended and forward 2 began between two polls
    drain(streamer)
    assert rec.calls == [
        ("layers", 1, (0, 2)),
        ("layers", 1, (2, 4)),  # the layers we never saw finish are reported at once
        ("done", 1, None),
        ("layers", 2, (0, 1)),
    ]
    first, second = streamer.timeline(1), streamer.timeline(2)
    assert first is not None and first.completed_by_newer and first.done_s is not None
    assert second is not None and second.done_s is None


def test_a_newer_generation_before_any_layer_reports_the_whole_forward() -> None:
    counter, rec = ScriptedProgress(3), Recorder()
    streamer = make(counter, rec)
    streamer.submit(ForwardJob(1, None))
    counter.show(9, 0)
    drain(streamer)
    assert rec.calls == [("layers", 1, (0, 3)), ("done", 1, None)]


def test_jobs_are_followed_in_submission_order() -> None:
    counter, rec = ScriptedProgress(2), Recorder()
    streamer = make(counter, rec)
    for generation in (1, 2, 3):
        streamer.submit(ForwardJob(generation, f"batch-{generation}"))
    for generation in (1, 2, 3):
        counter.show(generation, 2)
        drain(streamer)
    assert [c for c in rec.calls if c[0] == "done"] == [("done", g, None) for g in (1, 2, 3)]
    assert [c[1] for c in rec.calls] == [1, 1, 2, 2, 3, 3]


def test_payload_is_handed_back_untouched() -> None:
    counter = ScriptedProgress(1)
    got: list[object] = []
    streamer = LayerStreamer(
        counter,
        lambda job, _layers: got.append(job.payload),
        lambda job: got.append(job.payload),
        clock=ManualClock(),
        sleep=lambda _s: None,
    )
    payload = object()
    streamer.submit(ForwardJob(1, payload))
    counter.show(1, 1)
    drain(streamer)
    assert got == [payload, payload]


def test_callback_exception_is_counted_and_the_job_goes_on() -> None:
    counter, rec = ScriptedProgress(2), Recorder(fail_layers_of={1})
    streamer = make(counter, rec)
    streamer.submit(ForwardJob(1, None))
    streamer.submit(ForwardJob(2, None))
    counter.show(1, 1)
    drain(streamer)
    counter.show(1, 2)
    drain(streamer)
    counter.show(2, 2)
    drain(streamer)
    assert streamer.errors == 2
    assert [c for c in rec.calls if c[0] == "done"] == [("done", 1, None), ("done", 2, None)]


def test_a_layer_count_beyond_num_layers_ends_the_forward() -> None:
    counter, rec = ScriptedProgress(2), Recorder()
    streamer = make(counter, rec)
    streamer.submit(ForwardJob(1, None))
    counter.show(1, 5)
    drain(streamer)
    assert rec.calls == [("layers", 1, (0, 2)), ("done", 1, None)]


def test_idle_step_does_not_read_the_counter() -> None:
    counter = ScriptedProgress(2)
    streamer = make(counter, Recorder())
    assert streamer.step() is StepOutcome.IDLE
    assert counter.reads == 0


def test_timeline_uses_the_injected_clock() -> None:
    clock = ManualClock(100.0)
    counter, rec = ScriptedProgress(4), Recorder()
    streamer = make(counter, rec, clock)
    streamer.submit(ForwardJob(1, None))
    assert streamer.timeline(1) is None  # not taken yet
    clock.advance(1.0)
    streamer.step()
    clock.advance(1.0)
    counter.show(1, 1)
    streamer.step()
    clock.advance(1.0)
    counter.show(1, 4)
    streamer.step()
    timeline = streamer.timeline(1)
    assert timeline is not None
    assert (timeline.taken_s, timeline.first_layers_s, timeline.done_s) == (101.0, 102.0, 103.0)
    # What the glue's end-to-end test shows: the first layer went out before the forward ended.
    assert timeline.first_layers_s is not None and timeline.done_s is not None
    assert timeline.first_layers_s < timeline.done_s


def test_timeline_memory_is_bounded() -> None:
    counter, rec = ScriptedProgress(1), Recorder()
    streamer = make(counter, rec, history=2)
    for generation in (1, 2, 3):
        streamer.submit(ForwardJob(generation, None))
        counter.show(generation, 1)
        drain(streamer)
    assert streamer.timeline(1) is None
    assert streamer.timeline(2) is not None and streamer.timeline(3) is not None


def test_submit_rejects_generations_out_of_order() -> None:
    streamer = make(ScriptedProgress(2), Recorder())
    streamer.submit(ForwardJob(5, None))
    for generation in (5, 4, -1):
        with pytest.raises(StreamerError):
            streamer.submit(ForwardJob(generation, None))


def test_bad_settings_are_rejected() -> None:
    for kwargs in ({"poll_interval_s": -1.0}, {"idle_timeout_s": 0.0}, {"history": 0}):
        with pytest.raises(StreamerError):
            make(ScriptedProgress(2), Recorder(), **kwargs)


@given(data=st.data())
@settings(max_examples=200, deadline=None)
def test_any_sequence_of_observations_reports_every_layer_once(data: st.DataObject) -> None:
    """Whatever subset of the published values the poller happens to see, each job gets
    its layers exactly once, in order and contiguous, then its end; jobs in FIFO order."""
    num_layers = data.draw(st.integers(1, 8), label="num_layers")
    gens = sorted(data.draw(st.sets(st.integers(0, 40), min_size=1, max_size=5), label="gens"))
    published = [encode(g, n) for g in gens for n in range(1, num_layers + 1)]
    seen = sorted(data.draw(st.lists(st.sampled_from(published), max_size=30), label="seen"))
    counter, rec = ScriptedProgress(num_layers), Recorder()
    streamer = make(counter, rec)
    for g in gens:
        streamer.submit(ForwardJob(g, None))
    drain(streamer)
    for value in [*seen, published[-1]]:  # the device always publishes the last value
        counter.value = value
        drain(streamer)
    assert streamer.step() is StepOutcome.IDLE

    order = [c[1] for c in rec.calls]
    assert order == sorted(order)  # no call for a job after a later job's
    for g in gens:
        mine = [c for c in rec.calls if c[1] == g]
        assert mine[-1] == ("done", g, None) and [c[0] for c in mine].count("done") == 1
        ranges = [c[2] for c in mine[:-1]]
        assert all(r is not None and r[0] < r[1] for r in ranges)
        assert [i for r in ranges if r is not None for i in range(*r)] == list(range(num_layers))
        timeline = streamer.timeline(g)
        assert timeline is not None and timeline.layer_calls == len(ranges)
        assert timeline.completed_by_newer == (encode(g, num_layers) not in seen and g != gens[-1])


# The real thread. It spins (injected no-op sleep) only while a job is active.


def test_thread_follows_a_host_counter() -> None:
    counter, rec = HostProgress(8), Recorder()
    streamer = make(counter, rec, name="sgl-pd-layer-test")
    streamer.start()
    try:
        for generation in (1, 2):
            streamer.submit(ForwardJob(generation, None))
            counter.begin_forward(generation)
            for layer in range(8):
                counter.record_layer(layer)
            assert rec.wait_done(generation)
    finally:
        assert streamer.stop(WAIT_S)
    for generation in (1, 2):
        layers = [c[2] for c in rec.calls if c[1] == generation and c[0] == "layers"]
        assert [i for r in layers if r is not None for i in range(*r)] == list(range(8))
    assert streamer.errors == 0


def test_thread_survives_callback_and_counter_exceptions() -> None:
    counter, rec = ScriptedProgress(2), Recorder(fail_layers_of={1})
    counter.fail_reads = 1
    streamer = make(counter, rec, name="sgl-pd-layer-test", idle_timeout_s=0.01)
    streamer.start()
    try:
        streamer.submit(ForwardJob(1, None))
        counter.show(1, 2)
        assert rec.wait_done(1)
        streamer.submit(ForwardJob(2, None))
        counter.show(2, 2)
        assert rec.wait_done(2)
    finally:
        assert streamer.stop(WAIT_S)
    assert streamer.errors == 2  # one failed read, one failed on_layers


def test_stop_joins_promptly_when_idle_and_when_busy() -> None:
    idle = make(ScriptedProgress(2), Recorder(), name="sgl-pd-layer-idle", idle_timeout_s=30.0)
    busy = make(ScriptedProgress(2), Recorder(), name="sgl-pd-layer-busy")
    idle.start()
    busy.start()
    busy.submit(ForwardJob(1, None))  # never progresses: the thread keeps polling
    start = time.monotonic()
    assert idle.stop(WAIT_S)  # woken by stop, not by its 30 s idle timeout
    assert busy.stop(WAIT_S)
    assert time.monotonic() - start < WAIT_S
    assert [j.generation for j in busy.unfinished()] == [1]
    with pytest.raises(StreamerError):
        busy.submit(ForwardJob(2, None))
    with pytest.raises(StreamerError):
        busy.start()


def test_step_belongs_to_the_running_thread() -> None:
    streamer = make(ScriptedProgress(2), Recorder(), name="sgl-pd-layer-test")
    streamer.start()
    try:
        with pytest.raises(StreamerError):
            streamer.step()
    finally:
        assert streamer.stop(WAIT_S)
