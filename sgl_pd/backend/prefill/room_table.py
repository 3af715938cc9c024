"""The requests of a prefill rank by room id, and their state machine (`RoomTable`).

A request (SGLang's bootstrap room) moves WAITING_FOR_DECODER -> READY -> SENDING -> DONE
(`core.states.PREFILL_TABLE`), or to FAILED / ABORTED / TIMED_OUT from any of them; each
request waits at most `timeout_s` in a live state without progress.

Not thread-safe: `PrefillRooms` holds its lock around every use; no I/O.
"""

from __future__ import annotations

from sgl_pd.backend.prefill.drain import Drain
from sgl_pd.backend.prefill.room_types import Room
from sgl_pd.core.clock import Clock
from sgl_pd.core.pins import PagePins
from sgl_pd.core.states import PREFILL_TABLE, PrefillState, RequestTracker

_P = PrefillState


class RoomTable:
    def __init__(self, *, timeout_s: float, clock: Clock, pins: PagePins, quarantine_s: float):
        self.clock = clock
        self.rooms: dict[int, Room] = {}
        deadlines = {_P.WAITING_FOR_DECODER: timeout_s, _P.READY: timeout_s, _P.SENDING: timeout_s}
        self.states: RequestTracker[PrefillState] = RequestTracker(PREFILL_TABLE, deadlines, clock)
        self.drain = Drain(self.states, pins, quarantine_s)

    def room(self, room_id: int) -> Room:
        """The request, added (WAITING_FOR_DECODER) if it is not known yet."""
        room = self.rooms.get(room_id)
        if room is None:
            room = self.rooms[room_id] = Room(room_id, self.clock.monotonic())
            self.states.add(room_id)
        return room

    def drop(self, room_id: int) -> None:
        """Only a drained request is dropped (`ends.forget`, `retention.sweep`): a job still
        queued for it finds it gone at `PrefillRooms.begin_write`, so its pins go with it."""
        del self.rooms[room_id]
        self.states.forget(room_id)
        self.drain.pins.unpin(room_id)

    def state(self, room: Room) -> PrefillState:
        return self.states.state(room.room)

    def live(self, room: Room) -> bool:
        return not PREFILL_TABLE.is_final(self.state(room))

    def sending(self, room: Room) -> None:
        if self.state(room) is _P.READY:
            self.states.transition(room.room, _P.SENDING)

    def end(self, room: Room, state: PrefillState) -> None:
        """The request is final now (`state`, unless it was final already)."""
        if self.live(room):
            self.states.transition(room.room, state)
        room.ended_s = self.clock.monotonic()

    def stop(self, room: Room, why: str, state: PrefillState) -> None:
        """The request ends here with `why`: no write starts for it any more, and what
        `Drain.settle` allows happens now (a live request owes no drain acks yet)."""
        room.error = why
        self.end(room, state)
        self.drain.settle(room)
