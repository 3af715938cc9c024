"""Router flow, prefill server: a room its decoder prefills itself is answered at once,
whichever comes first - the decoder's notice or the router's copy of the request."""

from __future__ import annotations

import asyncio
import threading

from sgl_pd.backend.prefill.skips import SkippedRooms


def test_a_notice_before_the_request_answers_it_on_arrival() -> None:
    rooms = SkippedRooms()
    rooms.skip(7)

    async def arrive() -> object:
        return rooms.watch(7)

    assert asyncio.run(arrive()) is None  # answered at once
    assert len(rooms) == 0  # (and forgotten: a room is skipped once)


def test_a_notice_after_the_request_resolves_its_wait_from_another_thread() -> None:
    rooms = SkippedRooms()

    async def arrive_then_skipped() -> bool:
        waiting = rooms.watch(8)
        assert waiting is not None and not waiting.done()
        threading.Thread(target=rooms.skip, args=(8,)).start()  # the registry's thread
        await asyncio.wait_for(waiting, timeout=10)
        rooms.unwatch(8)
        return waiting.done()

    assert asyncio.run(arrive_then_skipped())
    assert len(rooms) == 0


def test_unskipped_rooms_are_not_touched_and_early_notices_are_bounded() -> None:
    rooms = SkippedRooms(max_rooms=4)
    for room in range(10):
        rooms.skip(room)
    assert len(rooms) == 4  # the oldest forgotten

    async def arrive(room: int) -> object:
        waiting = rooms.watch(room)
        if waiting is not None:
            rooms.unwatch(room)
        return waiting

    assert asyncio.run(arrive(9)) is None
    assert asyncio.run(arrive(0)) is not None  # forgotten: it waits (for its decoder)
    assert asyncio.run(arrive(100)) is not None
