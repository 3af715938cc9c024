"""Prefill side of the messenger: which decoder pages each request goes to, and the
thread that writes them (D2, D5, D9, D10, D12-D14).

Threads: the inbox thread records decoder registrations and transfer requests
(`on_message`); SGLang's scheduler thread adds chunks (`submit_chunk`) and polls; one
worker thread per rank plans and writes every chunk, then the completion words. All
request state sits behind one lock; the worker never holds it while writing.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from sgl_pd.backend.metrics import TransferMetrics
from sgl_pd.backend.pool import PoolDescription
from sgl_pd.core.counting import WORD_BYTES, completion_word, links_into, metadata_word
from sgl_pd.core.layout import KvLayout
from sgl_pd.core.plan import TokenRange, plan_transfer
from sgl_pd.core.regions import RegionTable
from sgl_pd.core.sharding import ShardingScheme, link_shards
from sgl_pd.core.wire import (
    ChunkNotice,
    ErrorCode,
    ErrorMsg,
    Message,
    ShardRegistration,
    TransferRequest,
)
from sgl_pd.errors import SglPdError
from sgl_pd.transfer.completion import CompletionWordWriter
from sgl_pd.transfer.engine import TransferEngine, Writes

logger = logging.getLogger("sgl_pd.prefill")

_STOP = object()

SendFn = Callable[[str, Message], None]  # (inbox endpoint, message): never blocks for long


class TransferStatus:
    WAITING_FOR_DECODER = "waiting_for_decoder"  # not every decoder rank has asked yet
    READY = "ready"  # destinations known, chunks may be sent
    DONE = "done"
    FAILED = "failed"


@dataclass
class _Room:
    """One request (SGLang's bootstrap room) on this prefill rank."""

    room: int
    created_s: float
    requests: dict[int, TransferRequest] = field(default_factory=dict)  # by decoder rank
    decoder_tp: int | None = None
    src_pages: list[int] = field(default_factory=list)  # this rank's page per logical page
    aux_index: int | None = None  # this rank's metadata row
    num_pages: int | None = None  # pages SGLang will send in all
    chunks_submitted: int = 0
    chunks_done: int = 0
    last_submitted: bool = False
    error: str | None = None
    bytes_sent: int = 0
    first_write_s: float | None = None
    done_s: float | None = None

    @property
    def status(self) -> str:
        if self.error is not None:
            return TransferStatus.FAILED
        if self.decoder_tp is None or len(self.requests) < self.decoder_tp:
            return TransferStatus.WAITING_FOR_DECODER
        if self.last_submitted and self.chunks_done == self.chunks_submitted:
            return TransferStatus.DONE
        return TransferStatus.READY


@dataclass(frozen=True)
class _Chunk:
    room: int
    index: int  # chunk number of the request, from 0
    tokens: TokenRange  # token positions the chunk covers
    is_last: bool


class PrefillMessenger:
    def __init__(
        self,
        *,
        rank: int,
        scheme: ShardingScheme,
        pool: PoolDescription,
        engine: TransferEngine,
        layer_group_size: int,
        send_to_decoder: SendFn,
        metrics: TransferMetrics,
        timeout_s: float,
    ) -> None:
        self.rank = rank
        self.timeout_s = timeout_s  # seconds a request may wait for its decoder
        self.scheme = scheme
        self.pool = pool
        self.layout: KvLayout = pool.layout
        self.engine = engine
        self.layer_group_size = layer_group_size
        self._send_to_decoder = send_to_decoder
        self._metrics = metrics
        self._words = CompletionWordWriter(engine)
        self._lock = threading.Lock()
        self._rooms: dict[int, _Room] = {}
        self._decoders: dict[tuple[str, int], ShardRegistration] = {}  # (inbox, rank)
        self._jobs: queue.Queue[object] = queue.Queue()
        self._worker = threading.Thread(
            target=self._run, name=f"sgl-pd-prefill-writer-{rank}", daemon=True
        )
        self._worker.start()

    # -- inbox thread -------------------------------------------------------------------

    def on_registration(self, registration: ShardRegistration) -> None:
        with self._lock:
            self._decoders[(registration.inbox, registration.rank)] = registration
            # a restarted decoder rank replaces its old registration under the same inbox
            # only if the port was reused; stale entries are harmless and small

    def on_transfer_request(self, request: TransferRequest) -> None:
        decoder_inbox = request.decoder_inbox
        with self._lock:
            if (decoder_inbox, request.decoder_rank) not in self._decoders:
                self._reply_error(
                    decoder_inbox,
                    request.request_id,
                    ErrorCode.UNKNOWN_PEER,
                    "transfer request from a decoder rank that never registered",
                )
                return
            room = self._room(request.request_id)
            room.requests[request.decoder_rank] = request
            room.decoder_tp = self._decoders[(decoder_inbox, request.decoder_rank)].scheme.tp_size

    # -- scheduler thread -----------------------------------------------------------------

    def track(self, room_id: int) -> None:
        """Starts the clock of a new request: its decoder must ask within the timeout."""
        with self._lock:
            self._room(room_id)

    def status(self, room_id: int) -> str:
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return TransferStatus.FAILED
            if (
                room.status == TransferStatus.WAITING_FOR_DECODER
                and time.monotonic() - room.created_s > self.timeout_s
            ):
                room.error = (
                    f"no decoder asked for request {room_id} within {self.timeout_s:g} s; "
                    "check that the decode server reaches this prefiller's bootstrap port"
                )
            return room.status

    def error(self, room_id: int) -> str | None:
        with self._lock:
            room = self._rooms.get(room_id)
            return None if room is None else room.error

    def expect(self, room_id: int, num_pages: int, aux_index: int) -> None:
        with self._lock:
            room = self._room(room_id)
            room.num_pages, room.aux_index = num_pages, aux_index

    def submit_chunk(self, room_id: int, pages: np.ndarray, num_tokens: int) -> None:
        """Queues the next chunk of a request: its source pages and the tokens they hold."""
        with self._lock:
            room = self._room(room_id)
            if room.error is not None:
                return
            start_token = len(room.src_pages) * self.layout.page_size
            room.src_pages.extend(int(p) for p in pages)
            is_last = room.num_pages is not None and len(room.src_pages) >= room.num_pages
            chunk = _Chunk(
                room_id,
                room.chunks_submitted,
                TokenRange(start_token, start_token + num_tokens),
                is_last,
            )
            room.chunks_submitted += 1
            room.last_submitted = is_last
        self._jobs.put(chunk)

    def abort(self, room_id: int, reason: str) -> None:
        with self._lock:
            room = self._rooms.get(room_id)
            if room is not None and room.error is None:
                room.error = reason

    def forget(self, room_id: int) -> tuple[int, float | None]:
        """Drops a finished request; returns (bytes sent, seconds from first write to done)."""
        with self._lock:
            room = self._rooms.pop(room_id, None)
        if room is None:
            return 0, None
        elapsed = (
            None
            if room.first_write_s is None or room.done_s is None
            else room.done_s - room.first_write_s
        )
        return room.bytes_sent, elapsed

    def close(self) -> None:
        self._jobs.put(_STOP)
        self._worker.join(timeout=10)
        self._words.close()

    # -- worker thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            assert isinstance(job, _Chunk)
            try:
                self._write_chunk(job)
            except SglPdError as e:
                logger.error("request %d chunk %d failed: %s", job.room, job.index, e)
                self._fail(job.room, str(e))
            except Exception as e:  # a bug must fail the request, not kill the worker
                logger.exception("request %d chunk %d failed", job.room, job.index)
                self._fail(job.room, f"internal error: {e!r}")

    def _write_chunk(self, chunk: _Chunk) -> None:
        with self._lock:
            room = self._rooms.get(chunk.room)
            if room is None or room.error is not None:
                return
            requests = dict(room.requests)
            src_pages = np.asarray(room.src_pages, dtype=np.int64)
            aux_index = room.aux_index
            if room.first_write_s is None:
                room.first_write_s = time.monotonic()
            decoders = {
                rank: self._decoders[(req.decoder_inbox, rank)] for rank, req in requests.items()
            }
        sent = 0
        for decoder_rank, request in sorted(requests.items()):
            decoder = decoders[decoder_rank]
            sent += self._write_to_decoder(chunk, request, decoder, src_pages, aux_index)
        with self._lock:
            room = self._rooms.get(chunk.room)
            if room is None:
                return
            room.bytes_sent += sent
            room.chunks_done += 1
            if room.status == TransferStatus.DONE:
                room.done_s = time.monotonic()
        self._metrics.add_bytes(sent)

    def _write_to_decoder(
        self,
        chunk: _Chunk,
        request: TransferRequest,
        decoder: ShardRegistration,
        src_pages: np.ndarray,
        aux_index: int | None,
    ) -> int:
        """Writes this rank's share of one chunk to one decoder rank; returns bytes."""
        links = links_into(
            link_shards(self.layout, self.scheme, decoder.scheme, request.request_id),
            request.decoder_rank,
        )
        mine = [i for i, link in enumerate(links) if link.src_rank == self.rank]
        dst_table = RegionTable.for_layout(self.layout, decoder.kv_regions)
        slot_base = decoder.completion.region.base + (
            request.completion_slot * decoder.completion.slot_bytes
        )
        sent = 0
        if mine:
            plan = plan_transfer(self.layout, links, src_pages, request.dst_pages, chunk.tokens)
            groups = [
                g for g in plan.groups(chunk.index, self.layer_group_size) if g.link_index in mine
            ]
            for group in groups:
                batch = plan.batch(group.link_index, group.layers, self.pool.kv, dst_table)
                writes = Writes.of(batch.src_addrs, batch.dst_addrs, batch.lengths)
                word_addr = slot_base + group.word_offset
                if group.word_offset + WORD_BYTES > decoder.completion.slot_bytes:
                    raise SglPdError(
                        f"request {request.request_id} has more chunks than the decoder's "
                        "completion slot holds; raise --chunked-prefill-size"
                    )
                self._words.send(
                    decoder.session,
                    writes,
                    word_addr,
                    completion_word(request.request_id, group.index),
                )
                sent += writes.total_bytes
        if chunk.is_last:
            meta_source = min(links, key=lambda link: (link.head_lo, link.src_rank)).src_rank
            if meta_source == self.rank:
                sent += self._write_metadata(request, decoder, aux_index, slot_base)
            self._send_to_decoder(
                decoder.inbox,
                ChunkNotice(
                    request_id=request.request_id,
                    chunk_index=chunk.index,
                    token_start=chunk.tokens.start,
                    token_stop=chunk.tokens.stop,
                    page_ids=(),
                    is_last=True,
                ),
            )
        return sent

    def _write_metadata(
        self,
        request: TransferRequest,
        decoder: ShardRegistration,
        aux_index: int | None,
        slot_base: int,
    ) -> int:
        """D9: this rank's metadata row (first token, logprobs, ...) to the decoder's row."""
        if aux_index is None or decoder.metadata is None:
            raise SglPdError(f"request {request.request_id}: no metadata row on one side")
        src, dst, lengths = [], [], []
        for mine, theirs, item in zip(
            self.pool.aux, decoder.metadata.regions, self.pool.aux_item_bytes, strict=True
        ):
            src.append(mine.base + aux_index * item)
            dst.append(theirs.base + request.metadata_slot * item)
            lengths.append(item)
        writes = Writes.of(src, dst, lengths)
        self._words.send(decoder.session, writes, slot_base, metadata_word(request.request_id))
        return writes.total_bytes

    def _fail(self, room_id: int, reason: str) -> None:
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return
            room.error = reason
            targets = [(req.decoder_inbox, req.request_id) for req in room.requests.values()]
        self._metrics.add_failure()
        for inbox, request_id in targets:
            self._reply_error(inbox, request_id, ErrorCode.TRANSFER_FAILED, reason)

    def _reply_error(self, inbox: str, request_id: int, code: ErrorCode, message: str) -> None:
        self._send_to_decoder(inbox, ErrorMsg(request_id=request_id, code=code, message=message))

    def _room(self, room_id: int) -> _Room:
        room = self._rooms.get(room_id)
        if room is None:
            room = self._rooms[room_id] = _Room(room_id, time.monotonic())
        return room
