"""The transfer engine contract: what the messenger needs from a one-sided write transport.

A batch is a set of one-sided writes from this process's registered memory into a peer's
registered memory. The engine says nothing about *when* the peer notices the bytes: that is
what completion words are for (``sgl_pd.transfer.completion``, D10).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from sgl_pd.transfer.errors import InvalidWrites

Int64Array = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True, eq=False)
class Writes:
    """A batch of one-sided writes as three parallel int64 arrays of shape (n,).

    Columns rather than one object per write: a 64k-page request is three arrays, built with
    numpy arithmetic by the planner and handed to the engine without a Python loop. Treat
    the arrays as immutable once wrapped.
    """

    src: Int64Array  # (n,) local addresses, bytes
    dst: Int64Array  # (n,) peer addresses, bytes
    nbytes: Int64Array  # (n,) lengths, bytes, each > 0

    def __post_init__(self) -> None:
        for name in ("src", "dst", "nbytes"):
            col = getattr(self, name)
            if not isinstance(col, np.ndarray) or col.dtype != np.int64 or col.ndim != 1:
                raise InvalidWrites(
                    f"Writes.{name} must be a 1-D int64 numpy array; build batches with "
                    "Writes.of(...), which converts"
                )
        n = self.src.shape[0]
        if self.dst.shape[0] != n or self.nbytes.shape[0] != n:
            raise InvalidWrites(
                f"Writes columns differ in length: src {n}, dst {self.dst.shape[0]}, "
                f"nbytes {self.nbytes.shape[0]}"
            )
        if n and (
            int(self.nbytes.min()) <= 0 or int(self.src.min()) < 0 or int(self.dst.min()) < 0
        ):
            raise InvalidWrites("every write needs nbytes > 0 and non-negative addresses")

    @classmethod
    def of(cls, src: npt.ArrayLike, dst: npt.ArrayLike, nbytes: npt.ArrayLike) -> Writes:
        """Builds a batch from anything numpy turns into int64 columns; a scalar `nbytes` is
        broadcast to every write (pages of one size)."""
        src_a = np.ascontiguousarray(src, dtype=np.int64).reshape(-1)
        dst_a = np.ascontiguousarray(dst, dtype=np.int64).reshape(-1)
        len_a = np.ascontiguousarray(nbytes, dtype=np.int64).reshape(-1)
        if len_a.shape[0] == 1 and src_a.shape[0] != 1:
            len_a = np.full(src_a.shape[0], len_a[0], dtype=np.int64)
        return cls(src_a, dst_a, len_a)

    @classmethod
    def trusted(cls, src: Int64Array, dst: Int64Array, nbytes: Int64Array) -> Writes:
        """Wraps columns that are valid by construction (the planner's: int64, 1-D, of one
        length, positive sizes, addresses inside registered regions) without checking them
        again: layer-wise streaming wraps one batch per layer, and the checks cost more
        than the slicing that made it."""
        writes = object.__new__(cls)
        object.__setattr__(writes, "src", src)
        object.__setattr__(writes, "dst", dst)
        object.__setattr__(writes, "nbytes", nbytes)
        return writes

    @classmethod
    def single(cls, src: int, dst: int, nbytes: int) -> Writes:
        return cls.of([src], [dst], [nbytes])

    @classmethod
    def empty(cls) -> Writes:
        z = np.zeros(0, dtype=np.int64)
        return cls(z, z, z)

    @classmethod
    def concat(cls, parts: list[Writes]) -> Writes:
        if not parts:
            return cls.empty()
        if len(parts) == 1:
            return parts[0]  # immutable by contract: no copy needed
        return cls(
            np.concatenate([p.src for p in parts]),
            np.concatenate([p.dst for p in parts]),
            np.concatenate([p.nbytes for p in parts]),
        )

    def __len__(self) -> int:
        return int(self.src.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.nbytes.sum())  # bytes


class MetadataWrites(Writes):
    """A batch of a request's metadata rows (D9), not its KV: what --pd-kv-checksum does
    not cover, so fault injection leaves it whole (`transfer.faults`)."""

    __slots__ = ()


class BatchStatus(enum.Enum):
    """The state of a submitted batch. PENDING -> DONE or PENDING -> FAILED, nothing else."""

    PENDING = "pending"
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True, slots=True)
class BatchHandle:
    """Names one submitted batch of one engine; only that engine can poll it."""

    id: int  # engine-local sequence number, never reused
    peer: str  # session id the batch writes to
    n_writes: int
    nbytes: int  # bytes in the batch


@runtime_checkable
class TransferEngine(Protocol):
    """One-sided writes from local registered memory into a peer's registered memory.

    Implementations are thread-safe: `write`, `submit` and `poll` may be called from several
    threads at once. Peers are named by their `session_id` ("host:port").
    """

    @property
    def session_id(self) -> str:
        """The "host:port" other engines pass as `peer` to write into this one."""
        ...

    def register(self, addr: int, nbytes: int, *, location: str = "*") -> None:
        """Registers [addr, addr + nbytes) as a source and destination of writes.

        `location` names where the memory lives ("cpu:0", "cuda:3"; "*" = let the engine
        find out); RDMA backends pick the NIC nearest to it. Raises `RegistrationError` if
        the range overlaps a registered one or the backend refuses it.
        """
        ...

    def unregister(self, addr: int) -> None:
        """Unregisters the region registered at `addr`; raises `RegistrationError` if none
        starts there. The caller makes sure no batch still reads or writes it."""
        ...

    def write(self, peer: str, writes: Writes) -> None:
        """Writes the batch and returns once every write has completed.

        Raises `InvalidWrites` (nothing sent), `PeerUnreachable` (nothing sent) or
        `TransferFailed` (some writes may have landed).
        """
        ...

    def submit(self, peer: str, writes: Writes) -> BatchHandle:
        """Starts the batch and returns at once. Raises like `write` for what is known at
        submission; later failures surface as `BatchStatus.FAILED` from `poll`."""
        ...

    def poll(self, handle: BatchHandle) -> BatchStatus:
        """Returns the batch's status without blocking. DONE or FAILED is reported once;
        polling the handle again raises `UnknownBatch`."""
        ...

    def close(self) -> None:
        """Stops background work and unregisters all memory. Idempotent."""
        ...
