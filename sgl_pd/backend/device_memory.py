"""Torch tensors over memory SGLang allocated and hands us as raw addresses (``KVArgs``
carries pointers, not tensors): zero-copy byte views on the CPU or a CUDA device."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from sgl_pd.backend.pool import PoolDescription


class _CudaBytes:
    """The CUDA array interface of `nbytes` bytes at `addr` (what `torch.as_tensor` reads)."""

    def __init__(self, addr: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (addr, False),
            "version": 3,
            "strides": None,
        }


def byte_tensor(addr: int, nbytes: int, device: Any) -> Any:
    """(nbytes,) uint8 tensor aliasing `nbytes` bytes at `addr` on `device` (the caller
    keeps the memory alive: SGLang's pool lives as long as its server)."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        return torch.as_tensor(_CudaBytes(addr, nbytes), device=device)
    if device.type != "cpu":
        raise ValueError(f"byte views of {device.type} memory are not supported")
    array = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(addr))
    return torch.from_numpy(array)


# cudaFlushGPUDirectRDMAWritesTargetCurrentDevice, cudaFlushGPUDirectRDMAWritesToOwner
_FLUSH_TARGET_CURRENT_DEVICE = 0
_FLUSH_TO_OWNER = 100


def _cudart() -> Any:
    """The CUDA runtime library torch loaded (None without one)."""
    import ctypes.util

    for name in ("libcudart.so", "libcudart.so.12", "libcudart.so.13", "libcudart.so.11.0"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    found = ctypes.util.find_library("cudart")
    return ctypes.CDLL(found) if found else None


_flush_fn: Any = None


def flush_remote_writes(device: Any) -> None:
    """Makes every GPUDirect RDMA write that already reached `device` visible to work on
    it (`cudaDeviceFlushGPUDirectRDMAWrites`, to the owner: this process's kernels).

    A prefill rank writes a request's KV into this GPU and then its count word into host
    memory; under relaxed PCIe ordering (or EFA) the word can be seen while KV writes are
    still on their way into GPU memory. Counting the word complete, then flushing, then
    decoding is the order CUDA documents for this. A no-op for pages in host memory."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return
    global _flush_fn
    if _flush_fn is None:
        lib = _cudart()
        fn = getattr(lib, "cudaDeviceFlushGPUDirectRDMAWrites", None) if lib else None
        if fn is None:
            raise RuntimeError(
                "the CUDA runtime has no cudaDeviceFlushGPUDirectRDMAWrites (CUDA >= 11.3)"
            )
        _flush_fn = fn
    with torch.cuda.device(device):
        code = int(_flush_fn(_FLUSH_TARGET_CURRENT_DEVICE, _FLUSH_TO_OWNER))
    if code != 0:
        raise RuntimeError(f"cudaDeviceFlushGPUDirectRDMAWrites failed with CUDA error {code}")


def pool_region_views(pool: PoolDescription, device: Any) -> list[Any]:
    """Per KV region (layer, part) of `pool`, a (token slots, local heads, row bytes)
    uint8 view of its memory on `device` (SGLang's NHD buffers: slot after slot)."""
    slots, row = pool.num_pages * pool.layout.page_size, pool.layout.row_bytes
    return [
        byte_tensor(r.base, slots * pool.local_heads * row, device).view(
            slots, pool.local_heads, row
        )
        for r in pool.kv.regions
    ]


def side_stream(device: Any) -> Any:
    """A CUDA stream of its own on `device` (never the forward's), None on the CPU."""
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
