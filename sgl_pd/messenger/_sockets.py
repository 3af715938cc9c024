"""Small ZMQ helpers shared by the messenger modules: addresses, binding, contexts."""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Self

import zmq
from zmq.utils.monitor import recv_monitor_message

from sgl_pd.log_limits import LogLimiter
from sgl_pd.messenger.errors import AddressInUse, BindError, InvalidAddress

if TYPE_CHECKING:
    from sgl_pd.messenger.auth import ClusterAuth

# pyzmq's sockets and contexts are generic in what recv returns; ours return bytes.
ZmqSocket = zmq.Socket[bytes]
ZmqContext = zmq.Context[ZmqSocket]

POLL_S = 0.1  # seconds a socket thread waits for input before it checks its stop event
# A connection closed before its greeting (a TCP probe such as `probe.listener_gone`)
# fails with NO_DETAIL; it is no refusal worth a warning.
_HANDSHAKE_FAILURES = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
_refusals = LogLimiter(logging.getLogger(__name__))


def tcp_endpoint(addr: str) -> str:
    """ "host:port" -> "tcp://host:port", checking the port (the bootstrap address format)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 1 << 16:
        raise InvalidAddress(f"expected a 'host:port' address, got {addr!r}")
    return f"tcp://{addr}"


def bind(sock: ZmqSocket, host: str, port: int) -> int:
    """Bind `sock` to tcp://host:port (port 0: a free port the kernel picks); return the port."""
    if ":" in host:  # an IPv6 address
        sock.setsockopt(zmq.IPV6, 1)
        host = f"[{host}]"
    where = f"tcp://{host}:{port or '*'}"
    try:
        sock.bind(where)
    except zmq.ZMQError as e:
        if e.errno == zmq.EADDRINUSE:
            raise AddressInUse(
                f"cannot bind {where}: the port is taken by another process; choose another"
                " port or stop that process"
            ) from e
        raise BindError(f"cannot bind {where}: {e}; is {host} an address of this host?") from e
    last = sock.getsockopt(zmq.LAST_ENDPOINT)
    assert isinstance(last, bytes)
    return int(last.rsplit(b":", 1)[1])


class ContextOwner:
    """Uses the given context, or makes one and terminates it on `release()`.

    A context of its own lets `close()` end in a known state: `term()` returns only once the
    context's sockets are closed and its I/O thread has released their ports.
    """

    def __init__(self, context: ZmqContext | None) -> None:
        self.context: ZmqContext = context if context is not None else zmq.Context()
        self._owned = context is None

    def release(self) -> None:
        """Call only once every socket made from the context is closed (else term() waits)."""
        if self._owned and not self.context.closed:
            self.context.term()


class RouterThread:
    """A ROUTER socket bound on the constructing thread (so a bind error reaches the
    caller), then used and closed only by one named thread running `_run(sock)`, which
    must return soon after `_stop` is set and wait for input with `_wait_input`.
    Subclasses set their own state, then `_start`.

    With `auth`, the socket is a CURVE server of the cluster (`messenger.auth`) and its
    context, always its own, gets a ZAP responder that this same thread answers; refused
    handshakes are counted (`refused_handshakes`). `max_message_bytes` is enforced by ZMQ
    as a message arrives: a bigger one drops the connection before it is buffered.
    """

    def __init__(
        self,
        host: str,
        port: int,
        context: ZmqContext | None,
        *,
        max_message_bytes: int,
        rcv_hwm: int | None = None,
        auth: ClusterAuth | None = None,
    ) -> None:
        """Binds tcp://host:port (0: a free port). Raises `AddressInUse` / `BindError`."""
        if auth is not None and context is not None:
            raise ValueError("an authenticating listener owns its context (one ZAP handler each)")
        self._ctx = ContextOwner(context)
        sock = self._ctx.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, max_message_bytes)
        if rcv_hwm is not None:
            sock.setsockopt(zmq.RCVHWM, rcv_hwm)
        from sgl_pd.messenger.auth import ZapResponder  # it needs this module's types

        self._zap: ZapResponder | None = None
        self._monitor: ZmqSocket | None = None
        try:
            if auth is not None:
                self._zap = ZapResponder(self._ctx.context, auth)
                auth.make_server(sock)
                self._monitor = sock.get_monitor_socket(_HANDSHAKE_FAILURES)
            self._port = bind(sock, host, port)
        except BaseException:
            self._close_sockets(sock)
            self._ctx.release()
            raise
        self._sock = sock
        self._poller = zmq.Poller()
        for s in (sock, self._zap.socket if self._zap else None, self._monitor):
            if s is not None:
                self._poller.register(s, zmq.POLLIN)
        self._refused_handshakes = 0  # written by the thread only
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

    @property
    def refused_handshakes(self) -> int:
        """Connections refused in the CURVE handshake (no or another cluster secret)."""
        return self._refused_handshakes

    def _wait_input(self, sock: ZmqSocket) -> bool:
        """Thread only: waits up to POLL_S; answers ZAP requests and monitor events that
        arrive meanwhile; True when `sock` has a message."""
        ready = dict(self._poller.poll(int(POLL_S * 1000)))
        if self._zap is not None and self._zap.socket in ready:
            self._zap.answer()
        if self._monitor is not None and self._monitor in ready:
            self._on_monitor_event(self._monitor)
        return sock in ready

    def _on_monitor_event(self, monitor: ZmqSocket) -> None:
        try:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
        except zmq.Again:
            return
        if event["event"] & _HANDSHAKE_FAILURES:
            self._refused_handshakes += 1
            _refusals.warning(
                f"handshake:{self._port}",
                "listener on port %d refused a connection in its handshake (%d so far): the"
                " peer lacks this cluster's secret (--pd-auth-secret-file), or is not sgl_pd",
                self._port,
                self._refused_handshakes,
            )

    def _close_sockets(self, sock: ZmqSocket) -> None:
        if self._monitor is not None:
            sock.disable_monitor()
            self._monitor.close(linger=0)
        sock.close(linger=0)
        if self._zap is not None:
            self._zap.close()

    @property
    def alive(self) -> bool:
        """The thread runs (False before start, after close, or if it died)."""
        return self._thread is not None and self._thread.is_alive()

    def _start(self, thread_name: str) -> None:
        self._thread = threading.Thread(
            target=self._run, args=(self._sock,), name=thread_name, daemon=True
        )
        self._thread.start()

    def _run(self, sock: ZmqSocket) -> None:
        raise NotImplementedError

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread (it closes the socket, freeing the port) and wait; idempotent."""
        if self._closed or self._thread is None:
            return
        self._closed = True
        self._stop.set()
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            # A handler is stuck: terminating the context would wait for it forever.
            logging.getLogger(__name__).error(
                "%s: thread did not stop within %.1f s", self._thread.name, timeout_s
            )
            return
        self._ctx.release()
