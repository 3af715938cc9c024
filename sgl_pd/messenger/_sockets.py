"""Small ZMQ helpers shared by the messenger modules: addresses, binding, contexts."""

from __future__ import annotations

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
