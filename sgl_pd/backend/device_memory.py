"""Torch tensors over memory SGLang allocated and hands us as raw addresses (``KVArgs``
carries pointers, not tensors): zero-copy byte views on the CPU or a CUDA device."""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np


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
