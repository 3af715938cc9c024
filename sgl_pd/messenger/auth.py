"""Cluster authentication of every control-plane connection: ZMQ's CURVE, keyed by the
cluster secret.

Every server of a cluster holds the same secret (`--pd-auth-secret-file` or the
``SGLPD_AUTH_SECRET`` environment variable). From it each process derives one CURVE key
pair; listeners (inboxes, the registry) are CURVE servers with that pair, and every
connecting socket presents the same pair. What that gives, all from libzmq's CurveZMQ
(RFC 26), none of it hand-written:

- a handshake that fails unless the client knows the server's key *and* proves, in its
  INITIATE command, that it holds the client secret key; both derive from the cluster
  secret, so a process without it cannot deliver a single frame or read an answer;
- every frame after the handshake is encrypted and authenticated (Poly1305), so a frame
  cannot be altered or read on the wire;
- per-connection short-term keys and strictly increasing nonces: a recorded connection
  replayed, or a frame replayed into another connection, is refused.

The client's proof is checked by a ZAP handler (RFC 27) that each authenticating listener
answers on its own thread (`ZapResponder`): only the cluster's client key is admitted.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq
from zmq.utils import z85

from sgl_pd.config import MIN_SECRET_BYTES
from sgl_pd.log_limits import LogLimiter, peer_text

if TYPE_CHECKING:
    from sgl_pd.messenger._sockets import ZmqContext, ZmqSocket

logger = logging.getLogger(__name__)
_refusals = LogLimiter(logger)

ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks, per context (RFC 27)
_KEY_LABEL = b"sgl-pd curve key v1"


@dataclass(frozen=True)
class ClusterAuth:
    """The CURVE key pair every member of one cluster derives from the shared secret."""

    secret_key: bytes = field(repr=False)  # z85, 40 bytes
    public_key: bytes = field(repr=False)  # z85, 40 bytes; as secret as the secret itself

    @classmethod
    def from_secret(cls, secret: bytes) -> ClusterAuth:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(
                f"the cluster secret has {len(secret)} bytes, at least {MIN_SECRET_BYTES}"
                " are needed: make one with `openssl rand -hex 32`"
            )
        if not zmq.has("curve"):
            raise RuntimeError("this pyzmq's libzmq has no CURVE support: reinstall pyzmq")
        # (32,) bytes: a CURVE secret key is any 32 bytes; the hash spreads a text secret
        raw = hashlib.blake2b(_KEY_LABEL, key=hashlib.sha256(secret).digest()).digest()[:32]
        secret_z85 = z85.encode(raw)
        return cls(secret_key=secret_z85, public_key=zmq.curve_public(secret_z85))

    @property
    def fingerprint(self) -> str:
        """A short name of the key that is safe to log (two servers with different ones
        have different secrets)."""
        return hashlib.sha256(b"fingerprint:" + self.public_key).hexdigest()[:12]

    def make_server(self, sock: ZmqSocket) -> None:
        """Makes `sock` a CURVE server; call before bind. Its context needs a
        `ZapResponder` so that clients are checked, not just decrypted."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)
        # Without a ZAP handler libzmq would admit any client key: refuse instead.
        sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, b"sgl-pd")

    def make_client(self, sock: ZmqSocket) -> None:
        """Makes `sock` a CURVE client of the cluster's servers; call before connect."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.public_key)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public_key)

    def admits(self, client_key: bytes) -> bool:
        """`client_key`: the raw 32-byte long-term key a client proved it holds."""
        return hmac.compare_digest(z85.encode(client_key), self.public_key)


class ZapResponder:
    """Answers libzmq's ZAP requests for one context: admits the cluster key, nothing else.

    Owned by the thread of the listener it serves, which polls `socket` with its own and
    calls `answer()` when it is readable (no thread of its own). One per context: libzmq
    asks whatever is bound at `ZAP_ENDPOINT` of the listening socket's context.
    """

    def __init__(self, context: ZmqContext, auth: ClusterAuth) -> None:
        self._auth = auth
        self.socket: ZmqSocket = context.socket(zmq.REP)
        self.socket.setsockopt(zmq.LINGER, 0)
        self.socket.bind(ZAP_ENDPOINT)
        self.refused = 0  # clients whose key was not the cluster's

    def answer(self) -> None:
        """Reads one ZAP request (RFC 27) and replies to it; never blocks for long."""
        try:
            parts = self.socket.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            return
        # version, request id, domain, address, identity, mechanism, credentials...
        if len(parts) < 6:
            logger.warning("malformed ZAP request of %d parts ignored", len(parts))
            self.socket.send_multipart([b"1.0", b"", b"500", b"malformed", b"", b""])
            return
        version, request_id, _domain, address, _identity, mechanism = parts[:6]
        credentials = parts[6:]
        ok = mechanism == b"CURVE" and len(credentials) == 1 and self._auth.admits(credentials[0])
        if not ok:
            self.refused += 1
            _refusals.warning(
                "zap",
                "refused a connection from %s (%d so far): it does not hold this cluster's key",
                peer_text(address.decode("ascii", "replace"), 64),
                self.refused,
            )
        status, text = (b"200", b"OK") if ok else (b"400", b"not a member of this cluster")
        self.socket.send_multipart([version, request_id, status, text, b"", b""])

    def close(self) -> None:
        self.socket.close(linger=0)
