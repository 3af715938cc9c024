"""Decode side of the messenger: asks prefill ranks for a request's KV and counts
completion words until it is all there (D2, D3, D10).

The decoder never receives a "done" message: each prefill rank writes one 8-byte word per
finished write group into this rank's completion area (registered memory, one slot per
request, indexed by SGLang's metadata row), and `poll` counts them. The only messages
back are the last chunk's notice (how many chunks there were) and errors.

Threads: the inbox thread calls `on_chunk_notice` / `on_error`; SGLang's scheduler
thread calls everything else. State sits behind one lock.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from sgl_pd.backend.metrics import TransferMetrics
from sgl_pd.backend.pool import PoolDescription
from sgl_pd.core.counting import (
    METADATA_WORD,
    WORD_BYTES,
    CompletionCounter,
    expectation_for,
    links_into,
    locate_group,
    metadata_word,
    parse_completion_word,
)
from sgl_pd.core.errors import CountingError
from sgl_pd.core.regions import Region
from sgl_pd.core.sharding import ShardingScheme, ShardLink, link_shards
from sgl_pd.core.wire import (
    Abort,
    AbortReason,
    ChunkNotice,
    ErrorMsg,
    Message,
    ShardRegistration,
    SlotArea,
    TransferRequest,
)
from sgl_pd.transfer.engine import TransferEngine

logger = logging.getLogger("sgl_pd.decode")

SLOT_WORDS = 1024  # completion words per request: word 0 metadata, then one per group

SendFn = Callable[[str, Message], None]  # (inbox endpoint, message)


class KvStatus(enum.Enum):
    TRANSFERRING = "transferring"
    DONE = "done"
    FAILED = "failed"


@dataclass
class _Track:
    """One request's transfer as this decoder rank sees it."""

    room: int
    slot: int
    links: tuple[ShardLink, ...]
    counter: CompletionCounter
    metadata_source: int  # the prefill rank that writes word 0
    prefill_inboxes: tuple[str, ...]  # where an abort must go
    deadline_s: float
    started_s: float
    num_pages: int
    seen_words: set[int] = field(default_factory=set)
    error: str | None = None
    done_s: float | None = None


class DecodeMessenger:
    def __init__(
        self,
        *,
        rank: int,
        scheme: ShardingScheme,
        pool: PoolDescription,
        engine: TransferEngine,
        send_to_prefill: SendFn,
        transfer_timeout_s: float,
        metrics: TransferMetrics,
    ) -> None:
        self.rank = rank
        self.scheme = scheme
        self.pool = pool
        self.engine = engine
        self._send = send_to_prefill
        self._timeout_s = transfer_timeout_s
        self._metrics = metrics
        # (slots, SLOT_WORDS) uint64, written only by prefill ranks through the engine
        self._words = np.zeros((pool.aux_rows, SLOT_WORDS), dtype=np.uint64)
        engine.register(int(self._words.ctypes.data), self._words.nbytes)
        self._lock = threading.Lock()
        self._tracks: dict[int, _Track] = {}
        self._sealed: dict[int, int] = {}  # room -> chunks, from a notice that came early
        # (prefill inbox, instance) that has our registration; a restarted prefill rank is a
        # new instance and is greeted again. Scheduler thread only.
        self._greeted: set[tuple[str, int]] = set()

    @property
    def completion_area(self) -> SlotArea:
        return SlotArea(
            region=Region(int(self._words.ctypes.data), self._words.nbytes),
            slot_bytes=SLOT_WORDS * WORD_BYTES,
            num_slots=self._words.shape[0],
        )

    # -- inbox thread -------------------------------------------------------------------

    def on_chunk_notice(self, notice: ChunkNotice) -> None:
        if not notice.is_last:
            return
        with self._lock:
            track = self._tracks.get(notice.request_id)
            if track is None:
                self._sealed[notice.request_id] = notice.chunk_index + 1
                return
            self._seal(track, notice.chunk_index + 1)

    def on_error(self, error: ErrorMsg) -> None:
        if error.request_id is None:
            logger.warning("prefill reports: %s (%s)", error.message, error.code.value)
            return
        with self._lock:
            track = self._tracks.get(error.request_id)
            if track is not None and track.error is None:
                track.error = f"prefill reports {error.code.value}: {error.message}"

    # -- scheduler thread -----------------------------------------------------------------

    def request(
        self,
        room: int,
        prefills: list[ShardRegistration],
        my_registration: ShardRegistration,
        dst_pages: np.ndarray,
        slot: int,
    ) -> None:
        """Sends one request's destination pages to every prefill rank of its prefiller.

        Every rank gets the request, also those that send nothing to this rank: a prefill
        rank only starts once every decoder rank has asked, so none waits forever.
        """
        prefill = prefills[0]
        layer_groups = len(prefill.layout.layer_groups(prefill.layer_group_size))
        links = links_into(
            link_shards(prefill.layout, prefill.scheme, self.scheme, room), self.rank
        )
        expectation = expectation_for(links, layer_groups)
        counter = CompletionCounter(
            expectation, max_chunks=expectation.max_chunks(SLOT_WORDS * WORD_BYTES)
        )
        self._words[slot, :] = 0  # a late word of the slot's previous request is ignored too
        now = time.monotonic()
        track = _Track(
            room,
            slot,
            links,
            counter,
            expectation.metadata_source,
            tuple(peer.inbox for peer in prefills),
            now + self._timeout_s,
            now,
            len(dst_pages),
        )
        with self._lock:
            self._tracks[room] = track
            early = self._sealed.pop(room, None)
            if early is not None:
                self._seal(track, early)
        message = TransferRequest(
            request_id=room,
            decoder_rank=self.rank,
            decoder_instance=my_registration.instance,
            decoder_inbox=my_registration.inbox,
            dst_pages=tuple(int(p) for p in dst_pages),
            metadata_slot=slot,
            completion_slot=slot,
        )
        for peer in prefills:
            key = (peer.inbox, peer.instance)
            if key not in self._greeted:
                self._send(peer.inbox, my_registration)
                self._greeted.add(key)
            self._send(peer.inbox, message)

    def poll(self, room: int) -> tuple[KvStatus, str | None]:
        """Counts the request's new completion words; (status, error message)."""
        with self._lock:
            track = self._tracks.get(room)
            if track is None:
                return KvStatus.FAILED, f"request {room} is not being transferred here"
            if track.error is None and track.done_s is None:
                self._count(track)
            if track.done_s is not None:
                return KvStatus.DONE, None
            if track.error is None and time.monotonic() > track.deadline_s:
                track.error = (
                    f"KV transfer did not complete within {self._timeout_s:g} s "
                    f"({track.counter.received} write groups arrived); raise "
                    "--pd-transfer-timeout or check the prefill server's log"
                )
            if track.error is not None:
                return KvStatus.FAILED, track.error
            return KvStatus.TRANSFERRING, None

    def fail(self, room: int, reason: str, abort: AbortReason = AbortReason.ERROR) -> None:
        """Marks the request failed and tells its prefill ranks to stop writing it."""
        with self._lock:
            track = self._tracks.get(room)
            if track is None or track.done_s is not None:
                return
            if track.error is None:
                track.error = reason
            inboxes = track.prefill_inboxes
        self._metrics.add_failure()
        for inbox in inboxes:
            self._send(inbox, Abort(request_id=room, reason=abort, detail=reason))

    def forget(self, room: int) -> None:
        with self._lock:
            self._tracks.pop(room, None)
            self._sealed.pop(room, None)

    # -- helpers (lock held) --------------------------------------------------------------

    def _seal(self, track: _Track, num_chunks: int) -> None:
        try:
            track.counter.seal(num_chunks)
        except CountingError as e:
            track.error = f"inconsistent completion count: {e}"
        self._check_done(track)

    def _count(self, track: _Track) -> None:
        # A snapshot: prefill ranks keep writing into the live row while we scan it. A
        # word caught half-written fails its request tag and is read again next poll.
        row = self._words[track.slot].copy()
        for w in np.flatnonzero(row).tolist():
            if w in track.seen_words:
                continue
            word = int(row[w])
            try:
                if w == METADATA_WORD:
                    if word != metadata_word(track.room):
                        continue  # a word left from the slot's previous request
                    track.counter.record_metadata(track.metadata_source)
                else:
                    index = parse_completion_word(word, track.room)
                    if index is None:
                        continue
                    track.counter.record(*locate_group(index, track.links))
            except CountingError as e:
                track.error = f"inconsistent completion words: {e}"
                return
            track.seen_words.add(w)
        self._check_done(track)

    def _check_done(self, track: _Track) -> None:
        if track.error is None and track.done_s is None and track.counter.is_complete:
            track.done_s = time.monotonic()
            self._metrics.add_request(track.num_pages, track.done_s - track.started_s)
