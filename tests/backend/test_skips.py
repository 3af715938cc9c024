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


def test_its_tables_are_exported_as_they_change() -> None:
    from prometheus_client import CollectorRegistry

    from sgl_pd.backend.metrics import TableEntries

    registry = CollectorRegistry()
    rooms = SkippedRooms()
    rooms.export(TableEntries(True, "prefill", registry))

    def entries(table: str) -> float | None:
        labels = {"role": "prefill", "table": table}
        return registry.get_sample_value("sgl_pd_table_entries", labels)

    assert entries("skips_unclaimed") == 0 and entries("skips_watched") == 0
    rooms.skip(1)
    assert entries("skips_unclaimed") == 1

    async def arrive(room: int) -> None:
        rooms.watch(room)
        assert entries("skips_unclaimed") == 0  # room 1's notice claimed
        assert entries("skips_watched") == (1 if room == 2 else 0)
        rooms.unwatch(room)

    asyncio.run(arrive(1))
    asyncio.run(arrive(2))
    assert entries("skips_watched") == 0
