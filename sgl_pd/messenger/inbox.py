"""A rank's inbox: one ROUTER socket on a free port, read by one named thread.

Every rank (prefill or decode) owns one inbox and publishes its endpoint in its
`ShardRegistration`; others send to it through `Link`s. Nothing is ever sent back on the
inbox socket: answers travel through the answering side's own link to the asker's inbox.

Threading: the socket is bound on the constructing thread (so a bind error is raised to
the caller) and from then on used and closed only by the inbox thread, which decodes
each frame and calls `on_message` on that thread. A handler must therefore be quick and
must not block (hand work to a queue); its exceptions are logged and counted, never fatal.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from sgl_pd.core.errors import WireError
from sgl_pd.core.wire import MAX_FRAME_BYTES, FrameCodec, Message
from sgl_pd.log_limits import LogLimiter, peer_text
from sgl_pd.messenger._sockets import RouterThread, ZmqContext, ZmqSocket
from sgl_pd.messenger.auth import ClusterAuth

logger = logging.getLogger(__name__)

RCV_HWM = 1000  # messages queued before ZMQ drops new ones for a slow inbox thread
_LOUD_BAD_FRAMES = 10  # log every bad frame up to here, then one in _QUIET_EVERY
_QUIET_EVERY = 1000


def _peer_address(frame: zmq.Frame) -> str:
    try:
        return str(frame.get("Peer-Address"))
    except (zmq.ZMQError, AttributeError):  # transport without a peer address
        return "?"


class Inbox(RouterThread):
    """ROUTER bound to tcp://host:<free port>, delivering decoded messages to `on_message`."""

    def __init__(
        self,
        host: str,
        codec: FrameCodec,
        on_message: Callable[[Message], None],
        name: str,
        *,
        advertise_host: str | None = None,
        auth: ClusterAuth | None = None,
        context: ZmqContext | None = None,
    ) -> None:
        """`codec` is used only by the inbox thread afterwards. `advertise_host` goes into
        `endpoint` when `host` is a wildcard such as 0.0.0.0. With `auth`, only members
        of the cluster can connect (`messenger.auth`). Raises `BindError`."""
        super().__init__(
            host, 0, context, max_message_bytes=MAX_FRAME_BYTES, rcv_hwm=RCV_HWM, auth=auth
        )
        self._name = name
        self._codec = codec
        self._on_message = on_message
        shown = advertise_host or host
        self._endpoint = (
            f"tcp://[{shown}]:{self._port}" if ":" in shown else f"tcp://{shown}:{self._port}"
        )
        self._bad_frames = 0  # written by the inbox thread only
        self._handler_errors = 0  # written by the inbox thread only
        self._handler_log = LogLimiter(logger)
        self._start(f"sgl-pd-inbox-{name}")

    @property
    def endpoint(self) -> str:
        """ "tcp://host:port" to publish in this rank's registration."""
        return self._endpoint

    @property
    def bad_frames(self) -> int:
        """Frames dropped because they did not decode (wrong peer, version, model, damage)."""
        return self._bad_frames

    @property
    def handler_errors(self) -> int:
        """Messages whose handler raised."""
        return self._handler_errors

    # -- inbox thread -----------------------------------------------------------------

    def _run(self, sock: ZmqSocket) -> None:
        try:
            while not self._stop.is_set():
                if not self._wait_input(sock):
                    continue
                # Drain what is queued, but look at the stop event between bursts.
                for _ in range(1000):
                    try:
                        parts = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    self._deliver(parts)
        except zmq.ZMQError:
            logger.exception("inbox %s: socket failed; no more messages will arrive", self._name)
        finally:
            self._close_sockets(sock)

    def _deliver(self, parts: list[zmq.Frame]) -> None:
        # ROUTER prepends the sender's identity; a Link sends exactly one frame.
        if len(parts) != 2:
            self._bad_frame(parts[-1], f"{len(parts) - 1} frames in one message, expected 1")
            return
        try:
            msg = self._codec.decode(parts[1].buffer)
        except WireError as e:
            self._bad_frame(parts[1], str(e))
            return
        except Exception as e:  # a decoder bug must not end the inbox thread
            self._bad_frame(parts[1], f"undecodable: {e!r}")
            return
        try:
            self._on_message(msg)
        except Exception:
            self._handler_errors += 1
            kind = type(msg).__name__
            self._handler_log.log(
                logging.ERROR,
                kind,
                "inbox %s: handler failed on %s (%d so far)",
                self._name,
                kind,
                self._handler_errors,
                exc_info=True,
            )

    def _bad_frame(self, frame: zmq.Frame, why: str) -> None:
        self._bad_frames += 1
        n = self._bad_frames
        if n <= _LOUD_BAD_FRAMES or n % _QUIET_EVERY == 0:
            logger.warning(
                "inbox %s: dropped a frame from %s (%d so far): %s",
                self._name,
                _peer_address(frame),
                n,
                peer_text(why),
            )
