"""Prefill side of the messenger: where each request's KV goes, and when (D2, D5-D7, D9,
D10, D12-D14).

Two ways to send a chunk's KV:
- after the forward (`submit_chunk`, SGLang's own behaviour): one job per destination
  covers all layers, queued once SGLang hands the chunk over;
- layer by layer (`notice_chunk` before the forward, then `write_layers` from the layer
  streamer as the progress counter advances): one job per destination and layer group,
  so only about one layer's transfer is left when the forward ends.

Either way, once the last chunk is queued and SGLang has filled the request's metadata
row (its last `send`), a metadata job follows on each destination's queue (D9).

A speculative draft model's KV (a NEXTN/MTP layer) is the layout's last layers. The draft
runs after the target's forward, so layer by layer its layers go at SGLang's `send`, and
after the forward they go with the rest.

Who does what: `PrefillRooms` holds every request's state and counts its writes in
flight; `DestinationWriters` run the writes, one thread per decode rank; this class
turns SGLang's calls, the streamer's progress and the decoders' messages into jobs, and
sends the drain acks the drain rule releases (`drain.Drain.settle`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from sgl_pd.backend.kv_sums import KvSums
from sgl_pd.backend.metrics import TransferMetrics
from sgl_pd.backend.pool import PoolDescription
from sgl_pd.backend.pool_report import note_live
from sgl_pd.backend.prefill.drain import FAILED_BATCH_QUARANTINE_S
from sgl_pd.backend.prefill.room_types import Chunk, Destination, Room, StreamedState
from sgl_pd.backend.prefill.rooms import PrefillRooms
from sgl_pd.backend.prefill.writer import DestinationWriters, KvWriter, LayersJob, MetadataJob
from sgl_pd.backend.staging_area import Staging
from sgl_pd.backend.tracing import RequestTracing
from sgl_pd.core.clock import Clock
from sgl_pd.core.failures import FailureCause
from sgl_pd.core.liveness import FreezeWatch
from sgl_pd.core.page_ids import PageIds
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.states import PrefillState
from sgl_pd.core.timeline import prefill_timeline
from sgl_pd.core.wire import (
    Abort,
    AbortAck,
    ErrorCode,
    ErrorMsg,
    Guarded,
    TransferRequest,
    decoder_aborted,
)
from sgl_pd.log_limits import LogLimiter, peer_text
from sgl_pd.transfer.engine import TransferEngine

logger = logging.getLogger("sgl_pd.prefill")
_peer_log = LogLimiter(logger)

# (inbox endpoint, message): never blocks; sent until acknowledged (`messenger.reliable`)
SendFn = Callable[[str, Guarded], object]

# One INFO line per request when its transfer is done (times: time.monotonic(), seconds).
TIMING_LINE_PREFIX = "sgl_pd transfer done:"

__all__ = ["TIMING_LINE_PREFIX", "Chunk", "PrefillMessenger"]


class PrefillMessenger:
    def __init__(
        self,
        *,
        rank: int,
        instance: int,
        scheme: ShardingScheme,
        pool: PoolDescription,
        engine: TransferEngine,
        layerwise: bool,
        send_to_decoder: SendFn,
        metrics: TransferMetrics,
        timeout_s: float,
        clock: Clock,
        freeze: FreezeWatch | None = None,
        staging: Staging | None = None,
        tracing: RequestTracing | None = None,
        quarantine_s: float = FAILED_BATCH_QUARANTINE_S,
        sums: KvSums | None = None,
    ) -> None:
        self.rank = rank
        self._tracing = tracing if tracing is not None else RequestTracing(False)
        self.instance = instance
        self.layout = pool.layout
        self.staging = staging
        self.layerwise = layerwise
        # one completion group per layer when streaming layer by layer, else per chunk
        self.layer_group_size = 1 if layerwise else self.layout.num_layers
        self._send = send_to_decoder
        self._metrics = metrics
        self.draft_layers = pool.draft_layers
        self._clock = clock
        self.rooms = PrefillRooms(
            rank=rank,
            scheme=scheme,
            layout=self.layout,
            layerwise=layerwise,
            timeout_s=timeout_s,
            clock=clock,
            draft_layers=pool.draft_layers,
            freeze=freeze,
            quarantine_s=quarantine_s,
            state=pool.state,
        )
        self.writers = DestinationWriters(
            self.rooms,
            KvWriter(
                rank, instance, pool, engine, self.layer_group_size, send_to_decoder, staging, sums
            ),
            on_failure=self.fail,
            on_drained=self._ack,
            on_bytes=metrics.add_bytes,
            on_done=self._done,
        )

    # -- inbox thread -------------------------------------------------------------------

    def on_transfer_request(self, request: TransferRequest) -> None:
        failed_before = any(r.error for r in self.rooms.rooms_of([request.request_id]))
        refused = self.rooms.add_request(request)
        if refused is None:
            mismatch = self.rooms.prompt_mismatch(request.request_id)
            if mismatch is not None:  # a decode rank that asked after SGLang fixed the prompt
                self.fail(request.request_id, mismatch, FailureCause.REFUSED)
            return
        if failed_before:  # counted when it failed; the late decode rank only hears why
            self._tell_decoders([request], refused, self.rooms.error_code(request.request_id))
            return
        self._metrics.add_failure(FailureCause.REFUSED)
        self._tell_decoders([request], refused, ErrorCode.BAD_REQUEST)

    def on_abort(self, abort: Abort) -> None:
        """A decoder gave up on a request: stop writing it; ack once nothing is in flight.
        An abort from a decode rank that does not own the request is refused."""
        acks = self.rooms.abort(
            abort.request_id,
            decoder_aborted(abort.reason),
            abort.reply_to,
            abort.decoder_instance,
        )
        if acks is None:
            _peer_log.warning(
                "abort",
                "refused an abort of request %d from decode instance %d, which did not ask for it",
                abort.request_id,
                abort.decoder_instance,
            )
            return
        self._ack(abort.request_id, acks)

    # -- scheduler thread -----------------------------------------------------------------

    def track(self, room_id: int) -> None:
        self.rooms.track(room_id)

    def state(self, room_id: int) -> tuple[PrefillState, bool, str | None] | None:
        return self.rooms.state(room_id)

    def expect(self, room_id: int, num_pages: int, aux_index: int | None) -> None:
        self.rooms.expect(room_id, num_pages, aux_index)

    def refuse(self, room_id: int, why: str) -> None:
        """SGLang refused the request at its door (`backend.refusals`): every
        decode rank that asked, or asks, hears `why` instead of waiting for KV."""
        requests = self.rooms.refuse(room_id, why)
        if requests is None:
            return
        self._metrics.add_failure(FailureCause.REFUSED)
        self._tell_decoders(requests, why, ErrorCode.BAD_REQUEST)

    def prompt_known(self, room_id: int, prompt_tokens: int) -> None:
        """SGLang fixed where the request's sends start: its prefill computes
        `prompt_tokens` tokens. A decoder that holds more, or expects the KV of another
        number of tokens, fails the request now (`PrefillRooms.prompt_mismatch`)."""
        why = self.rooms.prompt_known(room_id, prompt_tokens)
        if why is not None:
            self.fail(room_id, why, FailureCause.REFUSED)

    def notice_chunk(
        self,
        room_id: int,
        src_pages: PageIds,
        end_token: int,
        is_last: bool,
        state: StreamedState | None = None,
    ) -> Chunk | None:
        return self.rooms.notice_chunk(room_id, src_pages, end_token, is_last, state)

    def submit_chunk(
        self,
        room_id: int,
        pages: np.ndarray,
        num_tokens: int,
        ready: Any = None,
        state_slots: tuple[tuple[int, ...], ...] | None = None,
        state_so_far: tuple[tuple[int, ...], ...] | None = None,
    ) -> None:
        """`ready`: an event (``synchronize()``) the KV of this send is complete after;
        the writer waits on it, never the scheduler. `state_slots`: the request's state
        slots (a Mamba slot, the sliding window's pages), named in the last send;
        `state_so_far`, at a send before it, their leading slots whose bytes are final
        already (the window's pages of the chunks done): they go with this send's KV."""
        if state_slots is not None and self._streamed_state_differs(room_id, state_slots):
            self.rooms.state_renamed(room_id)
        writes = self.rooms.submit_chunk(room_id, pages, num_tokens, state_slots, state_so_far)
        so_far = state_so_far or ()
        for chunk, layers in writes:
            for dest in self._destinations(room_id):
                self.writers.put(LayersJob(dest, chunk, layers, ready, state_so_far=so_far))
        # only now may the metadata follow them on the destinations' queues
        self.rooms.writes_queued(room_id, writes)
        self._queue_metadata(room_id)

    def _streamed_state_differs(self, room_id: int, named: tuple[tuple[int, ...], ...]) -> bool:
        """Whether the state slots SGLang names after the last chunk's forward differ
        from those read before it, whose layers went during the forward. They may: a
        window page whose KV SGLang's prefix cache already held is swapped for the
        tree's after the forward (its duplicate freed), so SGLang names the tree's
        page, of the same KV, and this request's may be reused at once."""
        rooms = self.rooms.rooms_of([room_id])
        streamed = rooms[0].streamed_state if rooms else None
        if streamed is None:
            return False
        read = streamed.slots()
        return len(read) != len(named) or not all(
            np.array_equal(r, np.asarray(n, dtype=np.int64))
            for r, n in zip(read, named, strict=True)
        )

    def abort(self, room_id: int, reason: str) -> None:
        """SGLang's own abort: the writes stop, and the decoders hear at once (SGLang may
        never poll this request again; `PrefillRooms.sweep` drops it once drained)."""
        requests = self.rooms.abort_own(room_id, reason)
        if requests:
            self._metrics.add_failure(FailureCause.ABORT)
            self._tell_decoders(requests, reason)

    def forget(self, room_id: int) -> tuple[int, float | None]:
        """Drops a concluded request; returns (bytes sent, seconds from first write to done)."""
        room = self.rooms.forget(room_id)
        if room is not None and room.error is not None:
            self._trace(room)
        if room is None or room.first_write_s is None or room.done_s is None:
            return (0 if room is None else room.bytes_sent), None
        return room.bytes_sent, room.done_s - room.first_write_s

    def forward_finished(self, room_ids: list[int], at_s: float) -> None:
        """The forward holding these requests' last chunk ended at `at_s` (monotonic)."""
        self.rooms.mark_forward_end(room_ids, at_s)

    # -- layer streamer thread ----------------------------------------------------------

    def write_layers(
        self, chunks: list[Chunk], layers: range, state_layers: frozenset[int] = frozenset()
    ) -> None:
        """Layer-wise mode: the forward has finished KV `layers` and the model layers
        `state_layers` with state besides the KV; queue them for every chunk (the state
        of a request's last chunk only: final then, `core.layer_steps`)."""
        for chunk in chunks:
            state = state_layers if chunk.is_last else frozenset()
            if not layers and not state:
                continue
            for dest in self._destinations(chunk.room):
                self.writers.put(LayersJob(dest, chunk, layers, state_layers=state))

    def forward_done(self, chunks: list[Chunk]) -> None:
        """Layer-wise mode: the device finished the forward of these chunks."""
        now = self._clock.monotonic()
        for chunk in chunks:
            self.rooms.chunk_queued(chunk)
            if chunk.is_last:
                self.rooms.mark_forward_end([chunk.room], now)
                self._queue_metadata(chunk.room)

    # -- liveness thread ----------------------------------------------------------------

    def active_peers(self) -> dict[str, str | None]:
        return self.rooms.active_decoders()

    def resumed_after_freeze(self, frozen_s: float) -> None:
        """Every live request fails: its decoders declared this rank hung and may have
        freed its pages, so nothing more is written (writers hold off until now)."""
        why = f"the prefill rank did not run for {frozen_s:.1f} s (stopped or starved)"
        for requests in self.rooms.fail_all(why):
            self._metrics.add_failure(FailureCause.PEER_LOST)
            self._tell_decoders(requests, why)

    def peer_lost(self, inbox: str, why: str, gone: bool) -> None:
        """A decode rank stopped answering: stop writing to it (always safe, whether it
        is `gone` or slow); its requests' source pages free once they drained (`Drain.settle`)."""
        for room_id, others in self.rooms.decoder_lost(inbox, why):
            logger.warning("request %d: %s", room_id, why)
            self._metrics.add_failure(FailureCause.PEER_LOST)
            self._tell_decoders(others, f"another decode rank of the request is lost: {why}")

    def housekeeping(self) -> None:
        """Deadlines and bounded memory, a few times a second."""
        for room_id, why in self.rooms.expire():
            # a flood of forged requests expires in bursts: one line per 10 s tells of it
            _peer_log.warning("expired", "request %d: %s", room_id, peer_text(why, 300))
            self._metrics.add_failure(FailureCause.TIMEOUT)
            for room in self.rooms.rooms_of([room_id]):
                self._tell_decoders(list(room.requests.values()), why)
        for room_id, acks in self.rooms.settle_quarantined():
            self._ack(room_id, acks)
        self.rooms.sweep()
        rooms, writes = self.rooms.counts()
        staged = 0 if self.staging is None else self.staging.area.used
        self._metrics.set_live(rooms, writes, staged)
        note_live(rooms, writes, staged)

    def tables(self) -> dict[str, int]:
        """This rank's tables and their entries, for `sgl_pd_table_entries`."""
        return {**self.rooms.sizes(), **self.rooms.pins.sizes()}

    # -- any thread ---------------------------------------------------------------------

    def fail(
        self, room_id: int, reason: str, cause: FailureCause = FailureCause.WRITE_FAILURE
    ) -> None:
        requests = self.rooms.fail(room_id, reason)
        if requests:
            self._metrics.add_failure(cause)
            self._tell_decoders(requests, reason)

    def close(self) -> None:
        self.writers.close()

    # -- helpers ------------------------------------------------------------------------

    def _destinations(self, room_id: int) -> list[Destination]:
        """The decode ranks this rank sends KV of the request to."""
        rooms = self.rooms.rooms_of([room_id])
        if not rooms or rooms[0].error is not None:
            return []
        dests = rooms[0].destinations
        return [dests[rank] for rank in sorted(dests) if dests[rank].mine]

    def _queue_metadata(self, room_id: int) -> None:
        for dest in self.rooms.take_metadata_due(room_id):
            self.writers.put(MetadataJob(dest, room_id))

    def _tell_decoders(
        self,
        requests: list[TransferRequest],
        why: str,
        code: ErrorCode = ErrorCode.TRANSFER_FAILED,
    ) -> None:
        """The request failed here: each decode rank that asked hears why."""
        for request in requests:
            self._send(
                request.decoder_inbox,
                ErrorMsg(
                    request_id=request.request_id,
                    code=code,
                    message=why[:1000],
                    sender_instance=self.instance,
                ),
            )

    def _ack(self, room_id: int, inboxes: set[str]) -> None:
        for inbox in inboxes:
            self._send(
                inbox,
                AbortAck(
                    request_id=room_id, prefill_rank=self.rank, prefill_instance=self.instance
                ),
            )

    def _done(self, room: Room) -> None:
        assert room.done_s is not None
        self._log_timing(room)
        self._trace(room)
        self._metrics.add_request(room.num_pages or 0, room.done_s - (room.first_write_s or 0))
        # after-forward mode has no forward-end stamp: SGLang's last send follows the forward
        forward_end_s = room.forward_end_s if room.forward_end_s is not None else room.last_send_s
        self._metrics.prefill_done(
            None if forward_end_s is None else room.done_s - forward_end_s,
            None if room.ready_s is None else room.ready_s - room.created_s,
            room.bytes_sent,
        )

    def _trace(self, room: Room) -> None:
        """The request's timeline, once: when it is done, or when SGLang lets go of it
        after a failure."""
        if room.traced or not self._tracing.wanted:
            return
        room.traced = True
        ends = (room.done_s, room.ended_s, room.created_s)
        end_s = next(t for t in ends if t is not None)
        chunks = [(i, s[0], s[1]) for i, s in sorted(room.chunk_writes.items())]
        attrs: list[tuple[str, int | float | str | bool]] = [
            ("sgl_pd.mode", "layerwise" if self.layerwise else "after_forward"),
            ("sgl_pd.tokens", room.tokens_planned),
            ("sgl_pd.held_tokens", room.held_tokens),
            ("sgl_pd.bytes", room.bytes_sent),
            ("sgl_pd.writes", room.writes_posted),
        ]
        forward_end_s = room.forward_end_s if room.forward_end_s is not None else room.last_send_s
        if room.done_s is not None and forward_end_s is not None:
            # seconds of transfer the prefill forward did not hide (as the histogram's)
            attrs.append(("sgl_pd.exposed_s", room.done_s - forward_end_s))
        self._tracing.emit(
            prefill_timeline(
                room=room.room,
                rank=self.rank,
                seen_s=room.created_s,
                ready_s=room.ready_s,
                first_write_s=room.first_write_s,
                end_s=end_s,
                chunks=chunks,
                attrs=tuple(attrs),
                error=room.error,
            )
        )

    def _log_timing(self, room: Room) -> None:
        """One line per request: what layer-wise streaming hides is visible here."""
        exposed = "" if room.forward_end_s is None else f" forward_end={room.forward_end_s:.6f}"
        exposed += f" last_send={room.last_send_s or 0.0:.6f}"
        # the state besides the KV written after the last chunk's forward (layer-wise,
        # each state layer's share goes during it where a step reports that layer;
        # after the forward, the window's pages of earlier chunks went with their KV,
        # `state_early`; all of it again after it where SGLang renamed the slots:
        # `state_renamed`)
        state_after = sum(d.state_bytes_after for d in room.destinations.values())
        state_early = sum(d.state_bytes_early for d in room.destinations.values())
        logger.info(
            "%s room=%d rank=%d mode=%s tokens=%d held=%d chunks=%d bytes=%d writes=%d "
            "state_early=%d state_after=%d state_renamed=%d first_write=%.6f"
            " last_chunk_first_write=%.6f%s done=%.6f",
            TIMING_LINE_PREFIX,
            room.room,
            self.rank,
            "layerwise" if self.layerwise else "after_forward",
            room.tokens_planned,
            room.held_tokens,
            room.chunks,
            room.bytes_sent,
            room.writes_posted,
            state_early,
            state_after,
            room.state_renamed,
            room.first_write_s or 0.0,
            room.last_chunk_first_write_s or 0.0,
            exposed,
            room.done_s or 0.0,
        )
