"""The GPUDirect RDMA write flush a decoder runs before it reads a completed request's
pages (`device_memory.flush_remote_writes`): present in the CUDA runtime and succeeding;
cheap enough to run once per request. Skipped without a CUDA device."""

from __future__ import annotations

import time

import torch
from gpu_marks import GPU_ONLY

from sgl_pd.backend.device_memory import flush_remote_writes

pytestmark = GPU_ONLY


def test_the_flush_runs_and_is_cheap() -> None:
    flush_remote_writes("cuda:0")  # first call: finds the symbol
    started = time.perf_counter()
    for _ in range(100):
        flush_remote_writes(torch.device("cuda", 0))
    per_call_us = (time.perf_counter() - started) / 100 * 1e6
    print(f"flush_remote_writes: {per_call_us:.1f} us per call")


def test_pages_in_host_memory_need_no_flush() -> None:
    flush_remote_writes("cpu")
