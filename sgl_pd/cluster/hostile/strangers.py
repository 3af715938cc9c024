"""Phase a: hostile input from processes without the cluster secret, over raw TCP (a ZMTP
greeting of any mechanism, then anything), plain ZMQ sockets and CURVE sockets keyed by
another secret. Nothing may come back.
"""

from __future__ import annotations

import random
import socket
import struct
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import zmq

from sgl_pd.cluster.hostile.targets import (
    Targets,
    Witness,
    body_of,
    frame,
    sample_messages,
    target_hash,
)
from sgl_pd.core.wire import MAGIC
from sgl_pd.messenger.auth import ClusterAuth

STRANGER = ClusterAuth.from_secret(b"a secret of no cluster of ours, 32+ bytes")
FRAMES_PER_RAW_CONNECTION = 8


def stranger_frames(
    targets: Targets, reply_to: str, name: str, count: int, rng: random.Random
) -> list[bytes]:
    """`count` frames for the listener `name`: random bytes, valid frames of every
    message type, and those truncated or with a few bits flipped."""
    valid = [
        frame(body_of(m), target_hash(name, targets)) for m in sample_messages(targets, reply_to)
    ]
    out: list[bytes] = []
    for i in range(count):
        kind = i % 4
        if kind == 0:
            out.append(rng.randbytes(rng.choice((0, 1, 23, 24, 100, 2000, 70_000))))
        elif kind == 1:
            out.append(rng.choice(valid))
        elif kind == 2:
            whole = rng.choice(valid)
            out.append(whole[: rng.randrange(len(whole))])
        else:
            flipped = bytearray(rng.choice(valid))
            for _ in range(rng.randint(1, 8)):
                flipped[rng.randrange(len(flipped))] ^= 1 << rng.randrange(8)
            out.append(bytes(flipped))
    return out


# -- strangers ---------------------------------------------------------------------------


@dataclass
class Tally:
    frames_sent: int = 0
    answers: int = 0  # what came back where nothing may come back
    dropped: int = 0  # frames a socket would not take
    per_target: Counter[str] = field(default_factory=Counter)  # frames sent per listener

    def add(self, name: str, frames: int) -> None:
        self.frames_sent += frames
        self.per_target[name] += frames


_MECHANISMS = (b"NULL", b"CURVE", b"PLAIN", b"GSSAPI")


def zmtp_greeting(mechanism: bytes) -> bytes:
    """ZMTP 3.0's 64-byte greeting, as a client (RFC 23)."""
    return b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + mechanism.ljust(20, b"\0") + b"\0" * 32


def zmtp_message(data: bytes) -> bytes:
    """One single-part ZMTP message frame around `data` (short or long form)."""
    if len(data) < 256:
        return b"\x00" + bytes([len(data)]) + data
    return b"\x02" + struct.pack(">Q", len(data)) + data


def raw_exchange(endpoint: str, payload: bytes, timeout_s: float) -> bytes:
    """Writes `payload` on a fresh TCP connection, then reads what comes back until the
    listener closes or stays quiet for `timeout_s`."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    received = bytearray()
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s) as conn:
            try:
                conn.sendall(payload)
                conn.shutdown(socket.SHUT_WR)  # EOF: libzmq stops waiting for the rest
            except OSError:
                pass  # the listener hung up first
            while chunk := conn.recv(65536):
                received += chunk
    except OSError:
        pass
    return bytes(received)


def _raw_payload(frames: Sequence[bytes], rng: random.Random) -> bytes:
    if rng.random() < 0.2:  # no greeting at all: whatever bytes
        return b"".join(frames)
    return zmtp_greeting(rng.choice(_MECHANISMS)) + b"".join(zmtp_message(f) for f in frames)


def _stranger_socket(
    ctx: zmq.Context[zmq.Socket[bytes]], kind: str, targets: Targets
) -> zmq.Socket[bytes]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)  # queue everything: no handshake ever completes
    if kind == "wrong_secret":
        STRANGER.make_client(sock)
    elif kind == "impostor":  # knows the servers' public key, holds its own key pair
        public, secret = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, targets.auth.public_key)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    return sock


def run_strangers(
    targets: Targets,
    witness: Witness,
    frames_per_target: int,
    *,
    quiet_s: float,
    seed: int = 0,
    progress: Callable[[int], None] = lambda n: None,
) -> Tally:
    """Phase a: per listener, `frames_per_target` frames from processes without the
    secret, half over raw TCP and half over ZMQ sockets (plain, another cluster's key,
    the servers' key with a key pair of its own). `answers`: whatever came back."""
    rng = random.Random(seed)
    tally = Tally()
    before = witness.received()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sockets = []
    try:
        for name, endpoint in targets.endpoints().items():
            frames = stranger_frames(targets, witness.endpoint, name, frames_per_target, rng)
            raw, rest = frames[: len(frames) // 2], frames[len(frames) // 2 :]
            batches = [
                raw[i : i + FRAMES_PER_RAW_CONNECTION]
                for i in range(0, len(raw), FRAMES_PER_RAW_CONNECTION)
            ]
            payloads = [_raw_payload(b, rng) for b in batches]
            with ThreadPoolExecutor(max_workers=8) as pool:
                for batch, got in zip(
                    batches,
                    pool.map(
                        raw_exchange,
                        [endpoint] * len(payloads),
                        payloads,
                        [quiet_s] * len(payloads),
                    ),
                    strict=True,
                ):
                    tally.answers += got.count(MAGIC)
                    tally.add(name, len(batch))
                    progress(len(batch))
            for i, kind in enumerate(("plain", "wrong_secret", "impostor")):
                sock = _stranger_socket(ctx, kind, targets)
                sockets.append(sock)
                sock.connect(endpoint)
                mine = rest[i::3]
                for f in mine:
                    try:
                        sock.send(f, zmq.NOBLOCK)
                    except zmq.Again:
                        tally.dropped += 1
                tally.add(name, len(mine))
                progress(len(mine))
        time.sleep(quiet_s)  # time for any answer to arrive
        for sock in sockets:
            while sock.poll(0, zmq.POLLIN):
                sock.recv()
                tally.answers += 1
    finally:
        for sock in sockets:
            sock.close(linger=0)
        ctx.term()
    tally.answers += witness.received() - before
    return tally
