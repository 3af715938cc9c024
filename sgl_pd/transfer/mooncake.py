"""`TransferEngine` over Mooncake's transfer engine (RDMA, EFA or TCP; one code path).

The only module that imports `mooncake`. What the binding does, read from its source and
measured here (mooncake-transfer-engine-non-cuda 0.3.13.post1):

- `batch_transfer_sync_write` blocks with the GIL released (spinning on the status) and
  returns 0 or -1; it gives up after Mooncake's transfer timeout, 30 s + 1 ns per byte
  (Mooncake reads MC_TRANSFER_TIMEOUT itself, at least 5 s).
- `batch_transfer_async_write` returns a batch id, 0 when it could not submit;
  `get_batch_transfer_status([id])` then blocks until that batch is done (0) or failed (-1).
- TCP: more than about 2048 writes in flight to one peer (1024 queued + 1024 waiting for
  admission) fail at once, and the link needs up to a second to recover. `InflightLimiter`
  keeps us under the cap and cuts bigger batches into pipelined chunks.
- A write into the peer outside its registered memory: the peer refuses it, -1.
- A write *from* unregistered local memory succeeds on TCP but not on RDMA; we refuse it on
  every transport (`RegionTable`).
- The first write to a peer performs a handshake inside the engine's segment lock; a peer
  that accepts TCP but does not answer holds that lock about 60 s. A port with nothing
  listening fails at once. `PeerGate` bounds the first case.

Listeners: Mooncake binds every interface; `listeners.pin_listeners` narrows them.
"""

from __future__ import annotations

import itertools
from collections import deque
from typing import Any, NoReturn

from sgl_pd.errors import ConfigError
from sgl_pd.transfer.config import METADATA_P2P, TransportConfig, TransportProtocol
from sgl_pd.transfer.engine import BatchHandle, BatchStatus, Writes
from sgl_pd.transfer.errors import (
    EngineClosed,
    InvalidWrites,
    MooncakeNotInstalled,
    RegistrationError,
    TransferError,
    TransferFailed,
)
from sgl_pd.transfer.inflight import InflightLimiter
from sgl_pd.transfer.listeners import Listener, listening_fds, pin_listeners
from sgl_pd.transfer.peers import PeerGate
from sgl_pd.transfer.regions import RegionTable
from sgl_pd.transfer.waiter import BatchWaiter

_CLOSE_WAIT_S = 5.0  # seconds close() waits for the batch-waiter thread
# seconds a chunk waits for in-flight credits held by other threads; longer than Mooncake's
# default transfer timeout (30 s + 1 s/GiB), so only a stuck engine hits it
_CREDIT_WAIT_S = 60.0

_Lists = tuple[list[int], list[int], list[int]]  # src, dst, nbytes as Mooncake takes them


def load_mooncake() -> Any:
    """Imports `mooncake.engine`, or says which wheel provides it."""
    try:
        import mooncake.engine as mc_engine
    except ImportError as e:
        raise MooncakeNotInstalled(
            "cannot import mooncake.engine: install the Mooncake transfer engine, "
            "`pip install mooncake-transfer-engine-non-cuda` on hosts without CUDA or "
            "`pip install mooncake-transfer-engine` with CUDA (Debian also needs libibverbs1, "
            f"librdmacm1 and libnuma1, even for TCP). Import error: {e}"
        ) from e
    return mc_engine


def engine_columns(writes: Writes) -> _Lists:
    """The three columns as the Python int lists the engine binding takes."""
    # numpy's tolist() is the cheapest way to the Python ints pybind11 converts (~1 ms per
    # 64k writes per column)
    return writes.src.tolist(), writes.dst.tolist(), writes.nbytes.tolist()


class MooncakeTransferEngine:
    """One Mooncake engine: its memory registrations and its session id.

    `shard` selects the NICs from a per-shard `--disaggregation-ib-device` mapping (D11);
    with one engine for several shards, register each shard's memory with its `location`
    ("cuda:3") and Mooncake picks the nearest NIC per region.
    """

    def __init__(self, config: TransportConfig, *, shard: int | None = None) -> None:
        mc = load_mooncake()
        if config.transport is TransportProtocol.EFA and not bool(mc.SUPPORT_EFA):
            raise ConfigError(
                "transfer protocol efa needs a Mooncake build with EFA support; this one "
                "has mooncake.engine.SUPPORT_EFA = False"
            )
        devices = config.devices_for(shard)
        self._te: Any = mc.TransferEngine()
        before = listening_fds()
        rc = self._te.initialize(
            config.hostname, config.metadata_server, config.transport.value, devices
        )
        if rc != 0:
            raise TransferError(
                f"Mooncake initialize(host={config.hostname!r}, metadata="
                f"{config.metadata_server!r}, protocol={config.transport.value!r}, "
                f"devices={devices!r}) returned {rc}; check that the host name is an "
                "address of this machine and that the NICs exist (ibv_devices)"
            )
        # before anything is registered, so nothing is exposed while they are open to all
        self._listeners = pin_listeners(before, config.bind_host)
        port = int(self._te.get_rpc_port())
        self._session_id = f"{config.hostname}:{port}"
        self._regions = RegionTable()
        self._ids = itertools.count(1)  # next() is atomic under the GIL
        self._waiter = BatchWaiter(name=f"sgl-pd-mooncake-wait-{port}")
        cap = config.inflight_cap
        self._limiter = InflightLimiter(cap) if cap is not None else None
        self._chunk = max(1, cap // 2) if cap is not None else 0  # writes; two in flight
        self._gate: PeerGate | None = None
        if config.metadata_server == METADATA_P2P:
            self._gate = PeerGate(self._te.send_probe, config.connect_timeout_s)
        self._closed = False

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def listeners(self) -> tuple[Listener, ...]:
        """The sockets `initialize` started listening on, after pinning (see module doc)."""
        return self._listeners

    @property
    def native(self) -> Any:
        """The wrapped `mooncake.engine.TransferEngine` (benchmarks, diagnostics)."""
        return self._te

    def register(self, addr: int, nbytes: int, *, location: str = "*") -> None:
        self._check_open()
        self._regions.add(addr, nbytes)
        rc = self._te.register_memory(addr, nbytes, location)
        if rc != 0:
            self._regions.remove(addr)
            raise RegistrationError(
                f"Mooncake register_memory({addr:#x}, {nbytes} bytes, {location!r}) returned "
                f"{rc}; with RDMA, check the memory is pinned or device memory and that "
                "the NIC can map it"
            )

    def unregister(self, addr: int) -> None:
        self._check_open()
        self._regions.remove(addr)
        rc = self._te.unregister_memory(addr)
        if rc != 0:
            raise RegistrationError(f"Mooncake unregister_memory({addr:#x}) returned {rc}")

    def write(self, peer: str, writes: Writes) -> None:
        if not self._prepare(peer, writes):
            return
        n = len(writes)
        lim = self._limiter
        if lim is not None and not (n <= self._chunk and lim.try_acquire(peer, n)):
            if not self._write_chunked(peer, engine_columns(writes)):
                self._raise_failed(peer, writes, "a chunk of the batch failed")
            return
        try:
            rc = self._te.batch_transfer_sync_write(peer, *engine_columns(writes))
        finally:
            if lim is not None:
                lim.release(peer, n)
        if rc != 0:
            self._raise_failed(peer, writes, f"batch_transfer_sync_write returned {rc}")

    def submit(self, peer: str, writes: Writes) -> BatchHandle:
        handle = BatchHandle(next(self._ids), peer, len(writes), writes.total_bytes)
        if not self._prepare(peer, writes):
            self._waiter.add_final(handle.id, BatchStatus.DONE)
            return handle
        n = len(writes)
        lim = self._limiter
        if lim is not None and not (n <= self._chunk and lim.try_acquire(peer, n)):
            # too big for one go, or the cap is full: the waiter thread pushes it in chunks
            lists = engine_columns(writes)
            self._waiter.add(handle.id, lambda: self._write_chunked(peer, lists))
            return handle
        credits = n if lim is not None else 0
        native_id = self._submit_native(peer, engine_columns(writes), credits)
        if native_id is None:
            self._raise_failed(peer, writes, "batch_transfer_async_write did not submit")
        self._waiter.add(handle.id, lambda: self._finish(peer, native_id, credits))
        return handle

    def poll(self, handle: BatchHandle) -> BatchStatus:
        return self._waiter.take(handle)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._waiter.stop(_CLOSE_WAIT_S)
        for addr in self._regions.starts():
            self._regions.remove(addr)
            self._te.unregister_memory(addr)

    def _check_open(self) -> None:
        if self._closed:
            raise EngineClosed(f"engine {self._session_id} is closed; build a new one")

    def _prepare(self, peer: str, writes: Writes) -> bool:
        """Checks a batch before it is sent; False when there is nothing to send."""
        self._check_open()
        if len(writes) == 0:
            return False
        bad = self._regions.outside(writes.src, writes.nbytes)
        if bad.shape[0]:
            i = int(bad[0])
            raise InvalidWrites(
                f"{bad.shape[0]} of {len(writes)} writes to {peer} read local memory outside "
                f"every registered region, first: write {i} at {int(writes.src[i]):#x} "
                f"+{int(writes.nbytes[i])} bytes; register the source buffers first"
            )
        if self._gate is not None:
            self._gate.ensure(peer)
        return True

    def _submit_native(self, peer: str, lists: _Lists, credits: int) -> int | None:
        """Hands one batch to Mooncake; None (credits returned) if it was not submitted."""
        native_id = int(self._te.batch_transfer_async_write(peer, *lists))
        if 0 < native_id < 1 << 63:  # 0 or (uint64)-1: not submitted
            return native_id
        if credits:
            assert self._limiter is not None
            self._limiter.release(peer, credits)
        return None

    def _finish(self, peer: str, native_id: int, credits: int) -> bool:
        """Waits for a submitted batch and returns its credits; True if it completed."""
        try:
            return int(self._te.get_batch_transfer_status([native_id])) == 0
        finally:
            if credits:
                assert self._limiter is not None
                self._limiter.release(peer, credits)

    def _write_chunked(self, peer: str, lists: _Lists) -> bool:
        """Writes a batch as chunks of at most half the cap, two in flight, so the link stays
        busy while one chunk's completion is awaited. True if every chunk completed."""
        lim = self._limiter
        assert lim is not None
        src, dst, nbytes = lists
        inflight: deque[tuple[int, int]] = deque()  # (native id, writes) in submit order
        ok = True
        for start in range(0, len(src), self._chunk):
            end = min(start + self._chunk, len(src))
            k = end - start
            while ok and not lim.try_acquire(peer, k):
                if inflight:
                    ok = self._finish(peer, *inflight.popleft())
                elif lim.acquire(peer, k, _CREDIT_WAIT_S):
                    break
                else:
                    ok = False  # other threads held the cap for over a minute
            if not ok:
                break
            native_id = self._submit_native(
                peer, (src[start:end], dst[start:end], nbytes[start:end]), k
            )
            if native_id is None:
                ok = False
                break
            inflight.append((native_id, k))
        while inflight:  # every submitted chunk is awaited, even after a failure
            ok = self._finish(peer, *inflight.popleft()) and ok
        return ok

    def _raise_failed(self, peer: str, writes: Writes, what: str) -> NoReturn:
        reason = f"Mooncake {what}"
        if self._gate is not None:
            self._gate.forget(peer)
            rc = self._gate.probe(peer)
            if rc != 0:
                reason += (
                    "; the peer no longer answers probes (process gone or network down)"
                    if rc is not None
                    else "; the peer did not answer a probe in time"
                )
            else:
                reason += (
                    "; the peer is alive: a destination outside its registered memory, "
                    "or Mooncake's transfer timeout (30 s + 1 s/GiB)"
                )
        raise TransferFailed(peer, len(writes), writes.total_bytes, reason)
