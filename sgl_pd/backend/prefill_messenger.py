"""Prefill side of the messenger: which decoder pages each request goes to, and the
writes that fill them (D2, D5, D6, D9, D10, D12-D14).

Two ways to send a chunk's KV:
- after the forward (`submit_chunk`, SGLang's own behaviour): one write group per link
  covers all layers, written by the worker thread once SGLang hands the chunk over;
- layer by layer (`notice_chunk` before the forward, then `write_layers` from the layer
  streamer as the progress counter advances): one write group per link and layer, so
  only about one layer's transfer is left when the forward ends.

Either way, once the last chunk is written and SGLang has filled the request's metadata
row (its last `send`), the worker writes that row (D9) and tells each decoder how many
chunks there were. Threads: the inbox thread records decoders' requests; SGLang's
scheduler thread notices chunks and polls; the worker and the layer streamer write. All
request state sits behind one lock, never held during a write.
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
from sgl_pd.core.counting import (
    WORD_BYTES,
    completion_word,
    expectation_for,
    links_into,
    metadata_word,
)
from sgl_pd.core.layout import KvLayout
from sgl_pd.core.plan import TokenRange, plan_transfer
from sgl_pd.core.regions import RegionTable
from sgl_pd.core.sharding import ShardingScheme, ShardLink, link_shards
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

SendFn = Callable[[str, Message], None]  # (inbox endpoint, message): never blocks for long

_STOP = object()

# One INFO line per request when its transfer is done (times: time.monotonic(), seconds).
TIMING_LINE_PREFIX = "sgl_pd transfer done:"


class TransferStatus:
    WAITING_FOR_DECODER = "waiting_for_decoder"  # not every decoder rank has asked yet
    READY = "ready"  # destinations known, chunks may be sent
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class Chunk:
    """One prefill chunk of one request: the tokens it makes (and any cached prefix
    before them that was not sent yet)."""

    room: int
    index: int  # chunk number of the request, from 0
    tokens: TokenRange
    src_pages: np.ndarray  # (pages,) this rank's page per logical page, up to the chunk's end
    is_last: bool


@dataclass(frozen=True)
class _Metadata:
    room: int


@dataclass
class _Room:
    """One request (SGLang's bootstrap room) on this prefill rank."""

    room: int
    created_s: float
    requests: dict[int, TransferRequest] = field(default_factory=dict)  # by decoder rank
    decoder_tp: int | None = None
    aux_index: int | None = None  # this rank's metadata row
    num_pages: int | None = None  # pages SGLang will send in all
    pages_sent: int = 0  # pages SGLang has handed to `send` so far
    tokens_planned: int = 0  # tokens covered by chunks so far
    src_pages: list[int] = field(default_factory=list)  # after-forward mode
    chunks: int = 0
    chunks_done: int = 0
    send_complete: bool = False  # SGLang's last send: the metadata row is filled
    last_chunk_done: bool = False
    metadata_queued: bool = False
    metadata_done: bool = False
    error: str | None = None
    bytes_sent: int = 0
    first_write_s: float | None = None
    last_chunk_first_write_s: float | None = None  # layer-wise: before its forward ends
    forward_end_s: float | None = None  # end of the forward of the last chunk
    last_send_s: float | None = None  # SGLang's last send: its metadata row is filled
    done_s: float | None = None

    @property
    def status(self) -> str:
        if self.error is not None:
            return TransferStatus.FAILED
        if self.decoder_tp is None or len(self.requests) < self.decoder_tp:
            return TransferStatus.WAITING_FOR_DECODER
        return TransferStatus.DONE if self.metadata_done else TransferStatus.READY


class PrefillMessenger:
    def __init__(
        self,
        *,
        rank: int,
        scheme: ShardingScheme,
        pool: PoolDescription,
        engine: TransferEngine,
        layerwise: bool,
        send_to_decoder: SendFn,
        metrics: TransferMetrics,
        timeout_s: float,
    ) -> None:
        self.rank = rank
        self.scheme = scheme
        self.pool = pool
        self.layout: KvLayout = pool.layout
        self.engine = engine
        self.layerwise = layerwise
        # one completion word per layer when streaming layer by layer, else per chunk
        self.layer_group_size = 1 if layerwise else self.layout.num_layers
        self.timeout_s = timeout_s  # seconds a request may wait for its decoder
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

    def on_transfer_request(self, request: TransferRequest) -> None:
        key = (request.decoder_inbox, request.decoder_rank)
        with self._lock:
            decoder = self._decoders.get(key)
            if decoder is not None:
                room = self._room(request.request_id)
                room.requests[request.decoder_rank] = request
                room.decoder_tp = decoder.scheme.tp_size
                return
        self._reply_error(
            request.decoder_inbox,
            request.request_id,
            ErrorCode.UNKNOWN_PEER,
            "transfer request from a decoder rank that never registered",
        )

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

    def expect(self, room_id: int, num_pages: int, aux_index: int | None) -> None:
        with self._lock:
            room = self._room(room_id)
            room.num_pages, room.aux_index = num_pages, aux_index

    def notice_chunk(
        self, room_id: int, src_pages: np.ndarray, end_token: int, is_last: bool
    ) -> Chunk | None:
        """Layer-wise mode, before the forward (D7): the chunk ending at `end_token`, with
        the request's pages up to there. None when the request is not being sent."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.error is not None or end_token <= room.tokens_planned:
                return None
            chunk = Chunk(
                room_id,
                room.chunks,
                TokenRange(room.tokens_planned, end_token),
                np.asarray(src_pages, dtype=np.int64),
                is_last,
            )
            room.chunks += 1
            room.tokens_planned = end_token
            return chunk

    def submit_chunk(self, room_id: int, pages: np.ndarray, num_tokens: int) -> None:
        """SGLang's `send` of a chunk's pages, after its forward. After-forward mode
        queues the chunk's writes; layer-wise mode only learns whether it was the last."""
        with self._lock:
            room = self._room(room_id)
            if room.error is not None:
                return
            room.pages_sent += len(pages)
            is_last = room.num_pages is not None and room.pages_sent >= room.num_pages
            chunk = None
            if not self.layerwise:
                start = len(room.src_pages) * self.layout.page_size
                room.src_pages.extend(int(p) for p in pages)
                chunk = Chunk(
                    room_id,
                    room.chunks,
                    TokenRange(start, start + num_tokens),
                    np.asarray(room.src_pages, dtype=np.int64),
                    is_last,
                )
                room.chunks += 1
                room.tokens_planned = start + num_tokens
            room.send_complete = is_last
            if is_last:
                room.last_send_s = time.monotonic()
            queue_metadata = is_last and self._metadata_due(room)
        if chunk is not None:
            self._jobs.put(chunk)
        if queue_metadata:
            self._jobs.put(_Metadata(room_id))

    def abort(self, room_id: int, reason: str) -> None:
        with self._lock:
            room = self._rooms.get(room_id)
            if room is not None and room.error is None:
                room.error = reason

    def forget(self, room_id: int) -> tuple[int, float | None]:
        """Drops a finished request; returns (bytes sent, seconds from first write to done)."""
        with self._lock:
            room = self._rooms.pop(room_id, None)
        if room is None or room.first_write_s is None or room.done_s is None:
            return (0 if room is None else room.bytes_sent), None
        return room.bytes_sent, room.done_s - room.first_write_s

    def close(self) -> None:
        self._jobs.put(_STOP)
        self._worker.join(timeout=10)
        self._words.close()

    # -- layer streamer thread ----------------------------------------------------------

    def write_layers(self, chunks: list[Chunk], layers: range) -> None:
        """Layer-wise mode: the forward has finished `layers`; write them for every chunk."""
        for chunk in chunks:
            self._guarded(chunk.room, lambda c=chunk: self._write_chunk(c, layers))

    def forward_done(self, chunks: list[Chunk]) -> None:
        for chunk in chunks:
            self._chunk_written(chunk)

    # -- scheduler thread, after a forward ------------------------------------------------

    def forward_finished(self, room_ids: list[int], at_s: float) -> None:
        """The forward holding these requests' last chunk ended at `at_s` (monotonic):
        what remains of their transfer after it is the exposed transfer time."""
        with self._lock:
            for room_id in room_ids:
                room = self._rooms.get(room_id)
                if room is not None and room.forward_end_s is None:
                    room.forward_end_s = at_s

    # -- worker thread --------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is _STOP:
                return
            if isinstance(job, Chunk):
                all_layers = range(self.layout.num_layers)
                if self._guarded(job.room, lambda j=job, ls=all_layers: self._write_chunk(j, ls)):
                    self._chunk_written(job)
            elif isinstance(job, _Metadata):
                self._guarded(job.room, lambda j=job: self._write_metadata(j.room))

    def _guarded(self, room_id: int, write: Callable[[], None]) -> bool:
        """Runs one write step; a failure fails the request, never the thread."""
        try:
            write()
            return True
        except SglPdError as e:
            logger.error("request %d: %s", room_id, e)
            self._fail(room_id, str(e))
        except Exception as e:
            logger.exception("request %d: internal error", room_id)
            self._fail(room_id, f"internal error: {e!r}")
        return False

    # -- writing (worker or streamer thread) ----------------------------------------------

    def _snapshot(
        self, room_id: int, chunk: Chunk | None = None
    ) -> tuple[dict[int, TransferRequest], dict[int, ShardRegistration]] | None:
        """Lock-free copies of a request's destinations, stamping its first writes."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.error is not None:
                return None
            now = time.monotonic()
            if room.first_write_s is None:
                room.first_write_s = now
            if chunk is not None and chunk.is_last and room.last_chunk_first_write_s is None:
                room.last_chunk_first_write_s = now
            requests = dict(room.requests)
            decoders = {r: self._decoders[(q.decoder_inbox, r)] for r, q in requests.items()}
            return requests, decoders

    def _write_chunk(self, chunk: Chunk, layers: range) -> None:
        snapshot = self._snapshot(chunk.room, chunk)
        if snapshot is None:
            return
        requests, decoders = snapshot
        sent = 0
        for decoder_rank, request in sorted(requests.items()):
            decoder = decoders[decoder_rank]
            links = self._links(request, decoder)
            mine = {i for i, link in enumerate(links) if link.src_rank == self.rank}
            if not mine:
                continue
            plan = plan_transfer(
                self.layout, links, chunk.src_pages, request.dst_pages, chunk.tokens, layers
            )
            dst_table = RegionTable.for_layout(self.layout, decoder.kv_regions)
            assert decoder.completion is not None  # a decoder registration always has one
            slot_base = decoder.completion.region.base + (
                request.completion_slot * decoder.completion.slot_bytes
            )
            # every group of these layers in one data batch, then their words in one more:
            # a word still follows all the data it stands for
            parts, words = [], []
            for group in plan.groups(chunk.index, self.layer_group_size):
                if group.link_index not in mine:
                    continue
                if group.word_offset + WORD_BYTES > decoder.completion.slot_bytes:
                    raise SglPdError(
                        f"request {request.request_id} has more chunks than the decoder's "
                        "completion slot holds; raise --chunked-prefill-size"
                    )
                batch = plan.batch(group.link_index, group.layers, self.pool.kv, dst_table)
                parts.append(Writes.of(batch.src_addrs, batch.dst_addrs, batch.lengths))
                words.append(
                    (
                        slot_base + group.word_offset,
                        completion_word(request.request_id, group.index),
                    )
                )
            writes = Writes.concat(parts)
            self._words.send_many(decoder.session, writes, words)
            sent += writes.total_bytes
        with self._lock:
            room = self._rooms.get(chunk.room)
            if room is not None:
                room.bytes_sent += sent
        self._metrics.add_bytes(sent)

    def _chunk_written(self, chunk: Chunk) -> None:
        with self._lock:
            room = self._rooms.get(chunk.room)
            if room is None or room.error is not None:
                return
            room.chunks_done += 1
            room.last_chunk_done |= chunk.is_last
            queue_metadata = self._metadata_due(room)
        if queue_metadata:
            self._jobs.put(_Metadata(chunk.room))

    def _metadata_due(self, room: _Room) -> bool:
        """Lock held. The metadata row goes once the last chunk is written and filled."""
        if room.metadata_queued or not (room.send_complete and room.last_chunk_done):
            return False
        room.metadata_queued = True
        return True

    def _write_metadata(self, room_id: int) -> None:
        """D9: the metadata row (first token, logprobs, ...) to each decoder rank whose
        metadata this rank sends, then the last chunk's notice to every decoder rank."""
        snapshot = self._snapshot(room_id)
        if snapshot is None:
            return
        requests, decoders = snapshot
        with self._lock:
            room = self._rooms[room_id]
            aux_index, last_chunk, tokens = room.aux_index, room.chunks - 1, room.tokens_planned
        sent = 0
        for decoder_rank, request in sorted(requests.items()):
            decoder = decoders[decoder_rank]
            links = self._links(request, decoder)
            if expectation_for(links, 1).metadata_source == self.rank:
                sent += self._write_metadata_row(request, decoder, aux_index)
            self._send_to_decoder(
                decoder.inbox,
                ChunkNotice(
                    request_id=request.request_id,
                    chunk_index=last_chunk,
                    token_start=0,
                    token_stop=max(1, tokens),
                    page_ids=(),
                    is_last=True,
                ),
            )
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return
            room.bytes_sent += sent
            room.metadata_done = True
            room.done_s = time.monotonic()
            self._log_timing(room)
            pages = room.num_pages or 0
            seconds = room.done_s - (room.first_write_s or room.done_s)
        self._metrics.add_bytes(sent)
        self._metrics.add_request(pages, seconds)

    def _write_metadata_row(
        self, request: TransferRequest, decoder: ShardRegistration, aux_index: int | None
    ) -> int:
        if aux_index is None or decoder.metadata is None or decoder.completion is None:
            raise SglPdError(f"request {request.request_id}: no metadata row on one side")
        src, dst, lengths = [], [], []
        for mine, theirs, item in zip(
            self.pool.aux, decoder.metadata.regions, self.pool.aux_item_bytes, strict=True
        ):
            src.append(mine.base + aux_index * item)
            dst.append(theirs.base + request.metadata_slot * item)
            lengths.append(item)
        writes = Writes.of(src, dst, lengths)
        slot_base = decoder.completion.region.base + (
            request.completion_slot * decoder.completion.slot_bytes
        )
        self._words.send(decoder.session, writes, slot_base, metadata_word(request.request_id))
        return writes.total_bytes

    def _links(self, request: TransferRequest, decoder: ShardRegistration) -> tuple[ShardLink, ...]:
        return links_into(
            link_shards(self.layout, self.scheme, decoder.scheme, request.request_id),
            request.decoder_rank,
        )

    def _log_timing(self, room: _Room) -> None:
        """Lock held. One line per request: what layer-wise streaming hides is visible here."""
        exposed = "" if room.forward_end_s is None else f" forward_end={room.forward_end_s:.6f}"
        exposed += f" last_send={room.last_send_s or 0.0:.6f}"
        logger.info(
            "%s room=%d mode=%s tokens=%d chunks=%d bytes=%d first_write=%.6f "
            "last_chunk_first_write=%.6f%s done=%.6f",
            TIMING_LINE_PREFIX,
            room.room,
            "layerwise" if self.layerwise else "after_forward",
            room.tokens_planned,
            room.chunks,
            room.bytes_sent,
            room.first_write_s or 0.0,
            room.last_chunk_first_write_s or 0.0,
            exposed,
            room.done_s or 0.0,
        )

    def _fail(self, room_id: int, reason: str) -> None:
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.error is not None:
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
