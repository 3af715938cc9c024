"""Authenticated control plane over real ZMQ sockets on loopback: only holders of the
cluster secret connect, nothing is disclosed to others, replays and oversized frames
are refused, and the registry keeps each rank with the instance that registered it."""

from __future__ import annotations

import queue
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import zmq

from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.regions import Region
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.wire import (
    REGISTRY_LAYOUT_HASH,
    ErrorCode,
    ErrorMsg,
    FrameCodec,
    Heartbeat,
    Message,
    RegisterShard,
    RegistryQuery,
    Role,
    ShardRegistration,
)
from sgl_pd.messenger.auth import ClusterAuth
from sgl_pd.messenger.errors import BootstrapError, BootstrapTimeout, PeerUnreachable
from sgl_pd.messenger.inbox import Inbox
from sgl_pd.messenger.link import Link
from sgl_pd.messenger.registry import MAX_REGISTRY_FRAME_BYTES, RegistryClient, RegistryServer

HOST = "127.0.0.1"
HASH = 0x5EC
MEMBER = ClusterAuth.from_secret(b"the cluster's own secret, 32 b.")
STRANGER = ClusterAuth.from_secret(b"another cluster's secret, 32 b..")
WAIT_S = 10.0  # generous: a loaded machine may be slow to deliver
QUIET_S = 1.0  # how long nothing must arrive where nothing may

LAYOUT = KvLayout.gqa(
    num_layers=2, num_kv_heads=2, head_dim=8, page_size=1, elem_bytes=2, page_layout=PageLayout.NHD
)


def _wait_for(predicate: object, timeout_s: float = WAIT_S) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():  # type: ignore[operator]
            return True
        time.sleep(0.02)
    return False


@pytest.fixture
def inbox() -> Iterator[tuple[Inbox, queue.Queue[Message]]]:
    got: queue.Queue[Message] = queue.Queue()
    with Inbox(HOST, FrameCodec(HASH), got.put, "auth", auth=MEMBER) as box:
        yield box, got


def _send(endpoint: str, auth: ClusterAuth | None, msg: Message) -> None:
    link = Link(endpoint, FrameCodec(HASH), auth=auth, send_timeout_s=0.5)
    try:
        link.send(msg)
    except PeerUnreachable:
        pass  # no handshake, no connection: what a stranger gets
    finally:
        time.sleep(0.2)  # let ZMQ hand the frame over before the socket closes
        link.close()


PING = Heartbeat(sender="tcp://127.0.0.1:1", seq=1, time_s=0.0)


def test_only_members_reach_an_inbox(inbox: tuple[Inbox, queue.Queue[Message]]) -> None:
    box, got = inbox
    _send(box.endpoint, None, PING)
    _send(box.endpoint, STRANGER, PING)
    assert _wait_for(lambda: box.refused_handshakes >= 2)
    _send(box.endpoint, MEMBER, PING)
    assert got.get(timeout=WAIT_S) == PING
    time.sleep(QUIET_S)
    assert got.empty(), "a frame from a process without the secret was delivered"


def test_knowing_the_server_key_is_not_enough(inbox: tuple[Inbox, queue.Queue[Message]]) -> None:
    """A client that has the servers' key but its own key pair fails the ZAP check."""
    box, got = inbox
    public, secret = zmq.curve_keypair()
    impostor = ClusterAuth(secret_key=secret, public_key=public)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.CURVE_SERVERKEY, MEMBER.public_key)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, impostor.public_key)
    sock.setsockopt(zmq.CURVE_SECRETKEY, impostor.secret_key)
    try:
        sock.connect(box.endpoint)
        sock.send(FrameCodec(HASH).encode(PING))
        assert _wait_for(lambda: box.refused_handshakes >= 1)
        time.sleep(QUIET_S)
        assert got.empty()
    finally:
        sock.close(linger=0)
        ctx.term()


class _Recorder:
    """A TCP relay between a client and a server that keeps what the client sent."""

    def __init__(self, target_port: int) -> None:
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._target = target_port
        self.sent = bytearray()
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        client, _ = self._listener.accept()
        server = socket.create_connection((HOST, self._target))
        threading.Thread(target=self._pump, args=(server, client, False), daemon=True).start()
        self._pump(client, server, True)

    def _pump(self, src: socket.socket, dst: socket.socket, record: bool) -> None:
        try:
            while data := src.recv(65536):
                if record:
                    self.sent += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            dst.close()

    def close(self) -> None:
        self._listener.close()


def test_a_recorded_connection_replayed_delivers_nothing(
    inbox: tuple[Inbox, queue.Queue[Message]],
) -> None:
    box, got = inbox
    port = int(box.endpoint.rsplit(":", 1)[1])
    relay = _Recorder(port)
    try:
        _send(f"tcp://{HOST}:{relay.port}", MEMBER, PING)
        assert got.get(timeout=WAIT_S) == PING
        recorded = bytes(relay.sent)
        assert len(recorded) > 100  # greeting, handshake and the frame
    finally:
        relay.close()
    refused = box.refused_handshakes
    with socket.create_connection((HOST, port)) as raw:
        raw.sendall(recorded)
        time.sleep(QUIET_S)
    assert got.empty(), "a replayed connection delivered its frame again"
    assert _wait_for(lambda: box.refused_handshakes > refused)


# -- the registry ---------------------------------------------------------------------


def _registration(rank: int, tp: int, instance: int, inbox: str) -> bytes:
    reg = ShardRegistration(
        role=Role.PREFILL,
        rank=rank,
        scheme=ShardingScheme(tp),
        session="127.0.0.1:1",
        inbox=inbox,
        instance=instance,
        layout=LAYOUT,
        num_pages=16,
        kv_regions=tuple(Region(4096 * (i + 1), 4096) for i in range(LAYOUT.num_regions)),
        layer_group_size=1,
    )
    return FrameCodec(LAYOUT.compat_hash()).encode(reg)


def _register_shard(
    rank: int, tp: int, instance: int, inbox: str = "tcp://10.0.0.1:9"
) -> RegisterShard:
    return RegisterShard(
        rank=rank,
        tp_size=tp,
        instance=instance,
        registration=_registration(rank, tp, instance, inbox),
    )


class _Gone:
    """Injected `is_gone`: which inboxes count as closed (a dead process)."""

    def __init__(self) -> None:
        self.closed: set[str] = set()

    def __call__(self, inbox: str) -> bool:
        return inbox in self.closed


@pytest.fixture
def registry() -> Iterator[tuple[RegistryServer, _Gone]]:
    gone = _Gone()
    with RegistryServer(HOST, 0, auth=MEMBER, is_gone=gone) as server:
        yield server, gone


def _client(auth: ClusterAuth | None) -> RegistryClient:
    return RegistryClient("test", auth=auth, attempt_timeout_s=0.5)


def test_the_registry_answers_members_only(registry: tuple[RegistryServer, _Gone]) -> None:
    server, _ = registry
    with _client(MEMBER) as member:
        member.register(server.address, _register_shard(0, 1, 11), timeout_s=WAIT_S)
        assert len(member.query(server.address, timeout_s=WAIT_S)) == 1
    for auth in (None, STRANGER):
        with _client(auth) as stranger:
            with pytest.raises(BootstrapTimeout, match="same cluster secret"):
                stranger.query(server.address, timeout_s=1.0)
            with pytest.raises(BootstrapTimeout):
                stranger.register(server.address, _register_shard(0, 1, 99), timeout_s=1.0)
    assert server.refused_handshakes >= 2
    # the strangers' registration did not replace the member's
    with _client(MEMBER) as member:
        (frame,) = member.query(server.address, timeout_s=WAIT_S)
        reg = FrameCodec(LAYOUT.compat_hash()).decode(frame)
        assert isinstance(reg, ShardRegistration) and reg.instance == 11


def test_a_plain_socket_learns_nothing_from_the_registry(
    registry: tuple[RegistryServer, _Gone],
) -> None:
    server, _ = registry
    with _client(MEMBER) as member:
        member.register(server.address, _register_shard(0, 1, 11), timeout_s=WAIT_S)
    with socket.create_connection((HOST, server.port)) as raw:
        raw.settimeout(QUIET_S)
        query = FrameCodec(REGISTRY_LAYOUT_HASH).encode(RegistryQuery(sender="x"))
        # a ZMTP 3.0 NULL greeting followed by the frame, as an unauthenticated ZMQ would
        greeting = b"\xff" + b"\0" * 8 + b"\x7f\x03\x00NULL" + b"\0" * 16 + b"\x00" + b"\0" * 31
        received = b""
        try:
            raw.sendall(greeting + b"\x00" + bytes([len(query)]) + query)
            while chunk := raw.recv(65536):
                received += chunk
        except (TimeoutError, ConnectionResetError):
            pass
    assert b"tcp://10.0.0.1" not in received and b"127.0.0.1:1" not in received


def test_a_rank_stays_with_its_instance_until_that_one_is_gone(
    registry: tuple[RegistryServer, _Gone],
) -> None:
    server, gone = registry
    with _client(MEMBER) as member:
        member.register(server.address, _register_shard(0, 2, 11, "tcp://h:1"), timeout_s=WAIT_S)
        member.register(server.address, _register_shard(1, 2, 12, "tcp://h:2"), timeout_s=WAIT_S)
        member.register(server.address, _register_shard(0, 2, 11, "tcp://h:1"), timeout_s=WAIT_S)
        with pytest.raises(BootstrapError, match="conflict"):
            member.register(server.address, _register_shard(0, 2, 21), timeout_s=WAIT_S)
        with pytest.raises(BootstrapError, match="conflict"):  # another TP size
            member.register(server.address, _register_shard(0, 1, 31), timeout_s=WAIT_S)
        assert len(member.query(server.address, timeout_s=WAIT_S)) == 2
        gone.closed.add("tcp://h:1")  # rank 0's process died: its restart takes over
        member.register(server.address, _register_shard(0, 2, 21), timeout_s=WAIT_S)
        frames = member.query(server.address, timeout_s=WAIT_S)
        instances = [FrameCodec(LAYOUT.compat_hash()).decode(f).instance for f in frames]  # type: ignore[union-attr]
        assert instances == [21, 12]


def test_a_registration_must_be_what_it_claims(registry: tuple[RegistryServer, _Gone]) -> None:
    server, _ = registry
    lying = RegisterShard(
        rank=0, tp_size=2, instance=11, registration=_registration(1, 2, 11, "tcp://h:1")
    )
    garbage = RegisterShard(rank=0, tp_size=1, instance=11, registration=b"\x00" * 64)
    with _client(MEMBER) as member:
        for bad in (lying, garbage):
            with pytest.raises(BootstrapError, match="bad_request"):
                member.register(server.address, bad, timeout_s=WAIT_S)
        member.register(server.address, _register_shard(0, 1, 11), timeout_s=WAIT_S)
    assert server.alive


def test_an_oversized_frame_is_never_buffered(registry: tuple[RegistryServer, _Gone]) -> None:
    """ZMQ drops the connection of a frame over the registry's limit as its header
    arrives; the registry never sees it and goes on answering."""
    server, _ = registry
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    MEMBER.make_client(sock)
    try:
        sock.connect(f"tcp://{server.address}")
        sock.send(b"\x00" * (2 * MAX_REGISTRY_FRAME_BYTES))
        assert not sock.poll(int(QUIET_S * 1000)), "the registry answered an oversized frame"
    finally:
        sock.close(linger=0)
        ctx.term()
    assert server.bad_frames == 0  # it never reached the registry thread
    with _client(MEMBER) as member:
        member.register(server.address, _register_shard(0, 1, 11), timeout_s=WAIT_S)


def test_errors_from_the_registry_name_no_internals(registry: tuple[RegistryServer, _Gone]) -> None:
    """A refusal is an ErrorMsg with a code; the registry thread survives any body."""
    server, _ = registry
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    MEMBER.make_client(sock)
    codec = FrameCodec(REGISTRY_LAYOUT_HASH)
    try:
        sock.connect(f"tcp://{server.address}")
        for junk in (b"", b"SGPD", b"\xff" * 100, codec.encode(PING)):
            sock.send(junk)
            assert sock.poll(int(WAIT_S * 1000))
            reply = codec.decode(sock.recv())
            assert isinstance(reply, ErrorMsg) and reply.code is ErrorCode.BAD_REQUEST
    finally:
        sock.close(linger=0)
        ctx.term()
    assert server.alive


def test_registrations_never_outgrow_one_reply(
    registry: tuple[RegistryServer, _Gone], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The registry refuses a registration that would make its answer to a query too big
    for one frame, instead of failing every query afterwards."""
    from sgl_pd.messenger import registry as registry_module

    server, _ = registry
    one = len(_register_shard(0, 4, 11).registration)
    monkeypatch.setattr(registry_module, "MAX_REPLY_REGISTRATIONS_BYTES", 2 * one + 10)
    with _client(MEMBER) as member:
        member.register(server.address, _register_shard(0, 4, 11, "tcp://h:1"), timeout_s=WAIT_S)
        member.register(server.address, _register_shard(1, 4, 12, "tcp://h:2"), timeout_s=WAIT_S)
        with pytest.raises(BootstrapError, match=r"bad_request.*total"):
            member.register(server.address, _register_shard(2, 4, 13), timeout_s=WAIT_S)
        with pytest.raises(BootstrapTimeout, match="not ready"):  # 2 of 4 ranks, still answering
            member.query(server.address, timeout_s=1.0)
    assert server.alive
