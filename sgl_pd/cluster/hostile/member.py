"""Phase b: a hostile member, holding the secret, so its frames reach the handlers: drawn
frames (`bodies`), a heartbeat flood naming thousands of endpoints, and frames over the
size limits.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

from sgl_pd.cluster.hostile.bodies import Campaign, hostile_frames
from sgl_pd.cluster.hostile.strangers import Tally
from sgl_pd.cluster.hostile.targets import Targets, frame, target_hash
from sgl_pd.core.wire import (
    MAX_FRAME_BYTES,
    REGISTRY_LAYOUT_HASH,
    ErrorMsg,
    FrameCodec,
    Heartbeat,
)
from sgl_pd.errors import SglPdError
from sgl_pd.messenger.registry import MAX_REGISTRY_FRAME_BYTES

MEMBER_BATCH = 4  # frames drawn per hypothesis example
SEND_TIMEOUT_MS = 5000  # a member's send waits this long for queue space
HEARTBEAT_ENDPOINTS = 3000  # distinct senders named by the heartbeat flood


class MemberSockets:
    """One authenticated DEALER per listener. Inboxes answer nothing on it; the
    registry answers every frame, and those answers are read and counted by type."""

    def __init__(self, targets: Targets) -> None:
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._socks: dict[str, zmq.Socket[bytes]] = {}
        for name, endpoint in targets.endpoints().items():
            sock = self._ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 2000)  # the last frames still go out on close
            sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
            targets.auth.make_client(sock)
            sock.connect(endpoint)
            self._socks[name] = sock
        self._codec = FrameCodec(REGISTRY_LAYOUT_HASH)
        self.registry_answers: Counter[str] = Counter()
        self.dropped = 0

    def send(self, name: str, data: bytes) -> None:
        try:
            self._socks[name].send(data)
        except zmq.Again:
            self.dropped += 1  # the listener did not read for SEND_TIMEOUT_MS
        if name == "registry":
            self.read_answers()

    def read_answers(self, wait_ms: int = 0) -> None:
        sock = self._socks["registry"]
        while sock.poll(wait_ms, zmq.POLLIN):
            try:
                reply = self._codec.decode(sock.recv())
            except SglPdError as e:
                self.registry_answers[f"undecodable: {type(e).__name__}"] += 1
                continue
            code = reply.code.value if isinstance(reply, ErrorMsg) else ""
            self.registry_answers[f"{type(reply).__name__} {code}".strip()] += 1

    def close(self) -> None:
        self.read_answers(wait_ms=200)
        for sock in self._socks.values():
            sock.close()
        self._ctx.term()


def run_member(
    campaign: Campaign,
    member: MemberSockets,
    count: int,
    *,
    seed: int = 0,
    progress: Callable[[int], None] = lambda n: None,
) -> Tally:
    """Phase b's drawn part: `count` frames from hypothesis, `MEMBER_BATCH` per example."""
    tally = Tally()

    @settings(
        max_examples=max(1, count // MEMBER_BATCH),
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @hypothesis_seed(seed)
    @given(st.data())
    def send_drawn(data: st.DataObject) -> None:
        for _ in range(MEMBER_BATCH):
            name, data_frame = data.draw(hostile_frames(campaign))
            member.send(name, data_frame)
            tally.add(name, 1)
            progress(1)

    rounds = 0
    while tally.frames_sent < count and rounds < 10:  # hypothesis may stop a run early
        send_drawn()
        rounds += 1
    tally.dropped = member.dropped
    return tally


def heartbeat_flood(
    targets: Targets, member: MemberSockets, count: int, progress: Callable[[int], None]
) -> Tally:
    """Heartbeats to both inboxes naming `count` different sender endpoints each: closed
    ports, unroutable hosts, unknown names and non-TCP transports. Each inbox answers to
    every sender (bounded by its outbox's peer limit)."""
    tally = Tally()
    codec = FrameCodec(targets.layout_hash)
    for i in range(count):
        sender = (
            f"tcp://192.0.2.{1 + i % 254}:{1024 + i // 254}",  # TEST-NET-1: never routed
            f"tcp://127.0.0.1:{1 + i % 1023}",
            f"tcp://hostile-{i}.invalid:9",
            f"ipc:///nonexistent/hostile-{i}",
            f"not an endpoint {i}",
        )[i % 5]
        ping = codec.encode(Heartbeat(sender=sender, seq=i, time_s=float(i)))
        for name in ("prefill_inbox", "decode_inbox"):
            member.send(name, ping)
            tally.add(name, 1)
        progress(2)
    return tally


def send_oversized(targets: Targets) -> Tally:
    """One frame just over each listener's size limit, each on a connection of its own
    (ZMQ drops the connection as the frame's header arrives)."""
    tally = Tally()
    limits = {"registry": MAX_REGISTRY_FRAME_BYTES, "prefill_inbox": MAX_FRAME_BYTES,
              "decode_inbox": MAX_FRAME_BYTES}  # fmt: skip
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        for name, endpoint in targets.endpoints().items():
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 5000)
            targets.auth.make_client(sock)
            sock.connect(endpoint)
            body = bytes(limits[name] + 1 - 24)
            sock.send(frame(body, target_hash(name, targets)))
            sock.close()
            tally.add(name, 1)
    finally:
        ctx.term()  # waits (up to the linger) for the frames to leave
    return tally
