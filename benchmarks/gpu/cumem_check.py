"""cuMem export / import between two processes: the building block of D11.

D11 maps every local shard's KV pool into one messenger process, so one process (one
Mooncake engine, one set of connections) can write for all of them. CUDA's virtual memory
management makes that possible: an allocation made with `cuMemCreate` can be exported as
a POSIX file descriptor, passed to another process (SCM_RIGHTS over a pipe), imported and
mapped there at an address of that process. This check does exactly that with the CUDA
driver API (ctypes on libcuda, no other package): the owner fills its allocation with
0xAB, the importer reads it back through its own mapping, writes 0xCD over the first
half, and the owner sees that write in its own mapping.

    python benchmarks/gpu/cumem_check.py [--mib 64]

Prints one JSON line: ok, bytes, granularity, and the import-and-map time in ms; or
skipped with the reason when there is no CUDA driver or device.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import sys
import time
from multiprocessing import reduction
from typing import Any

CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class CUmemAllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", CUmemAllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class Driver:
    """The few CUDA driver calls this check needs; every call's status is checked."""

    def __init__(self) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1")
        self.call("cuInit", ctypes.c_uint(0))
        dev = ctypes.c_int()
        self.call("cuDeviceGet", ctypes.byref(dev), 0)
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), dev)
        self.call("cuCtxSetCurrent", ctx)
        self.device = dev.value

    def call(self, name: str, *args: Any) -> None:
        status = getattr(self.lib, name)(*args)
        if status != 0:
            text = ctypes.c_char_p()
            self.lib.cuGetErrorString(status, ctypes.byref(text))
            raise RuntimeError(f"{name} failed: {status} {text.value!r}")

    def prop(self) -> CUmemAllocationProp:
        prop = CUmemAllocationProp()
        prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        prop.location = CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.device)
        return prop

    def granularity(self) -> int:
        size = ctypes.c_size_t()
        prop = self.prop()
        self.call(
            "cuMemGetAllocationGranularity",
            ctypes.byref(size),
            ctypes.byref(prop),
            CU_MEM_ALLOC_GRANULARITY_MINIMUM,
        )
        return size.value

    def map(self, handle: int, nbytes: int) -> int:
        """Reserves an address range, maps `handle` there, allows this device to use it."""
        ptr = ctypes.c_uint64()
        self.call("cuMemAddressReserve", ctypes.byref(ptr), ctypes.c_size_t(nbytes),
                  ctypes.c_size_t(0), ctypes.c_uint64(0), ctypes.c_uint64(0))  # fmt: skip
        self.call("cuMemMap", ptr, ctypes.c_size_t(nbytes), ctypes.c_size_t(0),
                  ctypes.c_uint64(handle), ctypes.c_uint64(0))  # fmt: skip
        access = CUmemAccessDesc(
            CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, self.device),
            CU_MEM_ACCESS_FLAGS_PROT_READWRITE,
        )
        self.call("cuMemSetAccess", ptr, ctypes.c_size_t(nbytes), ctypes.byref(access),
                  ctypes.c_size_t(1))  # fmt: skip
        return ptr.value

    def fill(self, ptr: int, value: int, nbytes: int) -> None:
        self.call("cuMemsetD8_v2", ctypes.c_uint64(ptr), ctypes.c_ubyte(value),
                  ctypes.c_size_t(nbytes))  # fmt: skip
        self.call("cuCtxSynchronize")

    def read(self, ptr: int, nbytes: int) -> bytes:
        host = (ctypes.c_ubyte * nbytes)()
        self.call("cuMemcpyDtoH_v2", host, ctypes.c_uint64(ptr), ctypes.c_size_t(nbytes))
        return bytes(host)


def _importer(conn: Any, nbytes: int) -> None:
    """The second process: imports the owner's allocation and maps it at its own address."""
    try:
        driver = Driver()
        fd = reduction.recv_handle(conn)
        t0 = time.perf_counter()
        handle = ctypes.c_uint64()
        driver.call("cuMemImportFromShareableHandle", ctypes.byref(handle),
                    ctypes.c_void_p(fd), CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR)  # fmt: skip
        ptr = driver.map(handle.value, nbytes)
        map_ms = (time.perf_counter() - t0) * 1e3
        seen = driver.read(ptr, nbytes)
        driver.fill(ptr, 0xCD, nbytes // 2)
        conn.send(("ok", seen == b"\xab" * nbytes, map_ms))
    except Exception as e:
        conn.send(("error", f"{type(e).__name__}: {e}", 0.0))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=64)
    args = ap.parse_args()
    try:
        driver = Driver()
    except Exception as e:  # no driver, no device, or the CPU stand-in library
        print(json.dumps({"check": "cumem", "skipped": f"{type(e).__name__}: {e}"}))
        return 0
    gran = driver.granularity()
    nbytes = -(-args.mib * 2**20 // gran) * gran
    handle = ctypes.c_uint64()
    prop = driver.prop()
    driver.call("cuMemCreate", ctypes.byref(handle), ctypes.c_size_t(nbytes), ctypes.byref(prop),
                ctypes.c_uint64(0))  # fmt: skip
    ptr = driver.map(handle.value, nbytes)
    driver.fill(ptr, 0xAB, nbytes)
    fd = ctypes.c_int()
    driver.call("cuMemExportToShareableHandle", ctypes.byref(fd), ctypes.c_uint64(handle.value),
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, ctypes.c_uint64(0))  # fmt: skip
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_importer, args=(child, nbytes))
    proc.start()
    reduction.send_handle(parent, fd.value, proc.pid)
    if not parent.poll(120):
        proc.kill()
        print(json.dumps({"check": "cumem", "ok": False, "error": "importer did not answer"}))
        return 1
    status, seen_ok, map_ms = parent.recv()
    proc.join(30)
    if status != "ok":
        print(json.dumps({"check": "cumem", "ok": False, "error": seen_ok}))
        return 1
    back = driver.read(ptr, nbytes)
    half = nbytes // 2
    wrote_ok = back[:half] == b"\xcd" * half and back[half:] == b"\xab" * (nbytes - half)
    ok = bool(seen_ok and wrote_ok)
    print(
        json.dumps(
            {
                "check": "cumem",
                "ok": ok,
                "importer_read_owner_bytes": bool(seen_ok),
                "owner_saw_importer_write": wrote_ok,
                "bytes": nbytes,
                "granularity": gran,
                "import_and_map_ms": round(map_ms, 3),
            }
        )
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
