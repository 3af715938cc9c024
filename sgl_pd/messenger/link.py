"""Links: DEALER sockets that send messages to a peer's inbox, and a pool of them.

Threading: any thread may call `Link.send`; the socket and the codec are used only under
the link's lock. A send waits at most `send_timeout_s` and then raises `PeerUnreachable`:
with ZMQ_IMMEDIATE set, ZMQ queues nothing for a peer it is not connected to, so a send
to a dead peer fails instead of piling up messages that a restarted peer would get stale.
ZMTP heartbeats (a socket option, no code of ours) notice a silent peer host.
"""

from __future__ import annotations

import logging
import threading

import zmq

from sgl_pd.core.wire import FrameCodec, Message
from sgl_pd.messenger._sockets import ContextOwner, ZmqContext, ZmqSocket
from sgl_pd.messenger.auth import ClusterAuth
from sgl_pd.messenger.errors import InvalidAddress, MessengerClosed, PeerUnreachable

logger = logging.getLogger(__name__)

SEND_TIMEOUT_S = 1.0  # longest a send waits for a connection or for queue space
SND_HWM = 1000  # messages queued per link while the peer is slow to read
HEARTBEAT_IVL_MS = 2000  # ZMTP ping interval on an idle connection
HEARTBEAT_TIMEOUT_MS = 10_000  # no traffic for this long: ZMQ drops the connection
RECONNECT_IVL_MS = 100
RECONNECT_IVL_MAX_MS = 2000  # reconnect back-off cap while a peer is down


class Link:
    """A connection to one peer inbox ("tcp://host:port")."""

    def __init__(
        self,
        endpoint: str,
        codec: FrameCodec,
        *,
        send_timeout_s: float = SEND_TIMEOUT_S,
        hwm: int = SND_HWM,
        auth: ClusterAuth | None = None,
        context: ZmqContext | None = None,
    ) -> None:
        """`codec` is used only under this link's lock: do not share it with other threads.
        With `auth` the link is a CURVE client of the cluster (`messenger.auth`)."""
        self._endpoint = endpoint
        self._codec = codec
        self._send_timeout_s = send_timeout_s
        self._lock = threading.Lock()
        self._ctx = ContextOwner(context)
        sock = self._ctx.context.socket(zmq.DEALER)
        for opt, value in (
            (zmq.LINGER, 0),  # close() never waits for unsent messages
            (zmq.IMMEDIATE, 1),
            (zmq.SNDHWM, hwm),
            (zmq.SNDTIMEO, max(0, int(send_timeout_s * 1000))),
            (zmq.RCVHWM, 1),  # inboxes never answer on this socket
            (zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS),
            (zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS),
            (zmq.RECONNECT_IVL, RECONNECT_IVL_MS),
            (zmq.RECONNECT_IVL_MAX, RECONNECT_IVL_MAX_MS),
        ):
            sock.setsockopt(opt, value)
        if auth is not None:
            auth.make_client(sock)
        try:
            sock.connect(endpoint)
        except zmq.ZMQError as e:
            sock.close(linger=0)
            self._ctx.release()
            raise InvalidAddress(f"cannot connect to {endpoint!r}: {e}") from e
        self._sock: ZmqSocket | None = sock

    @property
    def endpoint(self) -> str:
        return self._endpoint

    def send(self, msg: Message) -> None:
        """Hand `msg` to ZMQ for the peer. Raises `PeerUnreachable` if that cannot happen
        within the send timeout (the message is then not sent), `MessengerClosed` after
        `close()`. Delivery itself is not confirmed: answers come as messages."""
        with self._lock:
            if self._sock is None:
                raise MessengerClosed(f"link to {self._endpoint} is closed")
            frame = self._codec.encode(msg)
            try:
                self._sock.send(frame, copy=False)
            except zmq.Again as e:
                raise PeerUnreachable(
                    self._endpoint,
                    f"no connection or no queue space within {self._send_timeout_s} s;"
                    " the peer is down, restarted elsewhere, or not reading",
                ) from e

    def close(self) -> None:
        """Close the socket, dropping unsent messages; idempotent."""
        with self._lock:
            if self._sock is None:
                return
            self._sock.close(linger=0)
            self._sock = None
        self._ctx.release()


class LinkPool:
    """Links by endpoint, made on first use; thread-safe. Drop a link when its peer
    restarted (a restarted rank publishes a new inbox endpoint)."""

    def __init__(
        self,
        layout_hash: int,
        *,
        send_timeout_s: float = SEND_TIMEOUT_S,
        hwm: int = SND_HWM,
        auth: ClusterAuth | None = None,
        context: ZmqContext | None = None,
    ) -> None:
        self._layout_hash = layout_hash
        self._auth = auth
        self._send_timeout_s = send_timeout_s
        self._hwm = hwm
        self._ctx = ContextOwner(context)
        self._lock = threading.Lock()
        self._links: dict[str, Link] = {}
        self._closed = False

    def get(self, endpoint: str) -> Link:
        with self._lock:
            if self._closed:
                raise MessengerClosed("link pool is closed")
            link = self._links.get(endpoint)
            if link is None:
                link = Link(
                    endpoint,
                    FrameCodec(self._layout_hash),  # one per link: codecs are not thread-safe
                    send_timeout_s=self._send_timeout_s,
                    hwm=self._hwm,
                    auth=self._auth,
                    context=self._ctx.context,
                )
                self._links[endpoint] = link
            return link

    def send(self, endpoint: str, msg: Message) -> None:
        """`get(endpoint).send(msg)`; raises what `Link.send` raises."""
        self.get(endpoint).send(msg)

    def drop(self, endpoint: str) -> None:
        """Close and forget the link to `endpoint` (no-op if there is none)."""
        with self._lock:
            link = self._links.pop(endpoint, None)
        if link is not None:
            link.close()

    def endpoints(self) -> list[str]:
        with self._lock:
            return sorted(self._links)

    def close(self) -> None:
        """Close every link; idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            links, self._links = list(self._links.values()), {}
        for link in links:
            link.close()
        self._ctx.release()

    def __enter__(self) -> LinkPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
