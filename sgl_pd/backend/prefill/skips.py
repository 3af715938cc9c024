"""Prefill server, router flow: requests whose decoder prefills them itself.

The router sends every request to both servers. A decoder that holds most of a prompt
prefills it locally (`backend/decode/local_prefill.py`) and tells this server's registry
so (`SkipPrefill`, sent until acknowledged). This server's copy then never runs: it is
answered at once, with no token, holding no page and no room - whichever arrives first:

- the request is already here (it waits for the decoder's `TransferRequest`s, which for
  a skipped room never come, so no prefill of it can have started): it is aborted in
  SGLang's queue and its client, the router, gets an empty answer;
- the notice came first: the room is remembered (the last `MAX_SKIPPED_ROOMS`), and the
  request is aborted and answered as it arrives.

Each request (or item of a batch) is handled once SGLang has handed it to the scheduler
(`around_stream_one_response`), so the abort always follows it on the same channel. A
room forgotten before its request arrived (more than `MAX_SKIPPED_ROOMS` skips in
between), or a notice that never came (the registry unreachable for the decoder's whole
resending), leaves a copy that waits out the bootstrap timeout and fails - and the router
then answers with that failure, though the decoder answered.

Runs in the HTTP front-end process: the registry thread calls `SkippedRooms.skip`, the
HTTP event loop runs `around_stream_one_response`. Hence one HTTP process: a prefill
server with several tokenizer workers is refused at start (`server_options`).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections import OrderedDict
from collections.abc import AsyncIterator
from typing import Any

from sgl_pd.backend.metrics import TableEntries
from sgl_pd.backend.streams import Stopped, until_stopped
from sgl_pd.config import sgl_pd_role

logger = logging.getLogger("sgl_pd.skips")

MAX_SKIPPED_ROOMS = 1 << 16  # skips remembered before their request arrived


class SkippedRooms:
    """Rooms decoders prefill themselves, and the requests here waiting for such news."""

    def __init__(self, max_rooms: int = MAX_SKIPPED_ROOMS) -> None:
        self._max_rooms = max_rooms
        self._lock = threading.Lock()
        self._early: OrderedDict[int, None] = OrderedDict()  # skipped, request not seen
        # room -> (its loop, resolved when the room is skipped); under _lock
        self._waiting: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = {}
        self._exported: TableEntries | None = None  # set by the first request (metrics on?)

    def export(self, tables: TableEntries) -> None:
        """From now on, every change sets `sgl_pd_table_entries` through `tables` (the
        first request's server arguments say whether metrics are on; later calls keep
        the first)."""
        with self._lock:
            if self._exported is None:
                self._exported = tables
        self._report()

    @property
    def exporting(self) -> bool:
        return self._exported is not None

    def tables(self) -> dict[str, int]:
        """Skip notices whose request has not arrived, and requests here that a notice
        would end."""
        with self._lock:
            return {"skips_unclaimed": len(self._early), "skips_watched": len(self._waiting)}

    def _report(self) -> None:
        if self._exported is not None:
            self._exported.set(self.tables())

    def skip(self, room: int) -> None:
        """A decoder prefills `room` itself (any thread; idempotent)."""
        with self._lock:
            waiting = self._waiting.pop(room, None)
            if waiting is None:
                self._early[room] = None
                self._early.move_to_end(room)
                while len(self._early) > self._max_rooms:
                    self._early.popitem(last=False)
        if waiting is not None:
            loop, future = waiting
            loop.call_soon_threadsafe(_resolve, future)
        self._report()

    def watch(self, room: int) -> asyncio.Future[None] | None:
        """None when `room` was skipped already; else a future resolved if it is."""
        with self._lock:
            early = room in self._early
            if early:
                del self._early[room]
            else:
                future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
                self._waiting[room] = (asyncio.get_running_loop(), future)
        self._report()
        return None if early else future

    def unwatch(self, room: int) -> None:
        with self._lock:
            self._waiting.pop(room, None)
        self._report()

    def __len__(self) -> int:
        with self._lock:
            return len(self._early) + len(self._waiting)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


SKIPPED = SkippedRooms()  # this process's (the registry and the HTTP API share it)


def skipped_answer(obj: Any) -> dict[str, Any]:
    """What the router gets for a skipped room: a finished request with no token (it
    reads the decoder's answer; this one only has to end well)."""
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": getattr(obj, "rid", None),
            "finish_reason": {"type": "length", "length": 0},
            "prompt_tokens": 0,
            "completion_tokens": 0,
            "cached_tokens": 0,
            "pd_prefilled_by_decoder": True,
        },
    }


async def around_stream_one_response(
    original: Any, manager: Any, *args: Any, **kw: Any
) -> AsyncIterator[Any]:
    """AROUND hook of ``TokenizerManager._stream_one_response`` (one request, or one
    item of a batch, already handed to the scheduler), on a prefill server of ours: a
    request whose room is skipped ends at once, without a prefill."""
    obj: Any = kw.get("obj", args[0] if args else None)
    room = getattr(obj, "bootstrap_room", None)
    if sgl_pd_role(manager.server_args) != "prefill" or not isinstance(room, int):
        async for out in original(manager, *args, **kw):
            yield out
        return
    if not SKIPPED.exporting:
        SKIPPED.export(
            TableEntries(bool(getattr(manager.server_args, "enable_metrics", False)), "prefill")
        )
    skipped = SKIPPED.watch(room)
    if skipped is None:  # the notice came first: end it at once
        skipped = asyncio.get_running_loop().create_future()
        skipped.set_result(None)
    # Once skipped, our copy (waiting in the bootstrap queue for the decoder's pages,
    # which never come) is aborted - the abort follows it on the same channel - and the
    # router gets an empty answer.
    try:
        async for out in until_stopped(
            original(manager, *args, **kw), skipped, lambda: manager.abort_request(obj.rid)
        ):
            yield out
    except Stopped:
        logger.debug("room %d is prefilled by its decoder: copy dropped", room)
        yield skipped_answer(obj)
    finally:
        SKIPPED.unwatch(room)
