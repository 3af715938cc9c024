"""Every request on one prefill rank (`PrefillRooms`): the one entry point, and the one
lock, for everything the prefill side knows of its requests - their states, decode ranks,
chunks and writes in flight.

Its methods take the lock and hand each question to the module that answers it:
- `room_types`: the records (`Room`, `Destination`, `Chunk`, `WriteEnd`);
- `room_table`: the requests by room id and their state machine;
- `destinations`: which decode ranks may ask, and what this rank writes into each;
- `writes_due`: which chunks, layers and metadata jobs are due, and when;
- `drain`: whether a request's pages may be freed and its drain acks sent (the drain
  rule, `Drain.settle`, and the failed-batch quarantine, `Drain.quarantine`);
- `ends`: how a request fails or is aborted, and whom it tells;
- `retention`: how many requests are kept, and how long.

Threads: SGLang's scheduler thread, the inbox thread, the layer streamer and the
destination writers all call in; every method takes the one lock and never does I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np

from sgl_pd.backend.prefill import destinations, ends, retention
from sgl_pd.backend.prefill.drain import FAILED_BATCH_QUARANTINE_S
from sgl_pd.backend.prefill.room_table import RoomTable
from sgl_pd.backend.prefill.room_types import Chunk, Destination, Room, StreamedState, WriteEnd
from sgl_pd.backend.prefill.writes_due import Writes, WritesDue
from sgl_pd.backend.state_slots import Slots
from sgl_pd.core.clock import Clock
from sgl_pd.core.layout import KvLayout
from sgl_pd.core.liveness import FreezeWatch
from sgl_pd.core.page_ids import PageIds
from sgl_pd.core.pins import PagePins
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.states import PrefillState
from sgl_pd.core.wire import ErrorCode, StateSlots, TransferRequest

_P = PrefillState


class PrefillRooms:
    def __init__(
        self,
        *,
        rank: int,
        scheme: ShardingScheme,
        layout: KvLayout,
        layerwise: bool,
        timeout_s: float,
        clock: Clock,
        draft_layers: int = 0,
        freeze: FreezeWatch | None = None,
        pins: PagePins | None = None,
        quarantine_s: float = FAILED_BATCH_QUARANTINE_S,
        state: tuple[StateSlots, ...] = (),
    ) -> None:
        self.rank = rank
        self.scheme = scheme
        self.layout = layout
        self.state_slots = state  # this rank's state besides the KV, a component per kind
        self.layerwise = layerwise
        self.timeout_s = timeout_s
        self._clock = clock
        self._freeze = freeze
        self.pins = pins if pins is not None else PagePins()
        self._lock = threading.Lock()
        self._table = RoomTable(
            timeout_s=timeout_s, clock=clock, pins=self.pins, quarantine_s=quarantine_s
        )
        self._rooms = self._table.rooms  # the same dict, for reading
        self._drain = self._table.drain
        draft = range(layout.num_layers - draft_layers, layout.num_layers)
        self._due = WritesDue(layout, layerwise, draft)

    @property
    def draft_layers(self) -> range:
        return self._due.draft_layers

    @property
    def quarantine_s(self) -> float:
        return self._drain.quarantine_s

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)

    # -- arrivals ---------------------------------------------------------------------------

    def track(self, room_id: int) -> None:
        """SGLang made a sender for this request (router flow: its copy of the request)."""
        with self._lock:
            self._table.room(room_id).owned = True

    def add_request(self, request: TransferRequest) -> str | None:
        """A decode rank's destinations (`destinations.join`). Returns why it is refused,
        or None."""
        with self._lock:
            if retention.no_room_for(self._rooms, request.request_id):
                return retention.unowned_full_message()
            room = self._table.room(request.request_id)
            why = destinations.join(
                room,
                request,
                rank=self.rank,
                layout=self.layout,
                scheme=self.scheme,
                state=self.state_slots,
            )
            if why is not None:
                return why
            waiting = self._table.state(room) is _P.WAITING_FOR_DECODER
            if waiting and destinations.every_rank_asked(room):
                self._table.states.transition(room.room, _P.READY)
                room.ready_s = self._clock.monotonic()
            return None

    def expect(self, room_id: int, num_pages: int, aux_index: int | None) -> None:
        """SGLang will send `num_pages` pages (those after the held prefix)."""
        with self._lock:
            room = self._table.room(room_id)
            room.num_pages, room.aux_index = num_pages, aux_index
            self._due.expect(room, num_pages)

    def held_tokens(self, room_id: int) -> int:
        """The prefix the decoder holds (SGLang's `pop_decode_prefix_len`): asked once
        every decode rank's request arrived, before the first forward; fixed from then."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return 0
            room.held_read = True
            return room.held_tokens

    def refuse(self, room_id: int, why: str) -> list[TransferRequest] | None:
        """SGLang refused this server's copy of the request (`ends.refuse`)."""
        with self._lock:
            return ends.refuse(self._table, room_id, why)

    def error_code(self, room_id: int) -> ErrorCode:
        """What a decode rank that asks for an ended request is told it ended with."""
        with self._lock:
            room = self._rooms.get(room_id)
            refused = room is not None and room.refused
            return ErrorCode.BAD_REQUEST if refused else ErrorCode.TRANSFER_FAILED

    def prompt_known(self, room_id: int, prompt_tokens: int) -> str | None:
        """SGLang fixed the tokens this prefill computes (`prompt_tokens`); returns why
        the decoders cannot be served them, or None (`destinations.prompt_mismatch`)."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return None
            room.prompt_tokens = prompt_tokens
            return destinations.prompt_mismatch(room)

    def prompt_mismatch(self, room_id: int) -> str | None:
        """`destinations.prompt_mismatch` of the request, or None when it is unknown."""
        with self._lock:
            room = self._rooms.get(room_id)
            return None if room is None else destinations.prompt_mismatch(room)

    # -- chunks -----------------------------------------------------------------------------

    def notice_chunk(
        self,
        room_id: int,
        src_pages: PageIds,
        end_token: int,
        is_last: bool,
        state: StreamedState | None = None,
    ) -> Chunk | None:
        """Layer-wise mode, before the forward (D7). None when nothing is to be sent.
        `state`: the request's state slots, read before its last chunk's forward."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.error is not None:
                return None
            if is_last and state is not None:
                room.streamed_state = state
            chunk = self._due.notice(room, src_pages, end_token, is_last)
            if chunk is None:
                return None
            self.pins.pin(room_id, chunk.src_pages)
            self._table.states.progressed(room_id)
            self._table.sending(room)
            return chunk

    def submit_chunk(
        self,
        room_id: int,
        pages: np.ndarray,
        num_tokens: int,
        state_slots: tuple[tuple[int, ...], ...] | None = None,
        state_so_far: Slots | None = None,
    ) -> Writes:
        """SGLang's `send` after a forward: the (chunk, layers) writes due now
        (`WritesDue.sent`), to be queued before `writes_queued` is called with them.
        `state_slots`: the request's state slots besides the KV, which SGLang names in
        its last send (the state is final then); `state_so_far`, at a send before it:
        their leading slots final already (`Room.state_so_far`)."""
        with self._lock:
            room = self._rooms.get(room_id)  # gone: SGLang concluded it, nothing to send
            if room is None or room.error is not None:
                return []
            if state_slots is not None:
                room.state_slots = state_slots
            for later in (state_so_far, state_slots):
                if later is not None and not _extends(later, room.state_so_far):
                    room.state_renamed = True
            if state_so_far is not None:
                room.state_so_far = state_so_far
            self.pins.pin(room_id, pages)
            if self._table.live(room):
                self._table.states.progressed(room_id)
            due, is_last = self._due.sent(room, pages, num_tokens)
            if due and not self.layerwise:
                self._table.sending(room)
            if is_last:
                room.last_send_s = self._clock.monotonic()
            return due

    def state_renamed(self, room_id: int) -> None:
        """SGLang's last send named other state slots than those read before the last
        chunk's forward: every region goes again, after it (`KvWriter._write_state`)."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is not None:
                room.state_renamed = True

    def writes_queued(self, room_id: int, writes: Writes) -> None:
        """The writes `submit_chunk` returned are queued for every destination."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is not None:
                self._due.queued(room, writes)

    def chunk_queued(self, chunk: Chunk) -> None:
        """Layer-wise mode: every target layer of `chunk` is queued for its destinations."""
        if chunk.is_last:
            with self._lock:
                room = self._rooms.get(chunk.room)
                if room is not None:
                    self._due.target_queued(room, chunk)

    def take_metadata_due(self, room_id: int) -> list[Destination]:
        """The destinations whose metadata job should be queued now, once
        (`WritesDue.take_metadata`)."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.error is not None or not self._due.take_metadata(room):
                return []
            self._table.sending(room)  # a full prefix hit sends its metadata only
            return [destinations.destination_or_notice(room, r) for r in sorted(room.requests)]

    # -- writes -----------------------------------------------------------------------------

    def begin_write(self, room_id: int, chunk: Chunk | None = None) -> Room | None:
        """A writer is about to write for this request; None: do not (it failed or is
        gone). Every non-None answer must be followed by `end_write`.

        No job starts once a request failed, aborted or timed out (it has an error), or
        is gone: the drain rule (`Drain.settle`) rests on this. A DONE request has no job
        left to start: its metadata jobs, each queued behind every layer on its
        destination's queue, were its last."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.error is not None:
                return None
            room.inflight += 1
            now = self._clock.monotonic()
            if room.first_write_s is None:
                room.first_write_s = now
            if chunk is not None and chunk.is_last and room.last_chunk_first_write_s is None:
                room.last_chunk_first_write_s = now
            if chunk is not None and len(room.chunk_writes) < retention.MAX_STAMPED_CHUNKS:
                room.chunk_writes.setdefault(chunk.index, [now, now])
            return room

    def end_write(
        self,
        room_id: int,
        bytes_sent: int,
        writes: int = 0,
        metadata_done: bool = False,
        batch_failed: bool = False,
        chunk_index: int | None = None,
    ) -> WriteEnd:
        """A write job ended (either way): the drain acks now owed, and whether this job
        completed the request. `batch_failed`: the engine reported a failed batch, some
        of whose writes may still be posted (`Drain.quarantine`); `chunk_index`: the chunk
        it wrote, if any."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return WriteEnd(set(), None)
            room.inflight -= 1
            room.bytes_sent += bytes_sent
            room.writes_posted += writes
            now = self._clock.monotonic()
            stamps = None if chunk_index is None else room.chunk_writes.get(chunk_index)
            if stamps is not None:
                stamps[1] = now
            if batch_failed:
                self._drain.quarantine(room, now)
            elif bytes_sent and room.error is None:
                self._table.states.progressed(room_id)
            completed = None
            if metadata_done and room.error is None:
                room.metadata_pending -= 1
                if room.metadata_pending == 0:
                    room.done_s = now
                    self._table.end(room, _P.DONE)
                    completed = room
            return WriteEnd(self._drain.settle(room), completed)

    # -- ends -------------------------------------------------------------------------------

    def fail(
        self, room_id: int, reason: str, state: PrefillState = _P.FAILED
    ) -> list[TransferRequest]:
        """Stops the request's writes (`ends.fail`)."""
        with self._lock:
            return ends.fail(self._table, room_id, reason, state)

    def abort(
        self, room_id: int, reason: str, ack_to: str | None, decoder_instance: int | None
    ) -> set[str] | None:
        """A decoder's abort, or SGLang's own (`ends.abort`)."""
        with self._lock:
            return ends.abort(self._table, room_id, reason, ack_to, decoder_instance)

    def abort_own(self, room_id: int, reason: str) -> list[TransferRequest]:
        """SGLang aborts the request itself (`ends.abort_own`)."""
        with self._lock:
            return ends.abort_own(self._table, room_id, reason)

    def decoder_lost(self, inbox: str, why: str) -> list[tuple[int, list[TransferRequest]]]:
        """A decode rank is lost (`ends.decoder_lost`)."""
        with self._lock:
            return ends.decoder_lost(self._table, inbox, why)

    def fail_all(self, why: str) -> list[list[TransferRequest]]:
        """This process was frozen past the hang timeout (`ends.fail_all`)."""
        with self._lock:
            return ends.fail_all(self._table, why)

    def forget(self, room_id: int) -> Room | None:
        """SGLang is done with the request (`ends.forget`)."""
        with self._lock:
            return ends.forget(self._table, room_id)

    def expire(self) -> list[tuple[int, str]]:
        """Requests past their state's deadline (`retention.expire`)."""
        with self._lock:
            return retention.expire(self._table, self.timeout_s)

    def sweep(self) -> int:
        """Drops the requests SGLang will not conclude (`retention.sweep`)."""
        with self._lock:
            return retention.sweep(self._table)

    def settle_quarantined(self) -> list[tuple[int, set[str]]]:
        """Requests whose failed-batch quarantine ended (`Drain.settle_quarantined`)."""
        with self._lock:
            return self._drain.settle_quarantined(self._rooms.values(), self._clock.monotonic())

    # -- readers ----------------------------------------------------------------------------

    def state(self, room_id: int) -> tuple[PrefillState, bool, str | None] | None:
        """(state, drained, error) or None when unknown. Drained: `Drain.drained`."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return None
            return self._table.state(room), self._drain.drained(room), room.error

    def frozen(self) -> bool:
        """This process was stopped about as long as the hang timeout and the liveness
        thread has not beaten since: nothing may be written (the writers fail the
        request instead)."""
        return self._freeze is not None and self._freeze.frozen()

    def freeze_limit_s(self) -> float:
        return 0.0 if self._freeze is None else self._freeze.limit_s

    def sizes(self) -> dict[str, int]:
        """Entries of its tables (a soak watches them return to 0)."""
        with self._lock:
            return {"rooms": len(self._rooms), "room_states": len(self._table.states)}

    def counts(self) -> tuple[int, int]:
        """(requests known, write jobs in flight), for the gauges and the pool line."""
        with self._lock:
            return len(self._rooms), sum(r.inflight for r in self._rooms.values())

    def active_decoders(self) -> dict[str, str | None]:
        """Inbox -> transfer session of the decode ranks this rank has live requests with
        (for liveness)."""
        with self._lock:
            return {
                q.decoder_inbox: q.decoder.session
                for r in self._rooms.values()
                if self._table.live(r) or r.inflight
                for q in r.requests.values()
            }

    def rooms_of(self, room_ids: Iterable[int]) -> list[Room]:
        with self._lock:
            return [r for i in room_ids if (r := self._rooms.get(i)) is not None]

    def mark_forward_end(self, room_ids: Iterable[int], at_s: float) -> None:
        """The forward of these requests' last chunk had ended by `at_s`: the latest of
        the stamps given wins (``run_batch`` returning stamps only the launch under the
        overlap scheduler; the layer streamer stamps when the device reported the last
        layer)."""
        with self._lock:
            for room_id in room_ids:
                room = self._rooms.get(room_id)
                if room is not None:
                    room.forward_end_s = max(at_s, room.forward_end_s or at_s)


def _extends(later: Slots, earlier: Slots | None) -> bool:
    """Whether every component's slots of `later` begin with those of `earlier` (SGLang
    named the same slots again, and maybe more)."""
    if earlier is None:
        return True
    return len(later) == len(earlier) and all(
        a[: len(b)] == b for a, b in zip(later, earlier, strict=True)
    )
