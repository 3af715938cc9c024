"""Per-layer forward progress, published as one int64 a host thread can poll (D8).

The value is `generation * STRIDE + layers_done`. The generation is set by the scheduler
before each forward, so a value left over from the previous forward (say "61 layers
done") is never read as progress of the current one: it decodes to an older generation.
Encoded values grow monotonically across forwards, which is what the streamer relies on.

Two implementations of `ProgressCounter`:
- `HostProgress`: the value in host memory, stored by a CPU forward (tests, CPU serving).
- `CudaProgress`: the value in pinned host memory, stored by a one-element kernel that
  the forward enqueues after each layer; the kernels are plain stream work, so they are
  captured into CUDA graphs and replay with them. No Python callback runs in the graph.

This module imports numpy only; torch is imported when a `CudaProgress` is built.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any, Protocol

import numpy as np

from sgl_pd.errors import SglPdError

_log = logging.getLogger(__name__)

STRIDE = 1 << 16  # encoded units per generation: at most STRIDE - 1 layers per forward
# Largest generation whose encoded values still fit an int64 (the device and host word).
MAX_GENERATION = (np.iinfo(np.int64).max - (STRIDE - 1)) // STRIDE


class LayerwiseError(SglPdError):
    """Something in layer-wise streaming was set up or driven wrongly; subclasses say what."""


class ProgressError(LayerwiseError):
    """A generation, layer index or layer count is out of range for the progress encoding."""


class CudaUnavailable(LayerwiseError):
    """`CudaProgress` was built where torch or a CUDA device is missing: use `HostProgress`
    on CPU, or check the driver and `CUDA_VISIBLE_DEVICES`."""


def encode(generation: int, layers_done: int) -> int:
    """The published value meaning "`layers_done` layers of forward `generation` finished"."""
    if not 0 <= generation <= MAX_GENERATION:
        raise ProgressError(f"generation {generation} is outside [0, {MAX_GENERATION}]")
    if not 0 <= layers_done < STRIDE:
        raise ProgressError(f"layers_done {layers_done} is outside [0, {STRIDE - 1}]")
    return generation * STRIDE + layers_done


def decode(value: int) -> tuple[int, int]:
    """(generation, layers_done) of a published value; the inverse of `encode`."""
    if value < 0:
        raise ProgressError(f"progress value {value} is negative: not written by encode()")
    generation, layers_done = divmod(value, STRIDE)
    return generation, layers_done


def check_num_layers(num_layers: int) -> int:
    """`num_layers` if one generation can count them all; raises `ProgressError` otherwise."""
    if not 1 <= num_layers < STRIDE:
        raise ProgressError(f"num_layers {num_layers} is outside [1, {STRIDE - 1}]")
    return num_layers


class ProgressCounter(Protocol):
    """Where a forward says how many of its layers are done, and a poller reads it.

    Writers: `begin_forward` and `record_layer` are called by the thread that runs the
    forward, in forward order. Readers: `read` may be called from any thread at any time.
    """

    num_layers: int

    def read(self) -> int:
        """The latest published encoded value (see `decode`). Never blocks. Before the first
        layer of the first forward it is `encode(0, 0)`."""
        ...

    def begin_forward(self, generation: int, stream: Any = None) -> None:
        """Makes the next `record_layer` calls publish values of `generation`. Called before
        each forward (outside any CUDA graph) with strictly increasing generations.
        `stream`: the device stream the forward will run on, None for the caller's current
        stream; a counter written by the host has no stream and ignores it. Raises
        `ProgressError` for a generation out of range."""
        ...

    def record_layer(self, layer: int) -> None:
        """Publishes `encode(generation, layer + 1)`: layers [0, layer] are done. Called
        right after layer `layer`'s attention output projection."""
        ...


class HostProgress:
    """The counter in host memory, for a forward that runs on the CPU.

    One writer (the forward's thread) and any number of pollers need no lock: the value is
    one 8-byte-aligned int64 (numpy aligns array data to at least 16 bytes), and an aligned
    8-byte store or load is a single access on x86-64 and arm64, so a poller sees the old
    or the new value, never a mix, with or without the GIL.
    """

    def __init__(self, num_layers: int) -> None:
        self.num_layers = check_num_layers(num_layers)
        self._value = np.zeros(1, dtype=np.int64)  # (1,) the published encoded value
        self._base = 0  # generation * STRIDE of the current forward; writer thread only

    def read(self) -> int:
        return int(self._value[0])

    def begin_forward(self, generation: int, stream: Any = None) -> None:
        # A CPU forward runs on the calling thread after this returns: program order is
        # the only order there is, so `stream` has nothing to say here.
        self._base = encode(generation, 0)

    def record_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ProgressError(f"layer {layer} is outside [0, {self.num_layers - 1}]")
        self._value[0] = self._base + layer + 1


class _CudaArray:
    """What `torch.as_tensor` reads a device pointer from (the CUDA array interface)."""

    def __init__(self, address: int, shape: tuple[int, ...], typestr: str) -> None:
        self.__cuda_array_interface__ = {
            "shape": shape, "typestr": typestr, "data": (address, False), "version": 3,
            "strides": None,
        }  # fmt: skip


def _device_alias(torch: Any, pinned: Any, device: Any) -> Any:
    """A CUDA tensor over the same bytes as the pinned host tensor `pinned` (int64): with
    unified addressing, the device reaches pinned host memory at its host address."""
    if pinned.dtype != torch.int64 or not pinned.is_pinned():
        raise ProgressError("the published word must be pinned int64 host memory")
    alias = torch.as_tensor(
        _CudaArray(pinned.data_ptr(), tuple(pinned.shape), "<i8"), device=device
    )
    if alias.data_ptr() != pinned.data_ptr() or alias.device.type != "cuda":
        raise CudaUnavailable("this device cannot address pinned host memory directly")
    return alias


def _import_torch() -> Any:
    try:
        return importlib.import_module("torch")
    except ImportError as e:
        raise CudaUnavailable("CudaProgress needs torch; install torch with CUDA") from e


class CudaProgress:
    """The counter in pinned host memory, written by the device after each layer.

    Scheme (all buffers are allocated once, here, so their addresses never change):
    - `_offsets` (device, (num_layers,) int64) = [1, 2, ..., num_layers]: layers_done after
      each layer.
    - `_values` (device, (num_layers,) int64): this forward's value per layer.
      `begin_forward(g, stream)` enqueues one kernel on `stream` (the forward's), outside
      any graph: `_values = _offsets + g * STRIDE`. The generation travels as a kernel
      argument, so a later `begin_forward` can never change what an earlier, still-queued
      forward publishes (a CPU write into a staging buffer could, since the scheduler runs
      ahead of the device).
    - `_host` (pinned host, (1,) int64): the published value, also seen by the device as
      `_host_on_device` (the same address: pinned memory is mapped into the device's
      unified address space). `record_layer(i)` enqueues one one-element kernel on the
      current stream that stores `_values[i]` there: one kernel node per layer in a graph.
      A kernel, not a device-to-host copy: an 8-byte copy between the layer's kernels
      cost about 10 us each on an H200 (15.9% of a 3.9 ms forward of 61 layers under
      graph replay), the kernel about 1.5 us (2.3%; benchmarks/gpu).

    Why it is CUDA-graph-safe: `record_layer` launches one kernel between static
    buffers; capture records it as a kernel node with those fixed addresses, and each
    replay stores whatever `_values[i]` holds then, i.e. the generation that the
    `begin_forward` before that replay wrote. Nothing in the graph depends on Python state.
    Stream order gives the rest: `begin_forward` of forward g+1 runs on the device after
    every copy of forward g, so published values never go backwards.

    Contract: pass `begin_forward` the stream the forward (or graph replay) will run on
    (SGLang's overlap scheduler runs it on `forward_stream`, not on the scheduler thread's
    current stream). On another stream the kernel could run while the previous forward is
    still going and relabel that forward's remaining layers with the new generation, so the
    poller would take them for layers of the next forward (tests/gpu shows both cases); an
    eager forward whose layer 0 runs on another stream than the last `begin_forward` logs
    one warning (a replayed graph runs no Python to check). Keep this object alive as long
    as any graph captured with it (the graph writes into `_host`). Only the primary TP rank
    needs one: after o_proj's all-reduce every rank has finished the layer.

    The host load in `read` is an aligned 8-byte load of a word one device thread stores
    with one aligned 8-byte store; it crosses the bus as one write transaction and lands
    whole, so the poller is never handed half of a value.
    """

    def __init__(self, num_layers: int, *, device: Any = None) -> None:
        """`device`: a torch device or index; the current CUDA device when None. Raises
        `CudaUnavailable` without torch or a CUDA device."""
        self.num_layers = check_num_layers(num_layers)
        torch = _import_torch()
        if not torch.cuda.is_available():
            raise CudaUnavailable(
                "CudaProgress needs a CUDA device and none is visible; use HostProgress on CPU"
            )
        self._torch = torch
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else device
        self._device = torch.device(dev)
        i64 = torch.int64
        self._offsets = torch.arange(1, num_layers + 1, dtype=i64, device=self._device)
        self._values = self._offsets.clone()  # generation 0 until the first begin_forward
        # One (1,)-shaped view per layer, made once: record_layer then costs no slicing.
        self._value_views = [self._values[i : i + 1] for i in range(num_layers)]
        self._host = torch.zeros(1, dtype=i64, pin_memory=True)  # (1,) published value
        self._host_np = self._host.numpy()  # a view of the same pinned word, for read()
        self._host_on_device = _device_alias(torch, self._host, self._device)
        self._begin_stream: Any = None  # the stream of the last begin_forward
        self._stream_warned = False

    def read(self) -> int:
        return int(self._host_np[0])

    def begin_forward(self, generation: int, stream: Any = None) -> None:
        base = encode(generation, 0)
        cuda = self._torch.cuda
        self._refuse_capture()
        target = cuda.current_stream(self._device) if stream is None else stream
        with cuda.stream(target):
            self._refuse_capture()
            self._begin_stream = target
            self._torch.add(self._offsets, base, out=self._values)

    def _refuse_capture(self) -> None:
        if self._torch.cuda.is_current_stream_capturing():
            # Captured, the generation would be frozen into the graph and every replay
            # would publish it: call begin_forward before capture/replay, never inside.
            raise ProgressError("begin_forward was called during CUDA graph capture")

    def record_layer(self, layer: int) -> None:
        if not 0 <= layer < self.num_layers:
            raise ProgressError(f"layer {layer} is outside [0, {self.num_layers - 1}]")
        if layer == 0 and not self._stream_warned:
            self._check_stream()
        self._torch.mul(self._value_views[layer], 1, out=self._host_on_device)

    def _check_stream(self) -> None:
        cuda = self._torch.cuda
        if self._begin_stream is None or cuda.is_current_stream_capturing():
            return  # a capture runs on its own stream; replays go where begin_forward went
        stream = cuda.current_stream(self._device)
        if stream != self._begin_stream:
            self._stream_warned = True
            _log.warning(
                "begin_forward ran on %s but the forward runs on %s: progress of one forward "
                "may be published under the next one's generation; call begin_forward "
                "with the forward's stream",
                self._begin_stream,
                stream,
            )
