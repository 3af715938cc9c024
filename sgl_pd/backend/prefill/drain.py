"""May a request's pages be freed? The drain rule (`Drain.settle`) and the failed-batch
quarantine that holds it off (`Drain.quarantine`), in one place for both sides: the
prefill rank's source pages (its pins) and the decoder's destination pages (its drain
acks).

Called by `PrefillRooms` with its lock held; no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable

from sgl_pd.backend.prefill.room_types import Room
from sgl_pd.core.bounds import DEFAULT_ENGINE_TRANSFER_TIMEOUT_S, failed_batch_quarantine_s
from sgl_pd.core.pins import PagePins
from sgl_pd.core.states import PREFILL_TABLE, PrefillState, RequestTracker

# Seconds a request stays undrained after one of its write batches failed (`core.bounds`:
# the engine's transfer timeout twice), unless the backend passes its own bounds'.
FAILED_BATCH_QUARANTINE_S = failed_batch_quarantine_s(DEFAULT_ENGINE_TRANSFER_TIMEOUT_S)


class Drain:
    def __init__(
        self, states: RequestTracker[PrefillState], pins: PagePins, quarantine_s: float
    ) -> None:
        self._states = states
        self.pins = pins
        self.quarantine_s = quarantine_s  # a failed batch's writes may land this long

    def drained(self, room: Room) -> bool:
        """No write of the request is running (between `PrefillRooms.begin_write` and
        `end_write`) or may still land (`quarantine`)."""
        return room.inflight == 0 and room.quarantine_until_s is None

    def settle(self, room: Room) -> set[str]:
        """The one answer to "may this request's pages be freed?": once the request is
        final and drained - no write of it can start any more (`PrefillRooms.begin_write`),
        none runs and none may still land (`drained`). Then, and only then:

        - its source pages are unpinned (`core.pins`): SGLang may reuse them, however and
          whenever it freed them;
        - the `AbortAck`s owed to decoders are due, which is what lets a decoder free its
          own pages: a decoder never frees pages a write of ours may still land in.

        Every path that may end a request or a write calls this. Returns the decoder
        inboxes to ack now."""
        if not (self.drained(room) and PREFILL_TABLE.is_final(self._states.state(room.room))):
            return set()
        self.pins.unpin(room.room)
        if room.error is None or not room.acks_owed:
            return set()
        acks, room.acks_owed = room.acks_owed, set()
        return acks

    def quarantine(self, room: Room, now_s: float) -> None:
        """A write job ended with a failed batch. The transfer engine reports a batch
        failed as soon as one of its writes failed, while others may still be posted: the
        request stays undrained for `quarantine_s` (how long, and why that is enough:
        `core.bounds.failed_batch_quarantine_s`), whatever happens to it meanwhile.
        `settle_quarantined` ends it."""
        room.quarantine_until_s = now_s + self.quarantine_s

    def settle_quarantined(self, rooms: Iterable[Room], now_s: float) -> list[tuple[int, set[str]]]:
        """Ends the quarantines that are over, and settles those requests: (room, drain
        acks now owed)."""
        out = []
        for room in rooms:
            until = room.quarantine_until_s
            if until is not None and now_s >= until:
                room.quarantine_until_s = None
                room.ended_s = now_s  # SGLang's poll gets its grace from now
                acks = self.settle(room)
                if acks:
                    out.append((room.room, acks))
        return out
