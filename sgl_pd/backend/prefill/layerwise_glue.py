"""SGLang hooks for layer-wise KV streaming on a prefill server (D6, D7, D8).

- After the model loads, a forward hook on every layer's attention output projection
  (and, on a model with state besides the KV, on each sliding-window or linear-attention
  layer's output projection: `core.layer_steps`) records the layers done into a
  progress counter (`sgl_pd.layerwise.progress`). On a GPU the record is a
  device-to-pinned-host copy enqueued on the forward stream, so it is captured into CUDA
  graphs and replays with them; no Python runs inside a graph.
- Before a prefill batch runs, the scheduler tells the messenger which requests, token
  ranges and pages the batch covers (chunk notices) and hands them to the layer streamer
  under a new forward generation, published on the stream the forward will run on.
  Before a request's last chunk, its state slots are read too (a Mamba slot, the
  sliding window's pages): each state layer's share goes as that layer finishes.
- The streamer's thread polls the counter and writes each newly finished layer of every
  chunk; after the last layer of a request's last chunk, the metadata follows (D9).

The hooks are installed in every SGLang process that loads the plugin, and act only in a
prefill server whose transfer backend is sgl_pd with ``--pd-kv-send layerwise``.
"""

from __future__ import annotations

import logging
import re
import time
from typing import Any

from sgl_pd.backend import sliding_window_glue
from sgl_pd.backend.prefill.room_types import StreamedState
from sgl_pd.config import SglPdConfig, sgl_pd_role
from sgl_pd.core.clock import SystemClock
from sgl_pd.core.layer_steps import LayerSteps
from sgl_pd.core.page_ids import PageIds
from sgl_pd.core.sliding_window import window_tokens
from sgl_pd.errors import ConfigError
from sgl_pd.layerwise.progress import CudaProgress, HostProgress, ProgressCounter
from sgl_pd.layerwise.streamer import ForwardJob, LayerStreamer

logger = logging.getLogger("sgl_pd.layerwise")

# "model.layers.12.self_attn.o_proj" -> 12 (Llama, Qwen, DeepSeek: the attention output
# projection, after which the layer's KV entries are written and TP ranks are in step);
# Qwen3-Next's full-attention layers hold theirs directly ("model.layers.3.o_proj")
_O_PROJ = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:(?:self_attn|attn|attention)\.)?o_proj$")
# a linear-attention layer's output projection, after which its conv and recurrent state
# are final (Qwen3-Next's gated DeltaNet: "model.layers.0.linear_attn.out_proj")
_STATE_OUT = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:linear_attn|mamba|mixer)\.out_proj$")


class _Process:
    """This process's layer-wise state: one model, one counter, one streamer."""

    counter: ProgressCounter | None = None
    steps: LayerSteps | None = None  # what each count of the counter reports
    streamer: LayerStreamer | None = None
    messenger: Any = None  # PrefillMessenger, once the KV manager exists
    generation = 0
    hooks: dict[int, tuple[Any, Any]] = {}  # noqa: RUF012  # layer -> (module, handle)
    # the model's layers whose KV sits in SGLang's hybrid SWA pool: not KV layers, but
    # state layers (their window moves as state slots, `sliding_window_glue`)
    sliding_layers: frozenset[int] = frozenset()
    # the next forward's end, between `before_run_batch` and `after_run_batch`
    forward_end: ForwardEnd | None = None
    # set once a forward ended with layers its hooks never reported: /health fails
    problem: str | None = None
    # seconds between counter polls during a forward: a GPU layer takes ~0.4 ms, so poll
    # often; a CPU layer takes milliseconds, and each poll takes the GIL from the forward
    poll_interval_s = 20e-6


_process = _Process()


def layerwise_enabled(server_args: Any) -> bool:
    return sgl_pd_role(server_args) == "prefill" and SglPdConfig.from_environment().kv_send == (
        "layerwise"
    )


# where a multimodal model keeps towers whose layers are not the language model's
_TOWERS = ("vision", "visual", "audio", "image", "encoder", "mm_projector")


def _hook_modules(
    model: Any, sliding: frozenset[int] = frozenset()
) -> tuple[LayerSteps, list[Any]]:
    """The forward's steps (`core.layer_steps`) and, per step, the module now at its
    output projection's path (after a swap, e.g. SGLang's LoRA wrapper, the wrapper: the
    base module inside it is named ``...o_proj.base_layer`` and may not run through its
    own forward). Layers are numbered within their stack (``<stack>.layers.<i>``): a
    multimodal model's vision or audio tower numbers its own from 0, and is not the
    language model whose KV is sent.

    KV layers: the layers with an attention output projection, except `sliding` (the
    layers whose KV SGLang keeps in its hybrid SWA pool). SGLang's pool holds their KV in
    model order, the i-th as KV layer i (``full_attention_layer_id_mapping`` on a hybrid
    model): `check_layer_counts` holds them to the pool's count. State layers: the
    `sliding` layers' attention output projections, and linear-attention layers' (gated
    DeltaNet, Mamba), whose per-request state is final once they ran."""
    stacks: dict[str, tuple[dict[int, Any], dict[int, Any]]] = {}
    for name, module in model.named_modules():
        for which, pattern in enumerate((_O_PROJ, _STATE_OUT)):
            match = pattern.search(name)
            if match:
                stack = stacks.setdefault(name[: match.start()], ({}, {}))
                stack[which][int(match.group(1))] = module
    stacks = {k: v for k, v in stacks.items() if v[0]}  # a stack with attention
    if len(stacks) > 1:
        stacks = {k: v for k, v in stacks.items() if not any(t in k.lower() for t in _TOWERS)}
    if len(stacks) != 1:
        raise RuntimeError(
            f"layer-wise streaming found attention output projections in"
            f" {len(stacks) or 'no'} layer stacks ({', '.join(sorted(stacks)) or '-'});"
            " serve this model with --pd-kv-send after-forward"
        )
    ((attention, linear),) = stacks.values()
    modules = {**linear, **attention}
    steps = LayerSteps.of(
        sorted(layer for layer in attention if layer not in sliding),
        [layer for layer in modules if layer in sliding or layer not in attention],
    )
    return steps, [modules[layer] for layer in steps.model_layers]


def attach_progress_hooks(model: Any, counter: ProgressCounter) -> None:
    """Hooks each step's output projection, as the model holds it now, to record into
    `counter`; a step whose module was replaced since (LoRA) moves its hook to the new
    one."""
    _steps, found = _hook_modules(model, _process.sliding_layers)
    if len(found) != counter.num_layers:
        raise RuntimeError(
            f"the model's attention output projections changed from {counter.num_layers}"
            f" to {len(found)} layers"
        )
    for step, module in enumerate(found):
        held = _process.hooks.get(step)
        if held is not None and held[0] is module:
            continue
        if held is not None:
            held[1].remove()
        handle = module.register_forward_hook(
            lambda _m, _inputs, _output, step=step: counter.record_layer(step)
        )
        _process.hooks[step] = (module, handle)


def install_progress_hooks(model: Any, counter_for: Any) -> ProgressCounter:
    """Registers a forward hook on each step's output projection; returns the counter
    they feed (one count per step, `_process.steps`)."""
    steps, _found = _hook_modules(model, _process.sliding_layers)
    counter: ProgressCounter = counter_for(len(steps))
    _process.steps = steps
    _process.hooks = {}
    attach_progress_hooks(model, counter)
    return counter


def after_load_model(result: Any, model_runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook of ``ModelRunner.load_model``."""
    server_args = model_runner.server_args
    if not layerwise_enabled(server_args) or getattr(model_runner, "is_draft_worker", False):
        # a speculative draft model runs after the target: its KV goes at SGLang's send
        return result
    on_cpu = str(server_args.device) == "cpu"
    _process.sliding_layers = sliding_window_glue.sliding_layers_of(model_runner)

    def counter_for(num_layers: int) -> ProgressCounter:
        if on_cpu:
            return HostProgress(num_layers)
        return CudaProgress(num_layers)

    _process.counter = install_progress_hooks(model_runner.model, counter_for)
    if not on_cpu:
        warm_page_id_copies(model_runner.device)
    _process.poll_interval_s = 500e-6 if on_cpu else 20e-6
    steps = _process.steps
    assert steps is not None
    logger.info(
        "layer-wise KV streaming: progress counter on %d layers, %d of them with state"
        " besides the KV (%s)",
        len(steps),
        len(steps) - steps.num_kv_layers,
        "host" if on_cpu else "pinned host memory, CUDA-graph safe",
    )
    return result


def after_init_lora_manager(result: Any, model_runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook of ``ModelRunner.init_lora_manager``: SGLang has replaced each adapted
    projection with its LoRA module, which runs the base layer without its forward hooks;
    the progress hooks move to the modules that now run."""
    if _process.counter is not None and not getattr(model_runner, "is_draft_worker", False):
        attach_progress_hooks(model_runner.model, _process.counter)
        logger.info("layer-wise KV streaming: progress hooks follow the LoRA modules")
    return result


class ForwardEnd:
    """Whether a launched forward has finished on its device: on a CPU when
    ``run_batch`` returned; on a GPU when an event recorded after its launch on the
    forward stream completed (its progress records are written by then)."""

    def __init__(self) -> None:
        self._returned = False
        self._event: Any = None

    def launched(self, stream: Any, on_gpu: bool) -> None:
        if not on_gpu:
            self._returned = True
            return
        import torch

        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(stream)
        self._event = event

    def __call__(self) -> bool:
        event = self._event
        return self._returned or (event is not None and bool(event.query()))


def silent_layers(job: ForwardJob, reported: int) -> None:
    """The streamer's word that a forward ended with layers its hooks never reported:
    the KV went after the forward (correct, no longer layer by layer); the server says
    so in its log and fails /health, since every later forward would do the same."""
    if _process.problem is None:
        counter = _process.counter
        total = counter.num_layers if counter is not None else "?"
        _process.problem = (
            f"layer-wise streaming: a forward ended with {reported} of {total} layers"
            " reported by the progress hooks (a module they follow was replaced or is"
            " not run); serve this model with --pd-kv-send after-forward"
        )
        logger.error("%s", _process.problem)


def layerwise_problem() -> str | None:
    """Why layer-wise streaming is not working in this process, or None."""
    return _process.problem


def check_layer_counts(hooked: int, kv_layers: int) -> None:
    """Raises `ConfigError` unless the hooks count as many layers as the target model's KV
    cache holds: the streamer sends "layer i of the KV cache" when the i-th hooked o_proj
    has run, so a model whose o_proj names match another set of modules would stream the
    wrong pages or never finish. (A draft model's layers are counted apart.)"""
    if hooked != kv_layers:
        raise ConfigError(
            f"layer-wise streaming hooked the attention output projection of {hooked} "
            f"layers, but the KV cache has {kv_layers} layers; serve this model with "
            "--pd-kv-send after-forward"
        )


def attach_messenger(messenger: Any, layerwise: bool) -> LayerStreamer | None:
    """Called by the prefill KV manager; in layer-wise mode, starts the streamer that
    feeds `messenger` from the progress counter. Raises `ConfigError` when the hooked
    layers and the KV layout's layers differ."""
    _process.messenger = messenger
    if not layerwise:
        return None
    if _process.counter is None:
        raise RuntimeError("layer-wise streaming needs the progress hooks installed first")
    steps = _process.steps or LayerSteps.kv_only(_process.counter.num_layers)
    check_layer_counts(steps.num_kv_layers, messenger.layout.num_layers - messenger.draft_layers)
    streamer = LayerStreamer(
        _process.counter,
        lambda job, done: messenger.write_layers(
            job.payload, steps.kv_layers(done), steps.state_layers(done)
        ),
        lambda job: messenger.forward_done(job.payload),
        clock=SystemClock(),
        on_silent_layers=silent_layers,
        poll_interval_s=_process.poll_interval_s,
    )
    streamer.start()
    _process.streamer = streamer
    return streamer


def _our_requests(batch: Any) -> list[Any]:
    from sgl_pd.backend.prefill.sender import SglPdKVSender

    return [
        req
        for req in getattr(batch, "reqs", None) or []
        if isinstance(getattr(req, "disagg_kv_sender", None), SglPdKVSender)
    ]


def forward_stream_of(scheduler: Any) -> Any:
    """The stream on which SGLang 0.5.23's ``Scheduler.run_batch`` will run the coming
    forward, or None for the scheduler thread's current stream.

    With the overlap scheduler (``scheduler.enable_overlap``) the scheduler thread runs
    with ``schedule_stream`` current, and ``run_batch`` launches the forward (eager or a
    graph replay, generation or embedding) inside ``forward_stream_ctx``, i.e. on
    ``scheduler.forward_stream``, after ``forward_stream.wait_stream(schedule_stream)``.
    Without it the forward runs on the current stream (with pipeline parallelism
    ``run_batch`` is itself called inside ``forward_stream_ctx``).
    """
    return scheduler.forward_stream if scheduler.enable_overlap else None


def warm_page_id_copies(device: Any) -> None:
    """Runs `page_ids_of` once at load time on `device`: the first pinned host allocation
    and the first launch of a kernel (CUDA loads modules lazily) wait for all work on the
    device, and a chunk notice must not (measured on an H200: the first call returned
    after a 100 ms kernel queued before it, later calls in 0.2 ms)."""
    import torch

    for dtype in (torch.int32, torch.int64):  # SGLang's token-slot tables are either
        page_ids_of(torch.zeros(2, dtype=dtype, device=device), 1).array()


def page_ids_of(tokens: Any, page_size: int) -> PageIds:
    """The page ids of a request's token slots, (tokens,) on SGLang's device: every
    `page_size`-th slot // page_size, as SGLang's `kv_to_page_indices` computes them.

    On a GPU the ids are copied to pinned host memory on the current stream (SGLang's
    schedule stream) without waiting: reading them now would block the scheduler on the
    forward in flight under the overlap scheduler. The copy lands before the coming
    forward starts, since the forward stream waits for the schedule stream; readers
    (`PageIds.array`) wait on its event. On CPU they are known at once."""
    return host_ids(tokens[::page_size] // page_size)


def host_ids(ids: Any) -> PageIds:
    """`ids`, a 1-D integer tensor on SGLang's device, on their way to the host as
    `page_ids_of` copies them: known at once on CPU, without waiting on a GPU."""
    if ids.device.type != "cuda":
        return PageIds.ready(ids.numpy())
    import torch

    host = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
    host.copy_(ids, non_blocking=True)
    copied = torch.cuda.Event()  # type: ignore[no-untyped-call]
    copied.record()

    def fetch() -> Any:
        copied.synchronize()
        return host.numpy()

    return PageIds.later(fetch)


def state_slots_before_forward(
    scheduler: Any, req: Any, kinds: list[str], page_size: int
) -> StreamedState | None:
    """The state slots SGLang will name for `req` in its last send (its ``_send_kv_chunk``
    state payloads for the kinds sgl_pd moves: the Mamba slot; the sliding window's pages
    of the KV it sends, translated into the SWA pool), read before the last chunk's
    forward: SGLang allocated them, for every token of the chunk, before it. None when a
    kind is read in another way here (its state then goes after the forward)."""
    import torch

    if not kinds:
        return None
    parts = []
    seq_len = min(int(req.extend_end), len(req.origin_input_ids))
    for kind in kinds:
        if kind == "mamba":
            pool = scheduler.req_to_token_pool
            slot = pool.req_index_to_mamba_index_mapping[req.kv.req_pool_idx]
            parts.append(pool.translate_mamba_indices(slot).reshape(-1))
        elif kind == "swa":
            allocator = scheduler.token_to_kv_pool_allocator
            window = sliding_window_glue.window()
            if window is None or getattr(allocator.get_kvcache(), "request_window", None):
                return None
            held = int(req.disagg_decode_prefix_len)
            positions = window_tokens(held, seq_len, window, page_size)
            row = scheduler.req_to_token_pool.req_to_token[
                req.kv.req_pool_idx, positions.start : positions.stop
            ]
            slots = allocator.translate_swa_indices_for_transfer(row)
            parts.append(slots[::page_size] // page_size)
        else:
            return None
    lengths = tuple(int(p.numel()) for p in parts)
    ids = torch.cat([p.to(torch.int64) for p in parts])
    return StreamedState(host_ids(ids), lengths)


def _chunk_notices(scheduler: Any, batch: Any, messenger: Any) -> list[Any]:
    """Tells the messenger the token range and pages of each of our requests in `batch`
    (and, before a last chunk, its state slots); returns the chunks it will stream (D7)."""
    page_size = messenger.layout.page_size
    kinds = [c.kind for c in messenger.rooms.state_slots]
    chunks = []
    for req in _our_requests(batch):
        end = int(req.extend_end)
        tokens = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx, :end]
        is_last = end >= len(req.origin_input_ids)
        state = state_slots_before_forward(scheduler, req, kinds, page_size) if is_last else None
        chunk = messenger.notice_chunk(
            int(req.disagg_kv_sender.bootstrap_room),
            page_ids_of(tokens, page_size),
            end,
            is_last=is_last,
            state=state,
        )
        if chunk is not None:
            chunks.append(chunk)
    return chunks


def before_run_batch(scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of ``Scheduler.run_batch``: chunk notices for the coming forward (D7)
    and its generation, published where the forward will run (D8)."""
    messenger, streamer, counter = _process.messenger, _process.streamer, _process.counter
    if messenger is None or streamer is None or counter is None:
        return None
    if batch is None or not batch.forward_mode.is_extend():
        return None
    chunks = _chunk_notices(scheduler, batch, messenger)
    _process.generation += 1
    _process.forward_end = end = ForwardEnd()
    # On a GPU, stream order is what keeps the previous forward's last layers under its
    # own generation: the overlap scheduler queues this forward behind the previous one on
    # forward_stream, so the generation must go there too, not on schedule_stream, where
    # it would overtake the previous forward (at most two are in flight).
    counter.begin_forward(_process.generation, stream=forward_stream_of(scheduler))
    streamer.submit(ForwardJob(_process.generation, chunks, ended=end))
    return None


def after_run_batch(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook of ``Scheduler.run_batch``: when each last chunk's forward ended (both
    modes), so the messenger can log the transfer time left after it."""
    if batch is None or not batch.forward_mode.is_extend():
        return result
    end, _process.forward_end = _process.forward_end, None
    if end is not None:
        stream = forward_stream_of(scheduler)
        on_gpu = _process.counter is not None and not isinstance(_process.counter, HostProgress)
        if on_gpu and stream is None:
            import torch

            stream = torch.cuda.current_stream()
        end.launched(stream, on_gpu)
    messenger = _process.messenger
    if messenger is None:
        return result
    now = time.monotonic()
    finished = [
        int(req.disagg_kv_sender.bootstrap_room)
        for req in _our_requests(batch)
        if int(req.extend_end) >= len(req.origin_input_ids)
    ]
    if finished:
        messenger.forward_finished(finished, now)
    return result
