"""Decode side of the messenger: asks prefill ranks for a request's KV, follows the
request's state until its KV is all here or it ended, and answers SGLang's receiver and
deferred release (D2, D3, D10).

Its parts, each stating its own argument: whether the KV is all here
(`completion.Completion`, "completion"), the receive staging a request is granted
(`staging_grants.StagingGrants`, "staging give-back"), when its pages and staging may be
freed (`release.nothing_can_land`, "the release rule"), its checksums
(`kv_verify.verify`) and its timeline (`timeline.emit_timeline`).

A request that ends early (abort, timeout, failure) sends `Abort` to every prefill rank
it asked, after every copy of its TransferRequest (`_send_order`); SGLang's deferred
release holds its pages until `is_release_safe`.

Each request's state follows `core.states.DECODE_TABLE`. Threads: the inbox thread calls
`on_*`; the liveness thread `active_peers` / `peer_lost` / `housekeeping` /
`resumed_after_freeze`; SGLang's scheduler thread everything else. State sits behind one
lock, held by every call into the parts except `StagingGrants.scatter` and `verify`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import numpy as np

from sgl_pd.backend.decode.completion import Completion, refused
from sgl_pd.backend.decode.kv_verify import checked
from sgl_pd.backend.decode.release import nothing_can_land
from sgl_pd.backend.decode.staging_grants import ORPHAN_STAGING_HOLD_S, StagingGrants
from sgl_pd.backend.decode.timeline import emit_timeline
from sgl_pd.backend.decode.track import Track, new_track
from sgl_pd.backend.device_memory import flush_remote_writes
from sgl_pd.backend.failure_cause import cause_of_abort, cause_of_code
from sgl_pd.backend.kv_sums import KvSums
from sgl_pd.backend.metrics import TransferMetrics
from sgl_pd.backend.pool import PoolDescription
from sgl_pd.backend.pool_report import note_live
from sgl_pd.backend.staging_area import Staging
from sgl_pd.backend.tracing import RequestTracing
from sgl_pd.core.clock import Clock
from sgl_pd.core.errors import DuplicateRequest
from sgl_pd.core.failures import FailureCause
from sgl_pd.core.local_budget import REMOTE_WINDOW_S, RemoteCost
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.states import DECODE_TABLE, DecodeState, RequestTracker
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

# (inbox endpoint, message): never blocks; sent until acknowledged (`messenger.reliable`)
SendFn = Callable[[str, Guarded], object]
# (inbox endpoint, room): stop resending that request's TransferRequest to that inbox
WithdrawFn = Callable[[str, int], object]
_D = DecodeState


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
        self.instance = instance  # this rank's, named in its aborts
        self.scheme = scheme
        self.pool = pool
        self.engine = engine
        self._sums = sums  # --pd-kv-checksum: what landed is verified before hand-off
        self._withdraw = withdraw
        self._pool_device = pool_device  # "cuda:N": remote writes are flushed at hand-off
        self._tracing = tracing if tracing is not None else RequestTracing(False)
        # what remote prefills took as this rank saw them, for local-or-remote choices
        # (`backend/decode/local_prefill.py`; read on the scheduler thread, as is hand_off)
        # (a remote prefill past its transfer timeout has failed, or its end went
        # unreported: not queued any more)
        self.remote_cost = RemoteCost(stale_s=max(transfer_timeout_s, REMOTE_WINDOW_S))
        self._send = send_to_prefill
        self._timeout_s = transfer_timeout_s
        self._metrics = metrics
        self._clock = clock
        self._lock = threading.Lock()
        # Held from granting a request's TransferRequest until it is queued, and while an
        # Abort is decided and queued: each request's Abort is queued after every copy of
        # its TransferRequest, or none is sent (an Abort first fails the request, and a
        # failed request is granted nothing). Otherwise a prefill rank could ack the Abort,
        # forget the room, then take the request and write into pages that ack freed.
        self._send_order = threading.Lock()
        # An Abort decided on the thread that holds `_send_order` (a failure reported
        # while its messages are being queued, by an in-process peer say) is queued once
        # that thread's messages are: (room, reason, abort, cause), and the thread.
        self._deferred_aborts: list[tuple[int, str, AbortReason, FailureCause]] = []
        self._queueing_on: int | None = None
        self._tracks: dict[int, Track] = {}
        deadlines = {_D.REQUESTED: transfer_timeout_s, _D.TRANSFERRING: transfer_timeout_s}
        self._states: RequestTracker[DecodeState] = RequestTracker(DECODE_TABLE, deadlines, clock)
        self._completion = Completion(
            pool=pool,
            engine=engine,
            states=self._states,
            metrics=metrics,
            clock=clock,
            checksums=sums is not None,
            fail=self._fail,
        )
        self._grants = StagingGrants(staging, self._tracks, self._states, clock, staging_hold_s)
        self._arrivals = 0  # requests asked for so far (the order staging is granted in)

    @property
    def completion_area(self) -> SlotArea:
        return self._completion.area

    # -- inbox thread -------------------------------------------------------------------

    def on_chunk_notice(self, notice: ChunkNotice) -> None:
        if not notice.is_last:
            return
        with self._lock:
            track = self._tracks.get(notice.request_id)
            if track is None:
                self._completion.keep_early(notice)
            else:
                self._completion.take_notice(track, notice)

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
                refused(error.request_id, error.sender_instance, "error")
                return
            self._fail(
                track,
                f"prefill reports {error.code.value}: {error.message}",
                cause_of_code(error.code),
            )

    def on_abort_ack(self, ack: AbortAck) -> None:
        """A prefill rank drained the request (the release rule)."""
        with self._lock:
            track = self._tracks.get(ack.request_id)
            if track is None:
                return
            if track.instances.get(ack.prefill_rank) != ack.prefill_instance:
                refused(ack.request_id, ack.prefill_instance, "drain ack")
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
        state_slots: tuple[tuple[int, ...], ...] = (),
    ) -> None:
        """Sends one request's destination pages to every prefill rank of its prefiller.
        `bootstrap`: when its receiver was made and when the prefiller's ranks were known
        (monotonic s), for its timeline. `held_tokens`: the prompt's first tokens this
        rank's prefix cache holds (whole pages); `dst_pages` are the pages after them,
        and none at all when the cache holds every token the prefiller computes.
        `kv_tokens`: the prompt tokens whose KV the request needs, held ones included;
        a prefiller that computes another number fails the request at once.
        `state_slots`: this rank's slots for the request's state besides the KV (a Mamba
        slot, the sliding window's pages), none for a model without.

        Every rank gets the request, also those that send nothing to this rank: a prefill
        rank only starts once every decoder rank has asked, so none waits forever. The
        request carries this rank's registration, so no separate greeting can be lost.
        """
        self._completion.reset_slot(slot)
        track = new_track(
            room,
            prefills,
            my_registration.inbox,
            (self.scheme, self.rank),
            dst_pages,
            slot,
            self._now(),
            held_tokens=held_tokens,
            kv_tokens=kv_tokens,
            owner=owner,
            state=my_registration.state,
        )
        self._grants.place(track, prefills[0].layout)
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
            state_slots=state_slots,
        )
        with self._lock:
            old = self._tracks.get(room)
            if old is not None and not nothing_can_land(old):
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
                self._grants.drop(old)  # a retried room id
            self._tracks[room] = track
            # (its prefill waits behind the remote prefills in flight: `RemoteCost`)
            page_size = prefills[0].layout.page_size
            computed = track.num_pages * page_size if kv_tokens is None else kv_tokens - held_tokens
            self.remote_cost.started(room, computed)
            if room in self._states:
                self._states.forget(room)  # a retried room id: start afresh
            self._states.add(room)
            self._states.transition(room, _D.REQUESTED)
            for notice in self._completion.take_early(room):
                self._completion.take_notice(track, notice)
            track.unsent = message
        self._grant_and_send(track)

    def _grant_and_send(self, track: Track) -> None:
        """Sends the request's TransferRequest once its staging is granted; ordered with
        its Abort by `_send_order`."""
        with self._send_order:
            with self._lock:
                granted = self._grants.grant(track)
            if granted is not None:
                self._send_request(track, granted)

    def _send_request(self, track: Track, message: TransferRequest) -> None:
        """(`_send_order` held)"""
        self._queue([(inbox, message) for inbox in track.prefills.values()])

    def _queue(self, messages: list[tuple[str, Guarded]]) -> None:
        """Queues `messages` in order, then the Aborts decided meanwhile on this thread
        (`_send_order` held)."""
        self._queueing_on = threading.get_ident()
        try:
            for inbox, message in messages:
                self._send(inbox, message)
        finally:
            self._queueing_on = None
        while self._deferred_aborts:
            self._fail_then_abort(*self._deferred_aborts.pop(0))

    def poll(self, room: int) -> tuple[DecodeState, str | None]:
        """Reads the request's count words; (state, error message)."""
        with self._send_order:  # (see `_send_order`)
            with self._lock:
                track = self._tracks.get(room)
                if track is None:
                    return _D.FAILED, f"request {room} is not being transferred here"
                granted = self._grants.grant(track)
                if track.error is None and track.done_s is None:
                    self._completion.count(track)
                state, error = self._states.state(room), track.error
            if granted is not None:
                self._send_request(track, granted)
        return state, error

    def fail(self, room: int, reason: str, abort: AbortReason = AbortReason.ERROR) -> None:
        """Marks the request failed (unless it completed) and tells its prefill ranks to
        stop writing it; their drain acks come back through `on_abort_ack`."""
        self._fail_and_abort(room, reason, abort, cause_of_abort(abort))

    def _fail_and_abort(
        self, room: int, reason: str, abort: AbortReason, cause: FailureCause
    ) -> None:
        if self._queueing_on == threading.get_ident():
            self._deferred_aborts.append((room, reason, abort, cause))  # see `_queue`
            return
        with self._send_order:
            self._fail_then_abort(room, reason, abort, cause)

    def _fail_then_abort(
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
        self._queue([(inbox, message) for inbox in targets.values()])

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
        scattered into its pages first (completion: every write landed), and under
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
            self._grants.scatter(track, staged)
            with self._lock:
                self._grants.drop(track)
        mismatch = None
        if self._sums is not None:
            mismatch = checked(self._sums, self.pool.layout, track, self.rank)
        with self._lock:
            if mismatch is None:
                self._states.transition(room, _D.HANDED_OFF)
            else:  # complete: nothing can land, its pages may go
                track.error = mismatch
                self._states.transition(room, _D.FAILED)
                self._metrics.add_failure(FailureCause.CHECKSUM)
        if mismatch is not None:
            logger.error("request %d: %s", room, mismatch)
        elif track.seen_s is not None and track.done_s is not None:
            self.remote_cost.ended(room, track.done_s - track.seen_s)
        emit_timeline(self._tracing, track, self.rank, self._now())
        return mismatch is None

    def is_release_safe(self, room: int, required_acks: int) -> bool:
        """SGLang's deferred release asks whether an early-ended request's pages may go
        back to the pool: the release rule (`release.nothing_can_land`), which also gives
        its receive staging back when it says yes. `required_acks`: SGLang's count of the
        prefill ranks its receiver notified; not used (see the rule).

        SGLang asks by room alone, so the asker may be a receiver refused this room while
        the request here still holds it: a request that completed keeps its staging for
        its hand-off's scatter (`hand_off` or `forget` give it back), whoever asks."""
        with self._lock:
            track = self._tracks.get(room)
            if track is None:
                return True
            safe = nothing_can_land(track)
            if safe and track.done_s is None:
                self._grants.drop(track)
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
                self._grants.drop(track)
                self.remote_cost.ended(room)  # (one that completed ended already)
            self._completion.take_early(room)
        if track is not None and track.error is not None:
            emit_timeline(self._tracing, track, self.rank, self._now())

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
        liveness bound. Its ranks drain only if `gone` (the release rule); a rank that is
        merely slow still acks the Abort that failing sends."""
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
                    track.error = self._grants.starved(self._timeout_s)
                elif track.error is None:
                    track.error = (
                        f"KV transfer made no progress for {self._timeout_s:g} s "
                        f"({track.counter.received} write groups arrived); raise "
                        "--pd-transfer-timeout or check the prefill server's log"
                    )
            now = self._now()
            self._completion.expire_early(now, self._timeout_s)
            rooms = len(self._tracks)
            arriving = sum(t.done_s is None and t.error is None for t in self._tracks.values())
            self._grants.release_orphans(now)
            staged = self._grants.used
        self._metrics.set_live(rooms, arriving, staged)
        note_live(rooms, arriving, staged)

    def tables(self) -> dict[str, int]:
        """This rank's tables and their entries, for `sgl_pd_table_entries`."""
        with self._lock:
            return {
                "tracks": len(self._tracks),
                "request_states": len(self._states),
                "early_notices": self._completion.early_rooms,
                "staging_orphans": self._grants.orphans,
                "deferred_aborts": len(self._deferred_aborts),
            }

    # -- helpers (lock held) --------------------------------------------------------------

    def _now(self) -> float:
        return self._clock.monotonic()

    def _fail(
        self, track: Track, reason: str, cause: FailureCause, state: DecodeState = _D.FAILED
    ) -> None:
        """The first failure of a request is the one counted, with its cause."""
        if track.error is None and track.done_s is None:
            track.error = reason
            if not DECODE_TABLE.is_final(self._states.state(track.room)):
                self._states.transition(track.room, state)
            self._metrics.add_failure(cause)
            self.remote_cost.ended(track.room)  # (its prefill is told to stop: not queued)
