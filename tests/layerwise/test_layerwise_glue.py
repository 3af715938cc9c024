"""The SGLang glue's decisions that need no SGLang server: the layer-count check at start-up
and the stream each forward's generation is published on (D8)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from sgl_pd.backend.prefill import layerwise_glue as glue
from sgl_pd.errors import ConfigError
from sgl_pd.layerwise import ForwardJob, HostProgress, LayerStreamer

WAIT_S = 5.0  # seconds a test waits for a streamer thread to stop


@dataclass
class FakeMessenger:
    """What attach_messenger and the streamer's callbacks use of a PrefillMessenger."""

    num_layers: int  # the KV layout's, draft layers included
    draft_layers: int = 0
    written: list[tuple[object, range]] = field(default_factory=list)
    state_written: list[tuple[object, frozenset[int]]] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def layout(self) -> SimpleNamespace:
        return SimpleNamespace(num_layers=self.num_layers, page_size=1)

    def write_layers(
        self, payload: object, layers: range, state_layers: frozenset[int] = frozenset()
    ) -> None:
        self.written.append((payload, layers))
        if state_layers:
            self.state_written.append((payload, state_layers))

    def forward_done(self, payload: object) -> None:
        self.done.set()


@dataclass
class StreamRecorder:
    """A counter that remembers where each generation was published."""

    num_layers: int = 2
    begun: list[tuple[int, Any]] = field(default_factory=list)

    def read(self) -> int:
        return 0

    def begin_forward(self, generation: int, stream: Any = None) -> None:
        self.begun.append((generation, stream))

    def record_layer(self, layer: int) -> None:
        pass


@dataclass
class SubmitRecorder:
    jobs: list[ForwardJob] = field(default_factory=list)

    def submit(self, job: ForwardJob) -> None:
        self.jobs.append(job)


@pytest.fixture
def process(monkeypatch: pytest.MonkeyPatch) -> Iterator[glue._Process]:
    """A fresh per-process glue state; stops any streamer a test started."""
    fresh = glue._Process()
    monkeypatch.setattr(glue, "_process", fresh)
    yield fresh
    if isinstance(fresh.streamer, LayerStreamer):
        assert fresh.streamer.stop(WAIT_S)


def test_attach_refuses_hooks_and_kv_layout_of_different_layer_counts(
    process: glue._Process,
) -> None:
    process.counter = HostProgress(4)
    with pytest.raises(ConfigError, match=r"of 4 layers.* 5 layers.*--pd-kv-send after-forward"):
        glue.attach_messenger(FakeMessenger(num_layers=5), layerwise=True)
    assert process.streamer is None  # nothing started


@pytest.mark.parametrize("draft_layers", [0, 1])
def test_attach_starts_a_streamer_when_the_layer_counts_agree(
    process: glue._Process, draft_layers: int
) -> None:
    """A draft (MTP) layer in the KV layout is not the streamer's: it streams the target's."""
    counter = process.counter = HostProgress(3)
    messenger = FakeMessenger(num_layers=3 + draft_layers, draft_layers=draft_layers)
    streamer = glue.attach_messenger(messenger, layerwise=True)
    assert streamer is not None and streamer is process.streamer
    streamer.submit(ForwardJob(1, "chunks of forward 1"))
    counter.begin_forward(1)
    for layer in range(3):
        counter.record_layer(layer)
    assert messenger.done.wait(WAIT_S)
    layers = [i for payload, r in messenger.written for i in r if payload == "chunks of forward 1"]
    assert layers == [0, 1, 2]


def test_attach_in_after_forward_mode_needs_no_counter(process: glue._Process) -> None:
    messenger = FakeMessenger(num_layers=5)
    assert glue.attach_messenger(messenger, layerwise=False) is None
    assert process.messenger is messenger


def test_check_layer_counts_names_both_numbers() -> None:
    glue.check_layer_counts(61, 61)
    with pytest.raises(ConfigError) as info:
        glue.check_layer_counts(61, 62)
    assert "61" in str(info.value) and "62" in str(info.value)


def test_forward_stream_follows_the_overlap_scheduler() -> None:
    forward_stream = object()
    overlap = SimpleNamespace(enable_overlap=True, forward_stream=forward_stream)
    normal = SimpleNamespace(enable_overlap=False, forward_stream=forward_stream)
    assert glue.forward_stream_of(overlap) is forward_stream
    assert glue.forward_stream_of(normal) is None  # the scheduler thread's current stream


def test_each_generation_is_published_on_its_forward_stream(
    process: glue._Process, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(glue, "_chunk_notices", lambda scheduler, batch, messenger: ["chunk"])
    counter, streamer = StreamRecorder(), SubmitRecorder()
    process.counter, process.streamer, process.messenger = counter, streamer, object()
    forward_stream = object()
    extend = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: True))
    decode = SimpleNamespace(forward_mode=SimpleNamespace(is_extend=lambda: False))

    overlap = SimpleNamespace(enable_overlap=True, forward_stream=forward_stream)
    normal = SimpleNamespace(enable_overlap=False, forward_stream=forward_stream)
    glue.before_run_batch(overlap, extend)
    glue.before_run_batch(overlap, decode)  # no extend, no forward to follow
    glue.before_run_batch(normal, extend)

    assert counter.begun == [(1, forward_stream), (2, None)]
    assert [(j.generation, j.payload) for j in streamer.jobs] == [(1, ["chunk"]), (2, ["chunk"])]
    assert all(isinstance(j.ended, glue.ForwardEnd) for j in streamer.jobs)


class _Projection:
    """A stand-in for SGLang's attention output projection."""


def _model(num_layers: int) -> Any:
    import torch

    class Attention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.o_proj = torch.nn.Linear(2, 2)

        def forward(self, x: Any) -> Any:
            return self.o_proj(x)

    class Layer(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = Attention()

        def forward(self, x: Any) -> Any:
            return self.self_attn(x)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(Layer() for _ in range(num_layers))

        def forward(self, x: Any) -> Any:
            for layer in self.layers:
                x = layer(x)
            return x

    return Model()


def _lora_wrapped(model: Any) -> None:
    """What SGLang's LoRA manager does to each adapted projection: a new module in its
    place that calls the base layer's ``forward`` directly (its hooks never run)."""
    import torch

    class WithLoRA(torch.nn.Module):
        def __init__(self, base_layer: Any) -> None:
            super().__init__()
            self.base_layer = base_layer

        def forward(self, x: Any) -> Any:
            return self.base_layer.forward(x)

    for layer in model.layers:
        layer.self_attn.o_proj = WithLoRA(layer.self_attn.o_proj)


def _one_forward(model: Any, counter: HostProgress, generation: int) -> int:
    import torch

    from sgl_pd.layerwise.progress import decode

    counter.begin_forward(generation)
    model(torch.zeros(1, 2))
    published, layers_done = decode(counter.read())
    return layers_done if published == generation else 0  # layers this forward reported


def test_the_progress_hooks_follow_the_modules_lora_puts_in_place(
    process: glue._Process,
) -> None:
    model = _model(3)
    counter = glue.install_progress_hooks(model, HostProgress)
    assert _one_forward(model, counter, 1) == 3
    _lora_wrapped(model)
    assert _one_forward(model, counter, 2) == 0  # the hooks sit on modules that never run
    glue.after_init_lora_manager(None, SimpleNamespace(model=model))
    process.counter = counter
    glue.after_init_lora_manager(None, SimpleNamespace(model=model))
    assert _one_forward(model, counter, 3) == 3


def test_a_forward_that_ends_with_layers_unreported_fails_health_and_still_sends(
    process: glue._Process,
) -> None:
    """Hooks that did not fire cannot stall a request: the streamer completes the job
    once the forward ended (its KV is written), and the server says so, once."""
    from sgl_pd.core.clock import ManualClock

    counter = process.counter = HostProgress(3)
    messenger = FakeMessenger(num_layers=3)
    streamer = LayerStreamer(
        counter,
        lambda job, layers: messenger.write_layers(job.payload, layers),
        lambda job: messenger.forward_done(job.payload),
        clock=ManualClock(),
        on_silent_layers=glue.silent_layers,
    )
    end = glue.ForwardEnd()
    streamer.submit(ForwardJob(1, "chunks", ended=end))
    counter.begin_forward(1)
    counter.record_layer(0)
    for _ in range(3):
        streamer.step()
    assert not messenger.done.is_set() and glue.layerwise_problem() is None
    end.launched(None, on_gpu=False)  # run_batch returned: the forward ended on the CPU
    streamer.step()
    assert messenger.done.is_set()
    assert messenger.written == [("chunks", range(0, 1)), ("chunks", range(1, 3))]
    problem = glue.layerwise_problem()
    assert problem is not None and "1 of 3 layers" in problem


def test_a_vision_towers_layers_do_not_take_the_language_models_place(
    process: glue._Process,
) -> None:
    """Both stacks number their layers from 0: the hooks go on the language model's."""
    import torch

    class Multimodal(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vision_tower = _model(2)
            self.language_model = _model(3)

    model = Multimodal()
    counter = glue.install_progress_hooks(model, HostProgress)
    assert counter.num_layers == 3
    assert _one_forward(model.language_model, counter, 1) == 3
    assert _one_forward(model.vision_tower, counter, 2) == 0


def test_two_stacks_that_cannot_be_told_apart_are_refused() -> None:
    import torch

    class TwoStacks(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.left, self.right = _model(2), _model(2)

    with pytest.raises(RuntimeError, match=r"2 layer stacks .*--pd-kv-send after-forward"):
        glue.install_progress_hooks(TwoStacks(), HostProgress)


def _hybrid(attention_layers: set[int], num_layers: int) -> Any:
    """Qwen3-Next's shape: linear-attention layers (``linear_attn.out_proj``), and
    full-attention layers holding their ``o_proj`` directly."""
    import torch

    class LinearAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.out_proj = torch.nn.Linear(2, 2)

        def forward(self, x: Any) -> Any:
            return self.out_proj(x)

    class Layer(torch.nn.Module):
        def __init__(self, attention: bool) -> None:
            super().__init__()
            if attention:
                self.o_proj = torch.nn.Linear(2, 2)
            else:
                self.linear_attn = LinearAttention()

        def forward(self, x: Any) -> Any:
            return self.o_proj(x) if hasattr(self, "o_proj") else self.linear_attn(x)

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = torch.nn.ModuleList(
                Layer(i in attention_layers) for i in range(num_layers)
            )

        def forward(self, x: Any) -> Any:
            for layer in self.layers:
                x = layer(x)
            return x

    return Model()


def test_a_hybrid_models_attention_layers_count_as_the_pools_layers_in_order(
    process: glue._Process,
) -> None:
    """SGLang's pool of a hybrid model holds the attention layers' KV only, the i-th
    attention layer as KV layer i; the linear-attention layers are steps of their own,
    whose state is final once their output projection ran (`core.layer_steps`)."""
    model = _hybrid({3, 7}, 8)
    counter = glue.install_progress_hooks(model, HostProgress)
    assert counter.num_layers == 8
    steps = process.steps
    assert steps is not None and steps.num_kv_layers == 2
    assert steps.kv_layers(range(0, 4)) == range(0, 1)  # layer 3 is KV layer 0
    assert steps.state_layers(range(0, 4)) == {0, 1, 2}
    assert [m for _, (m, _h) in sorted(process.hooks.items())] == [
        *(model.layers[i].linear_attn.out_proj for i in (0, 1, 2)),
        model.layers[3].o_proj,
        *(model.layers[i].linear_attn.out_proj for i in (4, 5, 6)),
        model.layers[7].o_proj,
    ]
    assert _one_forward(model, counter, 1) == 8


def test_the_streamer_hands_over_kv_layers_and_state_layers_as_the_forward_reports_them(
    process: glue._Process,
) -> None:
    """A hybrid model's forward, hooked: the messenger hears KV layers 0..1 and the
    linear-attention layers' ids, in the ranges the counter jumped by."""
    model = _hybrid({3, 7}, 8)
    counter = process.counter = glue.install_progress_hooks(model, HostProgress)
    messenger = FakeMessenger(num_layers=2)
    streamer = glue.attach_messenger(messenger, layerwise=True)
    assert streamer is not None
    streamer.submit(ForwardJob(1, "chunks"))
    _one_forward(model, counter, 1)
    assert messenger.done.wait(WAIT_S)
    assert [i for _, r in messenger.written for i in r] == [0, 1]
    assert set().union(*(s for _, s in messenger.state_written)) == {0, 1, 2, 4, 5, 6}


def test_a_sliding_window_models_sliding_layers_are_state_steps(process: glue._Process) -> None:
    """With SGLang's hybrid SWA pool, the sliding layers' KV is window state: their
    attention output projections report state layers, the others KV layers."""
    process.sliding_layers = frozenset({0, 2})
    model = _model(4)
    counter = glue.install_progress_hooks(model, HostProgress)
    steps = process.steps
    assert counter.num_layers == 4 and steps is not None
    assert steps.kv_layers(range(4)) == range(0, 2)
    assert steps.state_layers(range(0, 2)) == {0}
    assert steps.state_model_layers == {0, 2}
