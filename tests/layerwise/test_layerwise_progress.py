"""The progress encoding and the host counter; CudaProgress's refusal without CUDA."""

from __future__ import annotations

import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_pd.errors import SglPdError
from sgl_pd.layerwise import (
    MAX_GENERATION,
    STRIDE,
    CudaProgress,
    CudaUnavailable,
    HostProgress,
    ProgressError,
    decode,
    encode,
)

generations = st.integers(0, MAX_GENERATION)
layer_counts = st.integers(0, STRIDE - 1)


@given(generations, layer_counts)
def test_encode_decode_round_trip(generation: int, layers_done: int) -> None:
    value = encode(generation, layers_done)
    assert decode(value) == (generation, layers_done)
    assert 0 <= value < 2**63  # fits the int64 word the device writes


@given(generations, layer_counts, generations, layer_counts)
def test_encoding_orders_like_generation_then_layers(g1: int, l1: int, g2: int, l2: int) -> None:
    # The streamer relies on it: every value of a later forward exceeds every earlier one.
    assert (encode(g1, l1) < encode(g2, l2)) == ((g1, l1) < (g2, l2))


@pytest.mark.parametrize(
    ("generation", "layers_done"), [(-1, 0), (MAX_GENERATION + 1, 0), (0, -1), (0, STRIDE)]
)
def test_encode_rejects_out_of_range(generation: int, layers_done: int) -> None:
    with pytest.raises(ProgressError):
        encode(generation, layers_done)


def test_decode_rejects_negative() -> None:
    with pytest.raises(ProgressError):
        decode(-1)


def test_errors_are_rooted_in_the_package() -> None:
    assert issubclass(ProgressError, SglPdError)
    assert issubclass(CudaUnavailable, SglPdError)


@given(st.integers(1, STRIDE - 1), generations, st.data())
def test_host_progress_publishes_generation_and_layers(
    num_layers: int, generation: int, data: st.DataObject
) -> None:
    layer = data.draw(st.integers(0, num_layers - 1))
    counter = HostProgress(num_layers)
    assert counter.read() == encode(0, 0)
    counter.begin_forward(generation)
    counter.record_layer(layer)
    assert decode(counter.read()) == (generation, layer + 1)


def test_host_progress_values_grow_across_forwards() -> None:
    counter = HostProgress(3)
    seen = []
    for generation in (1, 2, 7):
        counter.begin_forward(generation)
        for layer in range(3):
            counter.record_layer(layer)
            seen.append(counter.read())
    assert seen == sorted(seen) and len(set(seen)) == len(seen)
    assert decode(seen[-1]) == (7, 3)


def test_host_progress_rejects_bad_layers() -> None:
    counter = HostProgress(4)
    counter.begin_forward(1)
    for layer in (-1, 4):
        with pytest.raises(ProgressError):
            counter.record_layer(layer)
    with pytest.raises(ProgressError):
        counter.begin_forward(-1)
    for num_layers in (0, STRIDE):
        with pytest.raises(ProgressError):
            HostProgress(num_layers)


def test_cuda_progress_without_cuda_is_a_typed_error() -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is visible; tests/gpu covers CudaProgress")
    with pytest.raises(CudaUnavailable, match="HostProgress"):
        CudaProgress(8)


def test_importing_layerwise_does_not_import_torch() -> None:
    code = "import sys, sgl_pd.layerwise\nprint('torch' in sys.modules)"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False"
