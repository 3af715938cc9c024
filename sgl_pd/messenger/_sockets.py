"""Small ZMQ helpers shared by the messenger modules: addresses, binding, contexts."""

from __future__ import annotations

import logging
import threading
from typing import Self

import zmq

from sgl_pd.messenger.errors import AddressInUse, BindError, InvalidAddress

# pyzmq's sockets and contexts are generic in what recv returns; ours return bytes.
ZmqSocket = zmq.Socket[bytes]
ZmqContext = zmq.Context[ZmqSocket]

POLL_S = 0.1  # seconds a socket thread waits for input before it checks its stop event


def tcp_endpoint(addr: str) -> str:
    """ "host:port" -> "tcp://host:port", checking the port (the bootstrap address format)."""
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 1 << 16:
        raise InvalidAddress(f"expected a 'host:port' address, got {addr!r}")
    return f"tcp://{addr}"


def bind(sock: ZmqSocket, host: str, port: int) -> int:
    """Bind `sock` to tcp://host:port (port 0: a free port the kernel picks); return the port."""
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
    must return soon after `_stop` is set. Subclasses set their own state, then `_start`."""

    def __init__(
        self, host: str, port: int, context: ZmqContext | None, rcv_hwm: int | None = None
    ) -> None:
        """Binds tcp://host:port (0: a free port). Raises `AddressInUse` / `BindError`."""
        self._ctx = ContextOwner(context)
        sock = self._ctx.context.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        if rcv_hwm is not None:
            sock.setsockopt(zmq.RCVHWM, rcv_hwm)
        try:
            self._port = bind(sock, host, port)
        except BaseException:
            sock.close(linger=0)
            self._ctx.release()
            raise
        self._sock = sock
        self._stop = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None

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
