"""Sends to peer inboxes that never block the caller, and never let one peer delay another.

SGLang's scheduler thread and our inbox thread both send messages (transfer requests,
aborts, drain acks, heartbeat answers). A `Link.send` to a peer that is down waits up to
its send timeout, so those threads only enqueue here: each peer endpoint has its own
bounded queue and sender thread (`KeyedWorkers`). A message that cannot be delivered is
dropped and logged; liveness (heartbeats) and the request deadlines are what turn a lost
message into a clear failure.
"""

from __future__ import annotations

import logging
import threading

from sgl_pd.core.wire import Message
from sgl_pd.errors import SglPdError
from sgl_pd.log_limits import LogLimiter, peer_text
from sgl_pd.messenger.keyed_workers import KeyedWorkers
from sgl_pd.messenger.link import LinkPool

logger = logging.getLogger(__name__)
_drops = LogLimiter(logger)

MAX_QUEUED = 1000  # messages waiting per peer before new ones are dropped
# peers with messages under way at once: a rank talks to the ranks of the servers it pairs
# with; far more means a peer names endpoints that are not ours to flood (heartbeat senders)
MAX_PEERS = 1024
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
        self._workers: KeyedWorkers[Message] = KeyedWorkers(
            self._deliver,
            f"sgl-pd-outbox-{name}",
            max_queued=max_queued,
            max_keys=MAX_PEERS,
            idle_exit_s=idle_exit_s,
            on_retire=links.drop,  # a peer quiet this long needs no open connection
        )
        self._lock = threading.Lock()
        self.dropped = 0  # messages not handed to ZMQ (queue full, peer unreachable)

    def send(self, endpoint: str, message: Message) -> bool:
        """Queues `message` for `endpoint`; False (and counted) when it was dropped."""
        if self._workers.put(endpoint, message):
            return True
        self._count_drop()
        _drops.warning(
            "full",
            "outbox to %s is full or closed, or %d peers are busy: dropped %s",
            peer_text(endpoint),
            MAX_PEERS,
            type(message).__name__,
        )
        return False

    @property
    def thread_failures(self) -> int:
        """Sender threads that died (a bug: sends catch every error of the peer's)."""
        return self._workers.thread_failures

    def close(self) -> None:
        self._workers.close()

    def _deliver(self, endpoint: str, message: Message) -> None:
        try:
            self._links.send(endpoint, message)
        except SglPdError as e:
            self._count_drop()
            _drops.warning(
                f"send:{type(message).__name__}",
                "could not send %s to %s: %s",
                type(message).__name__,
                peer_text(endpoint),
                e,
            )

    def _count_drop(self) -> None:
        with self._lock:
            self.dropped += 1
