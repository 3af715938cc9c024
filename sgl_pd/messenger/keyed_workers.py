"""One FIFO queue and one thread per key (a peer), so work for one peer runs in order and
a slow or dead peer holds up only its own queue.

A key's thread starts with its first item and exits after `idle_exit_s` without work, so
peers that come and go (restarted servers publish new endpoints) leave no threads behind.
Used for the outbox (messages per peer inbox) and the prefill writers (KV writes per
decode rank).
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class KeyedWorkers(Generic[T]):
    def __init__(
        self,
        handle: Callable[[str, T], None],
        name: str,
        *,
        max_queued: int = 0,
        max_keys: int = 0,
        idle_exit_s: float = 30.0,
        on_retire: Callable[[str], None] | None = None,
    ) -> None:
        """`handle(key, item)` runs on the key's thread; an exception it lets out is logged
        and kills that thread (counted in `thread_failures`), the next item starts a new
        one. `max_queued`: items waiting per key before `put` refuses (0: no limit);
        `max_keys`: keys with a thread at once before `put` refuses a new one (0: no
        limit). `on_retire(key)` runs on a key's thread when it exits idle."""
        self._handle = handle
        self._max_keys = max_keys
        self._on_retire = on_retire
        self._name = name
        self._max_queued = max_queued
        self._idle_exit_s = idle_exit_s
        self._lock = threading.Lock()
        self._queues: dict[str, queue.Queue[T | None]] = {}
        self._threads: list[threading.Thread] = []
        self._closed = False
        self.thread_failures = 0

    def put(self, key: str, item: T) -> bool:
        """Queues `item` for `key`; False when closed or the key's queue is full."""
        with self._lock:
            if self._closed:
                return False
            q = self._queues.get(key)
            if q is None:
                if self._max_keys and len(self._queues) >= self._max_keys:
                    return False
                q = self._queues[key] = queue.Queue(self._max_queued)
                thread = threading.Thread(
                    target=self._run, args=(key, q), name=self._name, daemon=True
                )
                self._threads = [t for t in self._threads if t.is_alive()] + [thread]
                thread.start()
            try:
                q.put_nowait(item)
                return True
            except queue.Full:
                return False

    def close(self, timeout_s: float | None = None) -> None:
        """No new items; each thread ends after the item it is on (items still queued
        are dropped). With `timeout_s`, waits up to that long for each thread."""
        with self._lock:
            self._closed = True
            queues, threads = list(self._queues.values()), list(self._threads)
            self._queues = {}
        for q in queues:
            while True:  # make room for the stop marker
                try:
                    q.get_nowait()
                except queue.Empty:
                    break
            q.put_nowait(None)
        if timeout_s is not None:
            for thread in threads:
                thread.join(timeout=timeout_s)

    def _run(self, key: str, q: queue.Queue[T | None]) -> None:
        try:
            while True:
                try:
                    item = q.get(timeout=self._idle_exit_s)
                except queue.Empty:
                    with self._lock:
                        retire = q.empty()  # nothing raced in: retire this key's thread
                        if retire and self._queues.get(key) is q:
                            del self._queues[key]
                    if not retire:
                        continue
                    if self._on_retire is not None:
                        self._on_retire(key)
                    return
                if item is None:
                    return
                self._handle(key, item)
        except Exception:
            with self._lock:
                self.thread_failures += 1
                if self._queues.get(key) is q:
                    del self._queues[key]
            logger.exception("%s: worker for %s died", self._name, key)
