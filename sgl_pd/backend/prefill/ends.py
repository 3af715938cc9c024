"""How a request ends other than DONE - it fails, a decoder or SGLang aborts it, a decode
rank is lost, SGLang refuses or lets go of it - and whom each end tells.

Every end stops the request's writes at once (`RoomTable.stop`); its pages and drain acks
wait for the drain rule (`Drain.settle`).

Functions on the `RoomTable`, called by `PrefillRooms` with its lock held; no I/O.
"""

from __future__ import annotations

from sgl_pd.backend.prefill import retention
from sgl_pd.backend.prefill.room_table import RoomTable
from sgl_pd.backend.prefill.room_types import Room
from sgl_pd.core.states import PrefillState
from sgl_pd.core.wire import TransferRequest

_P = PrefillState


def fail(table: RoomTable, room_id: int, reason: str, state: PrefillState) -> list[TransferRequest]:
    """Stops the request's writes; returns the decode ranks to tell (first failure only)."""
    room = table.rooms.get(room_id)
    if room is None or room.error is not None:
        return []
    table.stop(room, reason, state)
    return list(room.requests.values())


def refuse(table: RoomTable, room_id: int, why: str) -> list[TransferRequest] | None:
    """SGLang refused this server's copy of the request before it made a sender: no
    prefill of it will run here. Returns the decode ranks to tell now (None when it
    had ended already); those that ask later are refused with `why` as they ask,
    until the room is swept (`retention.UNOWNED_GRACE_S` after this)."""
    if retention.no_room_for(table.rooms, room_id):
        return None  # no decoder asked: none is waiting for it
    room = table.room(room_id)
    if room.error is not None or room.owned:
        return None  # ended already, or SGLang holds it (its own abort applies)
    room.refused = True
    table.stop(room, why, _P.FAILED)
    return list(room.requests.values())


def abort(
    table: RoomTable, room_id: int, reason: str, ack_to: str | None, decoder_instance: int | None
) -> set[str] | None:
    """A decoder's abort (`decoder_instance`: the sending decode rank), or SGLang's own
    (None). Returns inboxes to drain-ack now (later acks come from `end_write` once the
    writes in flight ended), or None when refused: other decode ranks asked for it."""
    room = table.rooms.get(room_id)
    owners = {q.decoder.instance for q in room.requests.values()} if room else set()
    if (
        room is not None
        and decoder_instance is not None
        and owners
        and decoder_instance not in owners
    ):
        if len(room.requests) < (room.decoder_tp or 0):
            # Another rank of the request's decoder whose TransferRequest has not
            # come (it was resent, and its abort overtook it): this rank never
            # wrote to it and never will - the copy is refused when it comes -
            # so its abort is acked, and nothing else changes.
            room.aborted_early.add(decoder_instance)
            return {ack_to} if ack_to else set()
        return None
    if room is None:
        # Nothing of it is or will be in flight. Remember it failed, so that the
        # router's copy, if it comes later, fails at once instead of waiting
        # (unless too many such records exist: then that copy times out).
        if retention.no_room_for(table.rooms, room_id):
            return {ack_to} if ack_to else set()
        room = table.room(room_id)
        room.error = reason
        table.end(room, _P.ABORTED)
        return {ack_to} if ack_to else set()
    if room.error is None:
        room.error = reason
        table.end(room, _P.ABORTED)
    if ack_to:
        room.acks_owed.add(ack_to)
    return table.drain.settle(room)


def abort_own(table: RoomTable, room_id: int, reason: str) -> list[TransferRequest]:
    """SGLang aborts the request itself: it stops like a decoder's abort; returns the
    decode ranks to tell (they would otherwise wait for KV until their timeout)."""
    room = table.rooms.get(room_id)
    if room is None:
        return []
    room.released = True
    if room.error is not None:
        return []
    table.stop(room, reason, _P.ABORTED)
    return list(room.requests.values())


def decoder_lost(table: RoomTable, inbox: str, why: str) -> list[tuple[int, list[TransferRequest]]]:
    """A decode rank is lost: fail every request writing to it. Returns (room, the
    room's *other* decode ranks): they must hear, or they wait for KV that never
    comes until their transfer timeout."""
    rooms = [
        r
        for r in table.rooms.values()
        if table.live(r) and any(q.decoder_inbox == inbox for q in r.requests.values())
    ]
    out = []
    for room in rooms:
        room.acks_owed.discard(inbox)
        table.stop(room, why, _P.FAILED)
        others = [q for q in room.requests.values() if q.decoder_inbox != inbox]
        out.append((room.room, others))
    return out


def fail_all(table: RoomTable, why: str) -> list[list[TransferRequest]]:
    """Fails every live request (this process was frozen past the hang timeout);
    returns each one's decode ranks to tell."""
    rooms = [r for r in table.rooms.values() if table.live(r)]
    for room in rooms:
        table.stop(room, why, _P.FAILED)
    return [list(room.requests.values()) for room in rooms]


def forget(table: RoomTable, room_id: int) -> Room | None:
    """SGLang is done with the request (it no longer holds pages for it)."""
    room = table.rooms.get(room_id)
    if room is None:
        return None
    if not table.drain.drained(room):
        # SGLang gave up on it while writes run: they stop, and the request
        # stays until they ended (its pins with it); `retention.sweep` drops it then
        room.released = True
        if room.error is None:
            room.error = "dropped by the prefill scheduler"
            table.end(room, _P.FAILED)
        return room
    table.drop(room_id)
    return room
