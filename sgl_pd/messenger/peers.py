"""The decode side's directory of prefill servers: bootstrap address -> prefill shards.

A decode rank learns of a prefill server from a request (the router passes its bootstrap
"host:port"). `lookup` never blocks the scheduler: it returns the cached table, or None
and asks the registry on a worker thread (one query in flight per address). A failed
query is kept (`failure`) so callers can fail requests with its message at once; the
address is asked again on a later lookup, at most once per `retry_backoff_s`, and the
old failure stands until an answer replaces it. `invalidate` forgets what is known of a
server that restarted or failed a request, so the next lookup asks afresh; the caller
also drops its links to that server's old inboxes.

A table is trusted for `max_age_s` after the registry sent it: a prefill server that
restarts while this decoder sends it nothing is noticed by no liveness check, and its
old table names inboxes nobody listens at. An older table is not returned; the lookup
asks again (see `TABLE_MAX_AGE_S`). A table in use is asked for again from half that
age on, in the background, so steady traffic never waits for a query.

Threading: `workers` named threads take addresses from a queue and call the registry
client; the tables, failures and in-flight set belong to the directory and are only
touched under its lock. Each worker decodes with a codec of its own.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass
from typing import Protocol

from sgl_pd.core.clock import Clock, SystemClock
from sgl_pd.core.errors import WireError
from sgl_pd.core.wire import FrameCodec, Role, ShardRegistration
from sgl_pd.errors import SglPdError
from sgl_pd.messenger._sockets import POLL_S, tcp_endpoint
from sgl_pd.messenger.auth import ClusterAuth
from sgl_pd.messenger.errors import BootstrapError, BootstrapTimeout, MessengerClosed
from sgl_pd.messenger.registry import QUERY_TIMEOUT_S, RETRY_INTERVAL_S, RegistryClient

logger = logging.getLogger(__name__)

RETRY_BACKOFF_S = 5.0  # a failed address is asked again at most this often
# Seconds a prefill table is used after the registry sent it. A restart (process start,
# model load, every rank registering again) takes longer than this, so a table fetched
# before the old process stopped is never returned once the new ranks registered: the
# first request after an idle restart reaches them. An idle decoder pays one registry
# round trip (milliseconds) per request at most; a busy one refreshes in the background.
TABLE_MAX_AGE_S = 5.0
WORKERS = 2  # concurrent queries: an unreachable server holds one for QUERY_TIMEOUT_S


class RegistryQuerier(Protocol):
    """What the directory needs of a registry client (`RegistryClient` or a test fake)."""

    def query(
        self,
        addr: str,
        timeout_s: float = ...,
        retry_interval_s: float = ...,
        stop: threading.Event | None = None,
    ) -> list[bytes]: ...


@dataclass(frozen=True)
class PrefillTable:
    """Every shard of one prefill server, as its ranks registered them."""

    addr: str  # bootstrap "host:port"
    shards: tuple[ShardRegistration, ...]  # indexed by rank

    @property
    def tp_size(self) -> int:
        return len(self.shards)


@dataclass(frozen=True)
class _Cached:
    table: PrefillTable
    at_s: float  # clock time the registry's answer arrived


@dataclass
class _Failure:
    error: SglPdError
    at_s: float  # clock time of the failure


class PeerDirectory:
    """Prefill tables by bootstrap address, fetched in the background."""

    def __init__(
        self,
        layout_hash: int,
        *,
        client: RegistryQuerier | None = None,
        clock: Clock | None = None,
        query_timeout_s: float = QUERY_TIMEOUT_S,
        retry_interval_s: float = RETRY_INTERVAL_S,
        retry_backoff_s: float = RETRY_BACKOFF_S,
        max_age_s: float = TABLE_MAX_AGE_S,
        workers: int = WORKERS,
        name: str = "decode",
        auth: ClusterAuth | None = None,
    ) -> None:
        """`layout_hash`: this decoder's `KvLayout.compat_hash()`; registrations of another
        layout fail with `LayoutMismatch`. Without `client` the directory makes (and
        closes) a `RegistryClient` of its own, authenticated with `auth`. A table is
        returned for `max_age_s` after the registry sent it."""
        if max_age_s <= 0:
            raise ValueError(f"a prefill table's max age must be positive, got {max_age_s} s")
        self._layout_hash = layout_hash
        self._own_client = client is None
        self._client: RegistryQuerier = client or RegistryClient(f"{name}-peers", auth=auth)
        self._clock = clock or SystemClock()
        self._query_timeout_s = query_timeout_s
        self._retry_interval_s = retry_interval_s
        self._retry_backoff_s = retry_backoff_s
        self._max_age_s = max_age_s
        self._cond = threading.Condition()  # guards the four fields below
        self._tables: dict[str, _Cached] = {}
        self._failures: dict[str, _Failure] = {}
        self._in_flight: dict[str, int] = {}  # addr -> its generation when the query began
        self._generation: dict[str, int] = {}  # bumped by invalidate: late answers are stale
        self._todo: queue.Queue[str] = queue.Queue()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._work, name=f"sgl-pd-peers-{name}-{i}", daemon=True)
            for i in range(workers)
        ]
        for t in self._threads:
            t.start()

    def lookup(self, addr: str) -> PrefillTable | None:
        """The table of the prefill server at "host:port", or None while it is not known
        (a query is then under way; see `failure`). Never blocks on the network."""
        tcp_endpoint(addr)  # a malformed address is the caller's error, raised here
        with self._cond:
            return self._lookup_locked(addr)

    def failure(self, addr: str) -> SglPdError | None:
        """Why the last query of `addr` failed (`BootstrapTimeout`, `LayoutMismatch`, ...),
        or None if it did not fail or was invalidated since."""
        with self._cond:
            f = self._failures.get(addr)
            return f.error if f else None

    def querying(self, addr: str) -> bool:
        """Whether a query of `addr` is under way."""
        with self._cond:
            return addr in self._in_flight

    def invalidate(self, addr: str) -> None:
        """Forget the table and failure of `addr`: its next lookup queries afresh."""
        with self._cond:
            self._tables.pop(addr, None)
            self._failures.pop(addr, None)
            self._generation[addr] = self._generation.get(addr, 0) + 1

    def invalidate_inbox(self, inbox: str) -> None:
        """Forget every prefill server one of whose ranks listens at `inbox` (a rank that
        stopped answering: the server may have restarted with new endpoints)."""
        with self._cond:
            stale = [
                a for a, c in self._tables.items() if any(s.inbox == inbox for s in c.table.shards)
            ]
        for addr in stale:
            self.invalidate(addr)

    def wait(self, addr: str, timeout_s: float) -> PrefillTable:
        """Blocking `lookup` for threads that may wait (start-up, tests): the table, or the
        query's error, or `BootstrapTimeout` after `timeout_s`."""
        tcp_endpoint(addr)
        deadline = self._clock.monotonic() + timeout_s
        with self._cond:
            while True:
                table = self._lookup_locked(addr)
                if table is not None:
                    return table
                f = self._failures.get(addr)
                if f is not None and addr not in self._in_flight:
                    raise f.error
                left = deadline - self._clock.monotonic()
                if left <= 0:
                    raise BootstrapTimeout(f"no registrations from {addr} within {timeout_s} s")
                self._cond.wait(min(left, POLL_S))

    def close(self, timeout_s: float = 5.0) -> None:
        """Cancel queries and stop the workers; idempotent."""
        self._stop.set()
        for t in self._threads:
            t.join(timeout_s)
            if t.is_alive():
                logger.error("%s did not stop within %.1f s", t.name, timeout_s)
        if self._own_client and isinstance(self._client, RegistryClient):
            self._client.close()
        with self._cond:
            self._cond.notify_all()

    def __enter__(self) -> PeerDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------

    def _lookup_locked(self, addr: str) -> PrefillTable | None:
        if self._stop.is_set():
            raise MessengerClosed("peer directory is closed")
        now = self._clock.monotonic()
        cached = self._tables.get(addr)
        if cached is not None:
            age = now - cached.at_s
            if age < self._max_age_s:
                if age >= self._max_age_s / 2:
                    self._ask(addr)  # in use: refreshed before it is too old to return
                return cached.table
            # Too old: the server may have restarted unnoticed. Kept only to tell whether
            # the next answer names other instances.
        if addr in self._in_flight:
            return None
        f = self._failures.get(addr)
        if f is not None and now < f.at_s + self._retry_backoff_s:
            return None
        self._ask(addr)
        return None

    def _ask(self, addr: str) -> None:
        """Queue a query of `addr` unless one is under way (under the lock)."""
        if addr not in self._in_flight:
            self._in_flight[addr] = self._generation.get(addr, 0)
            self._todo.put(addr)

    def _work(self) -> None:
        codec = FrameCodec(self._layout_hash)  # this worker's own: codecs are not thread-safe
        while not self._stop.is_set():
            try:
                addr = self._todo.get(timeout=POLL_S)
            except queue.Empty:
                continue
            table: PrefillTable | None = None
            error: SglPdError | None = None
            try:
                frames = self._client.query(
                    addr, self._query_timeout_s, self._retry_interval_s, self._stop
                )
                table = _decode_table(addr, frames, codec)
            except MessengerClosed as e:
                if self._stop.is_set():
                    return
                error = e  # an injected client was closed under us
            except SglPdError as e:
                error = e
            except Exception as e:  # a bug, not a peer fault: keep the worker alive
                logger.exception("query of prefill registry %s failed", addr)
                error = BootstrapError(f"query of prefill registry {addr} failed: {e!r}")
            self._finish(addr, table, error)

    def _finish(self, addr: str, table: PrefillTable | None, error: SglPdError | None) -> None:
        with self._cond:
            began = self._in_flight.pop(addr)
            if began != self._generation.get(addr, 0):
                pass  # invalidated meanwhile: the answer may predate a restart
            elif table is not None:
                old = self._tables.get(addr)
                self._tables[addr] = _Cached(table, self._clock.monotonic())
                self._failures.pop(addr, None)
                if old is None:
                    logger.info("prefill server %s: %d ranks", addr, table.tp_size)
                elif _instances(old.table) != _instances(table):
                    logger.info("prefill server %s restarted: %d ranks", addr, table.tp_size)
            elif error is not None:
                self._failures[addr] = _Failure(error, self._clock.monotonic())
                logger.warning("prefill server %s: %s", addr, error)
            self._cond.notify_all()


def _instances(table: PrefillTable) -> tuple[int, ...]:
    return tuple(s.instance for s in table.shards)


def _decode_table(addr: str, frames: list[bytes], codec: FrameCodec) -> PrefillTable:
    shards = []
    for rank, frame in enumerate(frames):
        try:
            reg = codec.decode(frame)
        except WireError as e:
            # Keep the type (LayoutMismatch is what the caller must see), add who sent it.
            raise type(e)(f"registration of prefill rank {rank} at {addr}: {e}") from e
        if not isinstance(reg, ShardRegistration):
            raise BootstrapError(
                f"prefill registry at {addr} sent a {type(reg).__name__} as rank {rank}"
            )
        if reg.role is not Role.PREFILL or reg.rank != rank or reg.scheme.tp_size != len(frames):
            raise BootstrapError(
                f"prefill registry at {addr} sent, as rank {rank} of {len(frames)}, the"
                f" registration of {reg.role.value} rank {reg.rank} of {reg.scheme.tp_size}"
            )
        shards.append(reg)
    return PrefillTable(addr, tuple(shards))
