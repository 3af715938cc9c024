"""Sends to peer inboxes that never block the caller, and never let one peer delay another.

SGLang's scheduler thread and our inbox thread both send messages (transfer requests,
aborts, drain acks, heartbeat answers). A `Link.send` to a peer that is down waits up to
its send timeout, so those threads only enqueue here: each peer endpoint has its own
bounded queue and its own sender thread, which exits after a while without traffic.
A message that cannot be delivered is dropped and logged; liveness (heartbeats) and the
request deadlines are what turn a lost message into a clear failure.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading

from sgl_pd.core.wire import Message
from sgl_pd.errors import SglPdError
from sgl_pd.messenger.link import LinkPool

logger = logging.getLogger(__name__)

MAX_QUEUED = 1000  # messages waiting per peer before new ones are dropped
IDLE_EXIT_S = 30.0  # a peer's sender thread exits after this long without messages


class Outbox:
    def __init__(
        self,
        links: LinkPool,
        name: str,
        *,
        max_queued: int = MAX_QUEUED,
        idle_exit_s: float = IDLE_EXIT_S,
    ) -> None:
        self._links = links
        self._name = name
        self._max_queued = max_queued
        self._idle_exit_s = idle_exit_s
        self._lock = threading.Lock()
        self._queues: dict[str, queue.Queue[Message | None]] = {}
        self._closed = False
        self.dropped = 0  # messages not handed to ZMQ (queue full, peer unreachable)

    def send(self, endpoint: str, message: Message) -> bool:
        """Queues `message` for `endpoint`; False (and counted) when it was dropped."""
        with self._lock:
            if self._closed:
                return False
            q = self._queues.get(endpoint)
            if q is None:
                q = self._queues[endpoint] = queue.Queue(self._max_queued)
                threading.Thread(
                    target=self._run,
                    args=(endpoint, q),
                    name=f"sgl-pd-outbox-{self._name}",
                    daemon=True,
                ).start()
            try:
                q.put_nowait(message)
                return True
            except queue.Full:
                self.dropped += 1
        logger.warning("outbox to %s is full: dropped %s", endpoint, type(message).__name__)
        return False

    def close(self) -> None:
        with self._lock:
            self._closed = True
            queues, self._queues = list(self._queues.values()), {}
        for q in queues:
            # a full queue's thread sees the closed flag after its current message
            with contextlib.suppress(queue.Full):
                q.put_nowait(None)

    # -- one thread per peer endpoint -----------------------------------------------------

    def _run(self, endpoint: str, q: queue.Queue[Message | None]) -> None:
        while True:
            try:
                message = q.get(timeout=self._idle_exit_s)
            except queue.Empty:
                with self._lock:
                    if q.empty():  # nothing raced in: retire this peer's thread
                        if self._queues.get(endpoint) is q:
                            del self._queues[endpoint]
                        return
                continue
            if message is None or self._closed:
                return
            try:
                self._links.send(endpoint, message)
            except SglPdError as e:
                with self._lock:
                    self.dropped += 1
                logger.warning("could not send %s to %s: %s", type(message).__name__, endpoint, e)
