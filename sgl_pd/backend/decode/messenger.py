"""Decode side of the messenger: asks prefill ranks for a request's KV and counts
completion words until it is all there (D2, D3, D10).

The decoder never receives a "done" message: each prefill rank writes its count of
finished write groups into its own word of this rank's completion area (registered
memory, one slot per request, indexed by SGLang's metadata row), and `poll` reads them.
The only messages back are the last chunk's notice (how many chunks there were), errors,
and drain acks.

Pages are released only after the writers stopped: a request that ends early (abort,
timeout, failure) sends `Abort` to every prefill rank it asked, and SGLang's deferred
release holds its pages until `is_release_safe` - every such rank acked
(`AbortAck`: nothing in flight any more) or was declared dead by liveness.

Under mismatched TP, prefill ranks that each hold fewer heads than this rank write
re-laid-out blocks into this rank's receive staging (`core.relayout`): a request is
granted its part of the area when it asks for pages (or waits, unsent, until space comes
free: back-pressure), and its blocks are scattered into the pool when it completes,
before SGLang schedules it. The part is given back with the pages: after the scatter, or
for a request that ended early when its pages are safe to free.

Each request's state follows `core.states.DECODE_TABLE`. Threads: the inbox thread calls
`on_*`; the liveness thread `active_peers` / `peer_lost` / `housekeeping`; SGLang's
scheduler thread everything else. State sits behind one lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np

from sgl_pd.backend.device_memory import flush_remote_writes
from sgl_pd.backend.failure_cause import cause_of_abort, cause_of_code
from sgl_pd.backend.kv_sums import KvSums, token_slots
from sgl_pd.backend.metrics import TransferMetrics
from sgl_pd.backend.pool import PoolDescription
from sgl_pd.backend.pool_report import note_live
from sgl_pd.backend.staging_area import MIB, Staging
from sgl_pd.backend.tracing import RequestTracing
from sgl_pd.core.bounds import DEFAULT_DEFERRED_RELEASE_S
from sgl_pd.core.clock import Clock
from sgl_pd.core.counting import (
    METADATA_WORD,
    SLOT_WORDS,
    WORD_BYTES,
    CompletionCounter,
    expectation_for,
    links_into,
    metadata_word,
    parse_count_word,
    source_word_index,
)
from sgl_pd.core.errors import CountingError, DuplicateRequest
from sgl_pd.core.failures import FailureCause
from sgl_pd.core.layout import PageLayout
from sgl_pd.core.regions import Region
from sgl_pd.core.relayout import ReceivePlacement, fragmented, receive_placement
from sgl_pd.core.sharding import ShardingScheme, ShardLink, link_shards
from sgl_pd.core.states import DECODE_TABLE, DecodeState, RequestTracker
from sgl_pd.core.timeline import decode_timeline
from sgl_pd.core.wire import (
    Abort,
    AbortAck,
    AbortReason,
    ChunkNotice,
    ErrorMsg,
    Guarded,
    ShardRegistration,
    SlotArea,
    TransferRequest,
)
from sgl_pd.log_limits import LogLimiter, peer_text
from sgl_pd.transfer.engine import TransferEngine

logger = logging.getLogger("sgl_pd.decode")
_log = LogLimiter(logger)
MAX_EARLY_NOTICES = 4096  # requests not tracked yet whose last-chunk notices are kept
MAX_EARLY_PER_ROOM = 1024  # ... notices of one such request (one per prefill rank)
# Seconds the receive staging of a request forgotten before its pages were safe is held:
# as long as SGLang's deferred release holds the pages themselves (`core.bounds`)
ORPHAN_STAGING_HOLD_S = DEFAULT_DEFERRED_RELEASE_S
SCATTER_LINE_PREFIX = "sgl_pd scatter done:"  # one line per re-laid-out request


def _refused(room: int, sender: int | None, what: str) -> None:
    _log.warning(
        what,
        "ignored a %s for request %d from prefill instance %s, which was not asked for it",
        what,
        room,
        sender,
    )


# (inbox endpoint, message): never blocks; sent until acknowledged (`messenger.reliable`)
SendFn = Callable[[str, Guarded], object]
# (inbox endpoint, room): stop resending that request's TransferRequest to that inbox
WithdrawFn = Callable[[str, int], object]
_D = DecodeState


@dataclass
class _Track:
    """One request's transfer as this decoder rank sees it."""

    room: int
    slot: int
    sources: tuple[int, ...]  # prefill ranks whose count words this rank reads
    counter: CompletionCounter
    metadata_source: int  # the prefill rank that writes word 0
    prefills: dict[int, str]  # every prefill rank asked -> its inbox (where aborts go)
    sessions: dict[str, str]  # inbox -> that rank's transfer session (for liveness probes)
    instances: dict[int, int]  # every prefill rank asked -> its instance (who may report)
    reply_to: str  # this rank's inbox, where drain acks come back
    started_s: float
    num_pages: int
    links: tuple[ShardLink, ...]  # every link into this rank, in counting order
    dst_pages: np.ndarray  # (request pages,) this rank's page per logical page
    # receive staging: where the request's blocks go, and its part of the area (offset)
    placement: ReceivePlacement | None = None
    staging_offset: int | None = None
    unsent: TransferRequest | None = None  # waiting for receive staging to come free
    held_tokens: int = 0  # the prompt's first tokens this rank's prefix cache holds
    # staged whole because its pages are fragmented (`core.relayout.fragmented`)
    whole: bool = False
    # ... which it may do without (no link needs staging otherwise): sent unstaged
    # rather than wait for staging space
    whole_optional: bool = False
    prompt_tokens: int = 0  # tokens whose KV the prefiller computed, from its last notice
    kv_tokens: int | None = None  # tokens whose KV this request needs (None: not known)
    error: str | None = None
    metadata_seen: bool = False
    abort_sent: bool = False
    drained: set[int] = field(default_factory=set)  # prefill ranks that stopped writing
    done_s: float | None = None
    # bootstrap: the receiver made, the prefiller's ranks known (monotonic s; None when
    # the caller did not stamp them)
    seen_s: float | None = None
    found_s: float | None = None
    traced: bool = False  # its timeline went out (once per request)
    owner: object | None = None  # the receiver that asked for it (SGLang's)
    # --pd-kv-checksum: prefill rank -> its sums of what it wrote here (per region)
    sums: dict[int, tuple[int, ...]] = field(default_factory=dict)
    summed_sources: frozenset[int] = frozenset()  # the prefill ranks with links here
    arrival: int = 0  # this rank's count of requests asked before it: grants go in this order


class DecodeMessenger:
    def __init__(
        self,
        *,
        rank: int,
        instance: int,
        scheme: ShardingScheme,
        pool: PoolDescription,
        engine: TransferEngine,
        send_to_prefill: SendFn,
        transfer_timeout_s: float,
        metrics: TransferMetrics,
        clock: Clock,
        staging: Staging | None = None,
        tracing: RequestTracing | None = None,
        staging_hold_s: float = ORPHAN_STAGING_HOLD_S,
        sums: KvSums | None = None,
        withdraw: WithdrawFn | None = None,
        pool_device: str | None = None,
    ) -> None:
        self.rank = rank
        self._staging_hold_s = staging_hold_s
        self._sums = sums  # --pd-kv-checksum: what landed is verified before hand-off
        self._withdraw = withdraw
        self._pool_device = pool_device  # "cuda:N": remote writes are flushed at hand-off
        self._tracing = tracing if tracing is not None else RequestTracing(False)
        self.instance = instance  # this rank's, named in its aborts
        self._staging = staging
        self.scheme = scheme
        self.pool = pool
        self.engine = engine
        self._send = send_to_prefill
        self._timeout_s = transfer_timeout_s
        self._metrics = metrics
        self._clock = clock
        # (slots, SLOT_WORDS) uint64, written only by prefill ranks through the engine
        self._words = np.zeros((pool.aux_rows, SLOT_WORDS), dtype=np.uint64)
        engine.register(int(self._words.ctypes.data), self._words.nbytes)
        self._lock = threading.Lock()
        self._tracks: dict[int, _Track] = {}
        deadlines = {_D.REQUESTED: transfer_timeout_s, _D.TRANSFERRING: transfer_timeout_s}
        self._states: RequestTracker[DecodeState] = RequestTracker(DECODE_TABLE, deadlines, clock)
        # room -> (first seen at, its last-chunk notices): notices that came before the
        # request was tracked here (one per prefill rank); at most MAX_EARLY_NOTICES
        # rooms, each dropped after the transfer timeout, so that strangers cannot grow it
        self._sealed: dict[int, tuple[float, list[ChunkNotice]]] = {}
        self._arrivals = 0  # requests asked for so far (the order staging is granted in)
        # receive staging of requests forgotten before their pages were safe: (until, offset)
        self._orphans: list[tuple[float, int]] = []

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
                early = self._sealed.get(notice.request_id)
                if early is not None and len(early[1]) < MAX_EARLY_PER_ROOM:
                    early[1].append(notice)
                elif early is None and len(self._sealed) < MAX_EARLY_NOTICES:
                    self._sealed[notice.request_id] = (self._now(), [notice])
                return
            self._take_notice(track, notice)

    def on_error(self, error: ErrorMsg) -> None:
        if error.request_id is None:
            _log.warning(
                "error", "prefill reports: %s (%s)", peer_text(error.message), error.code.value
            )
            return
        with self._lock:
            track = self._tracks.get(error.request_id)
            if track is None:
                return
            if error.sender_instance not in track.instances.values():
                _refused(error.request_id, error.sender_instance, "error")
                return
            self._fail(
                track,
                f"prefill reports {error.code.value}: {error.message}",
                cause_of_code(error.code),
            )

    def on_abort_ack(self, ack: AbortAck) -> None:
        with self._lock:
            track = self._tracks.get(ack.request_id)
            if track is None:
                return
            if track.instances.get(ack.prefill_rank) != ack.prefill_instance:
                _refused(ack.request_id, ack.prefill_instance, "drain ack")
                return
            track.drained.add(ack.prefill_rank)

    # -- scheduler thread -----------------------------------------------------------------

    def request(
        self,
        room: int,
        prefills: list[ShardRegistration],
        my_registration: ShardRegistration,
        dst_pages: np.ndarray,
        slot: int,
        bootstrap: tuple[float, float] | None = None,
        held_tokens: int = 0,
        owner: object | None = None,
        kv_tokens: int | None = None,
    ) -> None:
        """Sends one request's destination pages to every prefill rank of its prefiller.
        `bootstrap`: when its receiver was made and when the prefiller's ranks were known
        (monotonic s), for its timeline. `held_tokens`: the prompt's first tokens this
        rank's prefix cache holds (whole pages); `dst_pages` are the pages after them,
        and none at all when the cache holds every token the prefiller computes.
        `kv_tokens`: the prompt tokens whose KV the request needs, held ones included;
        a prefiller that computes another number fails the request at once.

        Every rank gets the request, also those that send nothing to this rank: a prefill
        rank only starts once every decoder rank has asked, so none waits forever. The
        request carries this rank's registration, so no separate greeting can be lost.
        """
        prefill = prefills[0]
        layer_groups = len(prefill.layout.layer_groups(prefill.layer_group_size))
        links = links_into(
            link_shards(prefill.layout, prefill.scheme, self.scheme, room), self.rank
        )
        expectation = expectation_for(links, layer_groups)
        self._words[slot, :] = 0  # a late word of the slot's previous request is ignored too
        track = _Track(
            room,
            slot,
            tuple(src for src, _ in expectation.per_chunk),
            CompletionCounter(expectation, expect_kv=len(dst_pages) > 0),
            expectation.metadata_source,
            {peer.rank: peer.inbox for peer in prefills},
            {peer.inbox: peer.session for peer in prefills},
            {peer.rank: peer.instance for peer in prefills},
            my_registration.inbox,
            self._now(),
            len(dst_pages),
            links,
            dst_pages,
            held_tokens=held_tokens,
            kv_tokens=kv_tokens,
            summed_sources=frozenset(link.src_rank for link in links),
            owner=owner,
        )
        whole = (
            self._staging is not None
            and prefill.layout.page_layout is PageLayout.NHD
            and fragmented(np.asarray(dst_pages, dtype=np.int64))
        )
        track.placement = self._placement(room, prefill, links, len(dst_pages), whole)
        if track.placement is None and whole:  # too large for the area: as unfragmented
            whole = False
            track.placement = self._placement(room, prefill, links, len(dst_pages), False)
        track.whole = whole
        track.whole_optional = (
            whole and not receive_placement(prefill.layout, links, len(dst_pages)).total
        )
        if bootstrap is not None:
            track.seen_s, track.found_s = bootstrap
        message = TransferRequest(
            request_id=room,
            decoder=my_registration,
            dst_pages=tuple(int(p) for p in dst_pages),
            metadata_slot=slot,
            completion_slot=slot,
            held_tokens=held_tokens,
            kv_tokens=kv_tokens,
        )
        with self._lock:
            old = self._tracks.get(room)
            if old is not None and not self._release_safe(old, len(old.prefills)):
                # Its drain acks name only the room: taken by a new track, they would
                # count for the new request, and the old one's pages would wait for acks
                # that went elsewhere (or the new one's be freed under its writes).
                raise DuplicateRequest(
                    f"request {room} reuses the bootstrap room of an earlier request whose"
                    " pages are still being released here: send it with a fresh room"
                )
            self._arrivals += 1
            track.arrival = self._arrivals
            if old is not None:
                self._drop_staging(old)  # a retried room id: its old grant waits out
            self._tracks[room] = track
            if room in self._states:
                self._states.forget(room)  # a retried room id: start afresh
            self._states.add(room)
            self._states.transition(room, _D.REQUESTED)
            early = self._sealed.pop(room, None)
            for notice in [] if early is None else early[1]:
                self._take_notice(track, notice)
            track.unsent = message
            granted = self._grant(track)
        if granted is not None:
            self._send_request(track, granted)

    def _placement(
        self,
        room: int,
        prefill: ShardRegistration,
        links: tuple[ShardLink, ...],
        pages: int,
        whole: bool,
    ) -> ReceivePlacement | None:
        """The request's receive staging, if its links need (`whole`: every link, its
        pages being fragmented) and this rank's area can ever hold it (a request larger
        than the area is written one token slot at a time)."""
        if self._staging is None:
            return None
        placement = receive_placement(prefill.layout, links, pages, all_links=whole)
        if not placement.total:
            return None
        if whole and not self._staging.area.fits(placement.total):
            return None
        if not self._staging.area.fits(placement.total):
            _log.warning(
                "staging",
                "request %d needs %.1f MiB of receive staging, more than the %.1f MiB "
                "area: it is written one token slot at a time (raise --pd-staging-mb)",
                room,
                placement.total / MIB,
                self._staging.area.capacity / MIB,
            )
            return None
        return placement

    def _grant(self, track: _Track) -> TransferRequest | None:
        """The request's message, with its staging grant, once it may go (lock held).

        Grants go in arrival order: a request that needs staging waits behind every
        earlier one that waits for it. The decode ranks of a server ask for the same
        requests in the same order (SGLang's scheduler is the same on each), so the
        requests granted on any rank are a prefix of that order: a request holding
        staging on one rank is granted (or was failed) on every rank, every prefill
        rank hears from all its decode ranks, it completes or fails, and its staging
        comes back. First-fit would let rank 0 grant B but not A while rank 1 grants A
        but not B: each waits for the other rank until both time out (and a large
        request could starve behind ever smaller later ones)."""
        message = track.unsent
        if message is None or track.error is not None:
            return None
        if track.placement is not None:
            assert self._staging is not None
            waiting = [
                t
                for t in self._tracks.values()
                if t is not track
                and t.unsent is not None
                and t.error is None
                and t.placement is not None
                and not t.whole_optional
            ]
            # staging only fragmentation asked for waits behind every request that
            # cannot go without it; a request that needs it, behind earlier ones
            if track.whole_optional:
                behind = bool(waiting)
            else:
                behind = any(t.arrival < track.arrival for t in waiting)
            offset = None if behind else self._staging.area.try_take(track.placement.total)
            if offset is None and track.whole_optional:
                # only fragmentation asked for staging: sent as it is, a run at a time
                track.placement, track.whole = None, False
            elif offset is None:
                return None  # back-pressure: asked again at the next poll
            else:
                track.staging_offset = offset
                message = msgspec.structs.replace(
                    message,
                    staging_base=self._staging.area.base + offset,
                    stage_all=track.whole,
                )
        track.unsent = None
        if self._states.state(track.room) is _D.REQUESTED:
            self._states.progressed(track.room)  # no progress is due before it is sent
        return message

    def _send_request(self, track: _Track, message: TransferRequest) -> None:
        for inbox in track.prefills.values():
            self._send(inbox, message)

    def poll(self, room: int) -> tuple[DecodeState, str | None]:
        """Reads the request's count words; (state, error message)."""
        with self._lock:
            track = self._tracks.get(room)
            if track is None:
                return _D.FAILED, f"request {room} is not being transferred here"
            unsent = self._grant(track)
            if track.error is None and track.done_s is None:
                self._count(track)
            state, error = self._states.state(room), track.error
        if unsent is not None:
            self._send_request(track, unsent)
        return state, error

    def fail(self, room: int, reason: str, abort: AbortReason = AbortReason.ERROR) -> None:
        """Marks the request failed (unless it completed) and tells its prefill ranks to
        stop writing it; their drain acks come back through `on_abort_ack`."""
        self._fail_and_abort(room, reason, abort, cause_of_abort(abort))

    def _fail_and_abort(
        self, room: int, reason: str, abort: AbortReason, cause: FailureCause
    ) -> None:
        with self._lock:
            track = self._tracks.get(room)
            if track is None or track.done_s is not None:
                return
            state = _D.ABORTED if abort is AbortReason.CLIENT else _D.FAILED
            self._fail(track, reason, cause, state)
            if track.abort_sent:
                return
            track.abort_sent = True
            targets, reply_to = dict(track.prefills), track.reply_to
        message = Abort(
            request_id=room,
            reason=abort,
            decoder_instance=self.instance,
            detail=reason[:200],
            reply_to=reply_to,
        )
        for inbox in targets.values():
            # A copy of its TransferRequest sent again after the Abort could reach the
            # prefill rank after it acked and forgot the request, and ask it to write
            # into pages freed by then: no copy goes out after the Abort.
            if self._withdraw is not None:
                self._withdraw(inbox, room)
            self._send(inbox, message)

    def abort_unrequested(
        self, room: int, inboxes: list[str], reason: str, abort: AbortReason
    ) -> None:
        """Tells a prefiller to drop a request this rank never asked pages for (no ack
        needed: none of its writes can target this rank)."""
        message = Abort(
            request_id=room, reason=abort, decoder_instance=self.instance, detail=reason[:200]
        )
        for inbox in inboxes:
            self._send(inbox, message)

    def hand_off(self, room: int) -> bool:
        """SGLang takes the complete request into its decode batch: its staged blocks are
        scattered into its pages first (every write it expects has landed), and under
        --pd-kv-checksum what its pages hold is verified. False: it failed that check
        (`poll` says why) and must not be decoded."""
        with self._lock:
            track = self._tracks.get(room)
            if room not in self._states or self._states.state(room) is not _D.COMPLETE:
                return False
            staged = None if track is None else track.staging_offset
        if track is None:
            return False
        if self._pool_device is not None:
            # the count words are in host memory, the KV in the GPU's: make every write
            # that landed visible before anything reads the pages (scatter, sums, decode)
            flush_remote_writes(self._pool_device)
        if staged is not None:
            assert self._staging is not None and track.placement is not None
            area = self._staging.area
            started = self._now()
            self._staging.copies.scatter(
                area.view(staged, track.placement.total),
                track.placement,
                track.links,
                track.dst_pages,
            )
            logger.info(
                "%s room=%d bytes=%d ms=%.3f",
                SCATTER_LINE_PREFIX,
                room,
                track.placement.total,
                (self._now() - started) * 1e3,
            )
            with self._lock:
                self._drop_staging(track)
        mismatch = None
        if self._sums is not None:
            try:
                mismatch = self._verify(track)
            except Exception as e:  # (device memory, a bug): fail it, never the scheduler
                logger.exception("request %d: KV checksum not computed", room)
                mismatch = f"the KV checksum could not be computed: {e!r}"[:500]
        with self._lock:
            if mismatch is None:
                self._states.transition(room, _D.HANDED_OFF)
            else:  # every write landed: nothing is in flight, its pages may go
                track.error = mismatch
                self._states.transition(room, _D.FAILED)
                self._metrics.add_failure(FailureCause.CHECKSUM)
        if mismatch is not None:
            logger.error("request %d: %s", room, mismatch)
        self._trace(track, self._now())
        return mismatch is None

    def _verify(self, track: _Track) -> str | None:
        """Why the request's pages do not hold what its prefill ranks wrote, or None: per
        prefill rank, the keyed sums of its links' heads over the tokens it sent here
        (`core.kv_checksum`), against those its last notice carried."""
        sums = self._sums
        assert sums is not None
        layout = self.pool.layout
        start, stop = track.held_tokens, track.prompt_tokens
        if stop <= start:
            return None
        slots = token_slots(
            track.dst_pages, start // layout.page_size, start, stop, layout.page_size
        )
        regions = list(range(layout.num_regions))
        for source in sorted(track.summed_sources):
            found = sums.zeros()
            for link in track.links:
                if link.src_rank == source:
                    offset = link.dst_head_offset
                    sums.add_link(found, track.room, regions, link, offset, (start, stop), slots)
            got, sent = sums.read(found), track.sums[source]
            bad = [r for r in regions if got[r] != sent[r]]
            if bad:
                layer, part = divmod(bad[0], len(layout.parts))
                return (
                    f"KV checksum mismatch: layer {layer} ({layout.parts[part].value}) of"
                    f" tokens [{start}, {stop}) from prefill rank {source} into decode rank"
                    f" {self.rank} ({len(bad)} of {len(regions)} regions differ): the KV"
                    " that landed is not what was sent"
                )
        return None

    def is_release_safe(self, room: int, required_acks: int) -> bool:
        """The decode side's one answer to "may this request's pages go back to the
        pool?" (SGLang's deferred release asks it for a request that ended early).

        Yes once nothing can land in them any more: the request completed (every write
        it expects was counted, and each source writes its count only after its data
        batch completed), or every prefill rank it asked has drained - it acked the
        `Abort` (none of its writes is in flight and none can start: the prefill side's
        `PrefillRooms._settle`) or is provably gone (its inbox and its transfer engine
        both refuse connections: the process, and its posted writes, ended). A rank that
        is only hung is neither: the pages wait for its ack, or for SGLang's deferred
        release to give up (`core.bounds`, held there by the backend: past the engine's
        transfer timeout and the hang timeout, so a write posted before the hang ended).
        `required_acks`: the prefill ranks SGLang expects to hear from."""
        with self._lock:
            track = self._tracks.get(room)
            if track is None:
                return True
            safe = self._release_safe(track, required_acks)
            if safe:
                self._drop_staging(track)
            return safe

    def forget(self, room: int, owner: object | None = None) -> None:
        """SGLang let go of the request. `owner`: the receiver that asked for it - a
        receiver that was refused its room (an earlier request still holds it) forgets
        nothing of the earlier one."""
        with self._lock:
            track = self._tracks.get(room)
            if track is not None and owner is not None and track.owner is not owner:
                return
            self._tracks.pop(room, None)
            if track is not None:
                self._states.forget(room)
                self._drop_staging(track)
            self._sealed.pop(room, None)
        if track is not None and track.error is not None:
            self._trace(track, self._now())

    def _trace(self, track: _Track, end_s: float) -> None:
        """The request's timeline, once: at its hand-off, or when SGLang lets go of it
        after a failure."""
        if track.traced or not self._tracing.wanted:
            return
        track.traced = True
        staged = 0 if track.placement is None else track.placement.total  # bytes
        self._tracing.emit(
            decode_timeline(
                room=track.room,
                rank=self.rank,
                seen_s=track.seen_s,
                found_s=track.found_s,
                requested_s=track.started_s,
                complete_s=track.done_s,
                end_s=end_s,
                attrs=(
                    ("sgl_pd.pages", track.num_pages),
                    ("sgl_pd.staged_bytes", staged),
                    ("sgl_pd.held_tokens", track.held_tokens),
                ),
                error=track.error,
            )
        )

    # -- liveness thread ------------------------------------------------------------------

    def active_peers(self) -> dict[str, str | None]:
        """Inbox -> transfer session of the prefill ranks that may still write into this
        rank's pages. A rank whose part of a healthy request has all arrived is not
        watched for it: it may forget the request long before the others finish theirs,
        and then no longer answers this rank's pings."""
        with self._lock:
            return {
                inbox: t.sessions.get(inbox)
                for t in self._tracks.values()
                if t.done_s is None
                for rank, inbox in t.prefills.items()
                if rank not in t.drained and not (t.error is None and t.counter.source_done(rank))
            }

    def resumed_after_freeze(self, frozen_s: float) -> None:
        """This rank did not run past the hang timeout: its prefill ranks declared it
        hung and stopped writing, so its unfinished requests fail (and abort) now rather
        than at their transfer timeout."""
        with self._lock:
            rooms = [t.room for t in self._tracks.values() if t.error is None and t.done_s is None]
        why = f"the decode rank did not run for {frozen_s:.1f} s (stopped or starved)"
        for room in rooms:
            self._fail_and_abort(room, why, AbortReason.ERROR, FailureCause.PEER_LOST)

    def peer_lost(self, inbox: str, why: str, gone: bool) -> None:
        """A prefill rank stopped answering: fail what it feeds, so clients hear within the
        liveness bound. Its pages count as drained only if the rank is provably `gone`; a
        rank that is merely slow still acks the Abort that failing sends, and SGLang's
        deferred-release timeout is the last resort."""
        failed = 0
        with self._lock:
            for track in self._tracks.values():
                ranks = [r for r, i in track.prefills.items() if i == inbox]
                if not ranks or track.done_s is not None:
                    continue
                if gone:
                    track.drained.update(ranks)
                failed += track.error is None
                self._fail(track, why, FailureCause.PEER_LOST)
        if failed or gone:
            logger.error("%s: %d request(s) failed", why, failed)

    def housekeeping(self) -> None:
        with self._lock:
            for e in self._states.poll_timeouts():
                track = self._tracks[e.request_id]
                if track.error is None and track.done_s is None:
                    self._metrics.add_failure(FailureCause.TIMEOUT)
                if track.error is None and track.unsent is not None:
                    assert self._staging is not None
                    track.error = (
                        f"no receive staging came free for {self._timeout_s:g} s "
                        f"({self._staging.area.used / MIB:.1f} of "
                        f"{self._staging.area.capacity / MIB:.1f} MiB held): raise "
                        "--pd-staging-mb"
                    )
                elif track.error is None:
                    track.error = (
                        f"KV transfer made no progress for {self._timeout_s:g} s "
                        f"({track.counter.received} write groups arrived); raise "
                        "--pd-transfer-timeout or check the prefill server's log"
                    )
            now = self._now()
            for room in [r for r, (t, _) in self._sealed.items() if now - t > self._timeout_s]:
                del self._sealed[room]
            rooms = len(self._tracks)
            arriving = sum(t.done_s is None and t.error is None for t in self._tracks.values())
            self._release_orphans(now)
            staged = 0 if self._staging is None else self._staging.area.used
        self._metrics.set_live(rooms, arriving, staged)
        note_live(rooms, arriving, staged)

    # -- helpers (lock held) --------------------------------------------------------------

    def _release_safe(self, track: _Track, required_acks: int) -> bool:
        """Nothing can land in the request's pages any more (see `is_release_safe`)."""
        if track.done_s is not None or track.unsent is not None:
            return True  # (unsent: no prefill rank ever learnt where to write)
        return len(track.drained) >= min(required_acks, len(track.prefills))

    def _now(self) -> float:
        return self._clock.monotonic()

    def _drop_staging(self, track: _Track) -> None:
        """Gives the request's receive staging back: at once when nothing can land in it
        any more (complete, or every prefill rank asked drained), else after
        `staging_hold_s`."""
        offset, track.staging_offset = track.staging_offset, None
        if offset is None:
            return
        assert self._staging is not None
        if track.done_s is not None or len(track.drained) >= len(track.prefills):
            self._give_back(offset)
        else:
            self._orphans.append((self._now() + self._staging_hold_s, offset))

    def _release_orphans(self, now: float) -> None:
        if not self._orphans:
            return
        assert self._staging is not None
        due = [offset for until, offset in self._orphans if until <= now]
        self._orphans = [(until, offset) for until, offset in self._orphans if until > now]
        for offset in due:
            self._give_back(offset)

    def _give_back(self, offset: int) -> None:
        """Staging came free: requests waiting for it are not stalled, they queue (their
        deadline bounds how long no staging comes free, not how long they wait)."""
        assert self._staging is not None
        self._staging.area.give_back(offset)
        for waiting in self._tracks.values():
            if waiting.unsent is not None and self._states.state(waiting.room) is _D.REQUESTED:
                self._states.progressed(waiting.room)

    def _fail(
        self, track: _Track, reason: str, cause: FailureCause, state: DecodeState = _D.FAILED
    ) -> None:
        """The first failure of a request is the one counted, with its cause."""
        if track.error is None and track.done_s is None:
            track.error = reason
            if not DECODE_TABLE.is_final(self._states.state(track.room)):
                self._states.transition(track.room, state)
            self._metrics.add_failure(cause)

    def _take_notice(self, track: _Track, notice: ChunkNotice) -> None:
        """A prefill rank's last-chunk notice: it seals the count, and under
        --pd-kv-checksum brings that rank's sums of what it wrote here."""
        ranks = [r for r, i in track.instances.items() if i == notice.prefill_instance]
        if not ranks:
            _refused(notice.request_id, notice.prefill_instance, "chunk notice")
            return
        if self._sums is not None and ranks[0] in track.summed_sources:
            if len(notice.checksums) != self.pool.layout.num_regions:
                self._fail(
                    track,
                    f"prefill rank {ranks[0]} sent no KV checksums: start the prefill server"
                    " with --pd-kv-checksum too (or neither)",
                    FailureCause.REFUSED,
                )
                return
            track.sums[ranks[0]] = notice.checksums
        self._seal(track, notice.num_chunks, notice.token_stop)

    def _seal(self, track: _Track, num_chunks: int, prompt_tokens: int) -> None:
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
        self._check_done(track)

    def _count(self, track: _Track) -> None:
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
        self._check_done(track)

    def _check_done(self, track: _Track) -> None:
        summed = self._sums is None or track.summed_sources <= track.sums.keys()
        if track.error is None and track.done_s is None and track.counter.is_complete and summed:
            track.done_s = self._now()
            state = self._states.state(track.room)
            if state is _D.REQUESTED:
                self._states.transition(track.room, _D.TRANSFERRING)
            self._states.transition(track.room, _D.COMPLETE)
            self._metrics.add_request(track.num_pages, track.done_s - track.started_s)
            pool = self.pool
            token_bytes = pool.layout.num_regions * pool.local_heads * pool.layout.row_bytes
            self._metrics.decode_prefix(
                track.held_tokens,
                max(0, track.prompt_tokens - track.held_tokens),
                track.held_tokens * token_bytes,
            )
            self._metrics.decode_done(track.done_s - track.started_s)
