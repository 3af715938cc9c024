"""Whether a request's KV is all here: the completion words prefill ranks write into
this rank's completion area, and their last-chunk notices, which seal the count (D10).

The decoder never receives a "done" message: each prefill rank writes its count of
finished write groups into its own word of this rank's completion area (registered
memory, one slot per request, indexed by SGLang's metadata row), and `count` reads them
(`core.counting`). The only messages back are the last chunk's notice (how many chunks
there were, the prompt's length, --pd-kv-checksum sums), errors and drain acks.
Everything here runs under the messenger's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np

from sgl_pd.backend.decode.track import Track
from sgl_pd.backend.metrics import TransferMetrics
from sgl_pd.backend.pool import PoolDescription
from sgl_pd.core.clock import Clock
from sgl_pd.core.counting import (
    METADATA_WORD,
    SLOT_WORDS,
    WORD_BYTES,
    metadata_word,
    parse_count_word,
    source_word_index,
)
from sgl_pd.core.errors import CountingError
from sgl_pd.core.failures import FailureCause
from sgl_pd.core.regions import Region
from sgl_pd.core.states import DecodeState, RequestTracker
from sgl_pd.core.wire import ChunkNotice, SlotArea
from sgl_pd.log_limits import LogLimiter
from sgl_pd.transfer.engine import TransferEngine

logger = logging.getLogger("sgl_pd.decode")
_log = LogLimiter(logger)
MAX_EARLY_NOTICES = 4096  # requests not tracked yet whose last-chunk notices are kept
MAX_EARLY_PER_ROOM = 1024  # ... notices of one such request (one per prefill rank)
# (request, why, the cause counted): the messenger's first-failure-counts rule
FailFn = Callable[[Track, str, FailureCause], None]
_D = DecodeState


def refused(room: int, sender: int | None, what: str) -> None:
    _log.warning(
        what,
        "ignored a %s for request %d from prefill instance %s, which was not asked for it",
        what,
        room,
        sender,
    )


class Completion:
    """`checksums`: --pd-kv-checksum (a request completes only with every summing rank's
    sums). `fail`: fails a request (the messenger's)."""

    def __init__(
        self,
        *,
        pool: PoolDescription,
        engine: TransferEngine,
        states: RequestTracker[DecodeState],
        metrics: TransferMetrics,
        clock: Clock,
        checksums: bool,
        fail: FailFn,
    ) -> None:
        self._pool = pool
        self._states = states
        self._metrics = metrics
        self._clock = clock
        self._checksums = checksums
        self._fail = fail
        # (slots, SLOT_WORDS) uint64, written only by prefill ranks through the engine
        self._words = np.zeros((pool.aux_rows, SLOT_WORDS), dtype=np.uint64)
        engine.register(int(self._words.ctypes.data), self._words.nbytes)
        # room -> (first seen at, its last-chunk notices): notices that came before the
        # request was tracked here (one per prefill rank); at most MAX_EARLY_NOTICES
        # rooms, each dropped after the transfer timeout, so that strangers cannot grow it
        self._early: dict[int, tuple[float, list[ChunkNotice]]] = {}

    @property
    def area(self) -> SlotArea:
        return SlotArea(
            region=Region(int(self._words.ctypes.data), self._words.nbytes),
            slot_bytes=SLOT_WORDS * WORD_BYTES,
            num_slots=self._words.shape[0],
        )

    def reset_slot(self, slot: int) -> None:
        """A new request takes the slot: a late word of its previous request is ignored
        too (its tag differs)."""
        self._words[slot, :] = 0

    # -- last-chunk notices ---------------------------------------------------------------

    def keep_early(self, notice: ChunkNotice) -> None:
        """A last-chunk notice of a request not tracked yet, kept for `take_early`."""
        early = self._early.get(notice.request_id)
        if early is not None and len(early[1]) < MAX_EARLY_PER_ROOM:
            early[1].append(notice)
        elif early is None and len(self._early) < MAX_EARLY_NOTICES:
            self._early[notice.request_id] = (self._clock.monotonic(), [notice])

    @property
    def early_rooms(self) -> int:
        """Requests with notices that came before the request did."""
        return len(self._early)

    def take_early(self, room: int) -> list[ChunkNotice]:
        early = self._early.pop(room, None)
        return [] if early is None else early[1]

    def expire_early(self, now: float, timeout_s: float) -> None:
        for room in [r for r, (t, _) in self._early.items() if now - t > timeout_s]:
            del self._early[room]

    def take_notice(self, track: Track, notice: ChunkNotice) -> None:
        """A prefill rank's last-chunk notice: it seals the count, and under
        --pd-kv-checksum brings that rank's sums of what it wrote here."""
        ranks = [r for r, i in track.instances.items() if i == notice.prefill_instance]
        if not ranks:
            refused(notice.request_id, notice.prefill_instance, "chunk notice")
            return
        if self._checksums and ranks[0] in track.summed_sources:
            if len(notice.checksums) != self._pool.layout.num_regions:
                self._fail(
                    track,
                    f"prefill rank {ranks[0]} sent no KV checksums: start the prefill server"
                    " with --pd-kv-checksum too (or neither)",
                    FailureCause.REFUSED,
                )
                return
            track.sums[ranks[0]] = notice.checksums
        self._seal(track, notice.num_chunks, notice.token_stop)

    def _seal(self, track: Track, num_chunks: int, prompt_tokens: int) -> None:
        """`prompt_tokens`: the tokens whose KV the prefiller computed (held ones too):
        any other number than the request needs would have it decode from a wrong token."""
        track.prompt_tokens = prompt_tokens
        if track.kv_tokens is not None and prompt_tokens != track.kv_tokens:
            self._fail(
                track,
                f"the prefill server computed the KV of {prompt_tokens} prompt tokens and"
                f" this decoder expects {track.kv_tokens}: the two servers read the"
                " request's prompt differently",
                FailureCause.REFUSED,
            )
            return
        try:
            track.counter.seal(num_chunks)
        except CountingError as e:
            self._fail(track, f"inconsistent completion count: {e}", FailureCause.WRITE_FAILURE)
        self.check_done(track)

    # -- completion words -----------------------------------------------------------------

    def count(self, track: Track) -> None:
        """Reads the request's completion words."""
        # A snapshot: prefill ranks keep writing into the live row while we read it. A
        # word caught half-written fails its request tag and is read again next poll.
        row = self._words[track.slot].copy()
        received = track.counter.received
        try:
            if not track.metadata_seen and int(row[METADATA_WORD]) == metadata_word(track.room):
                track.metadata_seen = True
                track.counter.record_metadata(track.metadata_source)
            for src in track.sources:
                count = parse_count_word(int(row[source_word_index(src)]), track.room)
                if count is not None:
                    track.counter.observe(src, count)
        except CountingError as e:
            self._fail(track, f"inconsistent completion words: {e}", FailureCause.WRITE_FAILURE)
            return
        if track.counter.received and self._states.state(track.room) is _D.REQUESTED:
            self._states.transition(track.room, _D.TRANSFERRING)
        elif track.counter.received > received:
            self._states.progressed(track.room)  # the deadline bounds a stall
        self.check_done(track)

    def check_done(self, track: Track) -> None:
        """Completes the request once its count is full (and, under --pd-kv-checksum,
        every summing rank's sums came).

        Completion: a full count proves every write landed. Each prefill rank writes its
        count only after the data batches it counts completed, and the count a sealed
        counter expects covers every write group of every link into this rank
        (`core.counting`, its ordering argument); the metadata word is counted too. So
        nothing of the request is in flight any more: its pages may be read (hand-off)
        or freed (`release.nothing_can_land`)."""
        summed = not self._checksums or track.summed_sources <= track.sums.keys()
        if track.error is None and track.done_s is None and track.counter.is_complete and summed:
            track.done_s = self._clock.monotonic()
            if self._states.state(track.room) is _D.REQUESTED:
                self._states.transition(track.room, _D.TRANSFERRING)
            self._states.transition(track.room, _D.COMPLETE)
            self._metrics.add_request(track.num_pages, track.done_s - track.started_s)
            pool = self._pool
            token_bytes = pool.layout.num_regions * pool.local_heads * pool.layout.row_bytes
            self._metrics.decode_prefix(
                track.held_tokens,
                max(0, track.prompt_tokens - track.held_tokens),
                track.held_tokens * token_bytes,
            )
            self._metrics.decode_done(track.done_s - track.started_s)
