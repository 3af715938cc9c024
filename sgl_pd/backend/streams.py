"""Following a request's outputs in SGLang's HTTP process until news from elsewhere
(a prefill server's refusal, a decoder's skip notice) ends it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any


class Stopped(Exception):
    """`stop` resolved while the next output was awaited; the request was ended."""


async def until_stopped(
    outputs: AsyncIterator[Any], stop: asyncio.Future[Any], end: Callable[[], None]
) -> AsyncIterator[Any]:
    """`outputs` as they come, unless `stop` resolves first while one is awaited: then
    `end()` ends the request (SGLang's abort), its last output is awaited and dropped,
    `outputs` is closed, and `Stopped` is raised. The output awaited never leaves an
    error unread, even when this generator is closed meanwhile (a client gone)."""
    outputs = aiter(outputs)
    step: asyncio.Future[Any] | None = None
    try:
        while True:
            step = asyncio.ensure_future(anext(outputs))
            step.add_done_callback(_read_outcome)
            await asyncio.wait({step, stop}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                end()
                with contextlib.suppress(Exception):
                    await step  # the end of the request
                with contextlib.suppress(Exception):
                    await outputs.aclose()  # type: ignore[attr-defined]
                raise Stopped
            try:
                out = step.result()
            except StopAsyncIteration:
                return
            yield out
    finally:
        if step is not None and not step.done():
            step.cancel()


def _read_outcome(task: asyncio.Future[Any]) -> None:
    if not task.cancelled():
        task.exception()
