"""How many requests a prefill rank keeps, and for how long: its memory stays bounded
whatever peers send and whatever SGLang does.

- Requests decoders asked for that SGLang has not seen (yet) are at most
  `MAX_UNOWNED_ROOMS` (`no_room_for`).
- A request past its state's deadline times out (`expire`).
- A final, drained request SGLang will not conclude is dropped `UNOWNED_GRACE_S` after it
  ended (`sweep`).
- A request's timeline stamps at most `MAX_STAMPED_CHUNKS` chunks.

Called by `PrefillRooms` with its lock held; no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping

from sgl_pd.backend.prefill.room_table import RoomTable
from sgl_pd.backend.prefill.room_types import Room
from sgl_pd.core.states import Expired, PrefillState

# A final, drained request SGLang has not forgotten this long after it ended never will
# be (SGLang dropped it on one of its own paths, or never made a sender for it): dropped.
UNOWNED_GRACE_S = 60.0
# Requests decoders asked for that SGLang has not seen (yet): in the router flow both sides
# get a request at about the same time, so a few; more is a peer flooding this rank.
MAX_UNOWNED_ROOMS = 4096
# Chunks of one request whose write stamps are kept for its timeline: a 128k-token prompt
# in 8k-token chunks has 16; past this many the rest go unstamped (memory stays bounded)
MAX_STAMPED_CHUNKS = 256


def no_room_for(rooms: Mapping[int, Room], room_id: int) -> bool:
    """A request not known yet may not be added without SGLang's sender: too many are
    known that SGLang has not seen."""
    if room_id in rooms:
        return False
    return sum(1 for r in rooms.values() if not r.owned) >= MAX_UNOWNED_ROOMS


def unowned_full_message() -> str:
    return (
        f"{MAX_UNOWNED_ROOMS} requests wait for their prefill here already: send"
        " each request to the prefill server as well (the router does)"
    )


def expire(table: RoomTable, timeout_s: float) -> list[tuple[int, str]]:
    """Requests past their state's deadline, now TIMED_OUT: (room, reason)."""
    out = []
    for e in table.states.poll_timeouts():
        room = table.rooms[e.request_id]
        why = _expiry_reason(room, e, timeout_s)
        room.error = why
        room.ended_s = table.clock.monotonic()
        table.drain.settle(room)
        out.append((room.room, why))
    return out


def sweep(table: RoomTable) -> int:
    """Drops the final, drained requests SGLang will not conclude: no SGLang sender
    claimed it (a decoder asked, the router's copy never came), or SGLang released it
    on a path that stops polling (its own aborts, a clear while writes ran), a grace
    period after they ended. A request SGLang still holds stays, however long its
    prefill runs: its next poll must find it. Returns how many."""
    now = table.clock.monotonic()
    stale = [r.room for r in table.rooms.values() if _stale(r, now, table.drain.drained(r))]
    for room_id in stale:
        table.drop(room_id)
    return len(stale)


def _stale(room: Room, now_s: float, drained: bool) -> bool:
    return (
        (room.released or not room.owned)
        and room.ended_s is not None
        and drained
        and now_s - room.ended_s > UNOWNED_GRACE_S
    )


def _expiry_reason(room: Room, expired: Expired[PrefillState], timeout_s: float) -> str:
    """Why a request past its state's deadline timed out, for its decoders and the log."""
    if expired.state is PrefillState.WAITING_FOR_DECODER and room.requests:
        return (
            f"{len(room.requests)} of request {room.room}'s {room.decoder_tp} decode"
            f" ranks asked for it, the others not within {timeout_s:g} s: they"
            " wait for receive staging (raise --pd-staging-mb) or are stuck"
        )
    if expired.state is PrefillState.WAITING_FOR_DECODER:
        return (
            f"no decoder asked for request {room.room} within {timeout_s:g} s:"
            " the decode server waits for receive staging (raise --pd-staging-mb),"
            " or does not reach this prefiller's bootstrap port"
        )
    return (
        f"request {room.room} made no progress for {expired.waited_s:.1f} s ({expired.state.value})"
    )
