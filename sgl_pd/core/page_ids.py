"""A chunk's source page ids, which may still be on their way to host memory.

SGLang keeps a request's pages in a device tensor (`req_to_token`). Reading it on the
host before a forward (``.cpu()``) waits for every kernel queued on the scheduler's
stream; under the overlap scheduler that stream may wait on the forward in flight, so
the scheduler would stall once per batch. Instead the copy to pinned host memory is
queued on that stream (it lands before the next forward, which waits for the stream),
and whoever needs the ids later - the layer streamer when the first layer is done, the
allocator when SGLang frees a page - reads them then (`array`), waiting for the copy if
it has not landed yet (it has, in every order SGLang runs).

Pure: the waiting is a callable the edge supplies.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np

Fetch = Callable[[], np.ndarray]  # waits for the copy, returns the ids


class PageIds:
    """(pages,) int64 page ids, known now or fetched once on first use (thread-safe)."""

    __slots__ = ("_array", "_fetch", "_lock")

    def __init__(self, array: np.ndarray | None, fetch: Fetch | None) -> None:
        self._array = None if array is None else np.asarray(array, dtype=np.int64)
        self._fetch = fetch
        self._lock = threading.Lock()

    @classmethod
    def ready(cls, array: np.ndarray | list[int]) -> PageIds:
        return cls(np.asarray(array, dtype=np.int64), None)

    @classmethod
    def later(cls, fetch: Fetch) -> PageIds:
        return cls(None, fetch)

    @property
    def resolved(self) -> bool:
        return self._array is not None

    def array(self) -> np.ndarray:
        """The ids, (pages,) int64; the first call may wait for their copy."""
        if self._array is None:
            with self._lock:
                if self._array is None:
                    assert self._fetch is not None
                    self._array = np.asarray(self._fetch(), dtype=np.int64)
                    self._fetch = None
        return self._array
