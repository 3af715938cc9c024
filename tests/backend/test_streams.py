"""Following a request's outputs until news from elsewhere ends it (`backend.streams`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from sgl_pd.backend.streams import Stopped, until_stopped


def test_outputs_pass_until_the_stop_ends_the_request() -> None:
    async def run() -> tuple[list[int], list[str]]:
        ended = asyncio.Event()
        calls: list[str] = []

        async def outputs() -> AsyncIterator[int]:
            yield 1
            await ended.wait()  # the request waits until it is ended
            calls.append("ended seen")

        stop = asyncio.get_running_loop().create_future()
        seen: list[int] = []
        with pytest.raises(Stopped):
            async for out in until_stopped(
                outputs(), stop, lambda: (calls.append("end"), ended.set())
            ):
                seen.append(out)
                stop.set_result(None)
        return seen, calls

    assert asyncio.run(run()) == ([1], ["end", "ended seen"])


def test_a_stream_that_ends_first_is_passed_whole() -> None:
    async def run() -> list[int]:
        async def outputs() -> AsyncIterator[int]:
            for i in range(3):
                yield i

        stop = asyncio.get_running_loop().create_future()
        return [out async for out in until_stopped(outputs(), stop, lambda: None)]

    assert asyncio.run(run()) == [0, 1, 2]


def test_a_closed_follower_leaves_no_error_unread(caplog: pytest.LogCaptureFixture) -> None:
    """The client went away while an output was awaited: the request's own error later
    (SGLang raises one for a disconnected client) is read, not logged as never retrieved."""

    async def run() -> None:
        fail = asyncio.Event()

        async def outputs() -> AsyncIterator[int]:
            await fail.wait()
            raise ValueError("disconnected")
            yield 0  # pragma: no cover

        stop = asyncio.get_running_loop().create_future()
        follower = until_stopped(outputs(), stop, lambda: None)
        first = asyncio.ensure_future(anext(follower))
        await asyncio.sleep(0.01)
        first.cancel()  # the HTTP side stops reading
        with pytest.raises(asyncio.CancelledError):
            await first
        await follower.aclose()
        fail.set()
        await asyncio.sleep(0.01)

    with caplog.at_level("ERROR", logger="asyncio"):
        asyncio.run(run())
        import gc

        gc.collect()
    assert "never retrieved" not in caplog.text
