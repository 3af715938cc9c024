"""Is anything still listening at a peer's inbox? A SIGKILLed process's sockets are closed
by its kernel, so a connection to its old inbox port is refused at once: proof that the
process (and every write it could make) is gone. A busy or frozen process still accepts
the connection, and an unreachable host gives no answer: neither proves anything."""

from __future__ import annotations

import socket

from sgl_pd.messenger.errors import InvalidAddress


def listener_gone(endpoint: str, timeout_s: float = 0.5) -> bool:
    """True only when a TCP connection to "tcp://host:port" is refused."""
    if not endpoint.startswith("tcp://") or ":" not in endpoint[6:]:
        raise InvalidAddress(f"not a tcp endpoint: {endpoint!r}")
    host, port = endpoint[6:].rsplit(":", 1)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return False
