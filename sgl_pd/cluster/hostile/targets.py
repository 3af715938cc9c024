"""Where a running PD cluster's listeners are, and the frames and messages aimed at them:
valid headers built by hand around any body, and one valid message of every type.
"""

from __future__ import annotations

import socket
import struct
import threading
import zlib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import msgspec
import psutil
import zmq
from zmq.utils.monitor import recv_monitor_message

from sgl_pd.cluster.local import HOST, PdCluster, Server
from sgl_pd.config import read_secret_file
from sgl_pd.core.regions import Region
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.wire import (
    MAGIC,
    PROTOCOL_VERSION,
    REGISTRY_LAYOUT_HASH,
    Abort,
    AbortAck,
    AbortReason,
    ChunkNotice,
    ErrorCode,
    ErrorMsg,
    FrameCodec,
    Heartbeat,
    HeartbeatAck,
    Message,
    PrefillRequest,
    RegisterAck,
    RegisterShard,
    RegistryQuery,
    RegistryReply,
    Role,
    SamplingParams,
    ShardRegistration,
    SlotArea,
    TransferRequest,
    frame_layout_hash,
)
from sgl_pd.errors import SglPdError
from sgl_pd.messenger.auth import ClusterAuth
from sgl_pd.messenger.inbox import Inbox
from sgl_pd.messenger.registry import RegistryClient

SECRET_FILE = "cluster.secret"  # where `pd_cluster` writes the secret, in its log dir
ZMTP_SIGNATURE = (b"\xff", b"\x7f")  # first and tenth byte a ZMTP 3 peer sends on connect


@dataclass(frozen=True)
class Targets:
    registry: str  # "tcp://host:port"
    prefill_inbox: str
    decode_inbox: str
    prefill: ShardRegistration  # the prefill rank's own registration
    prefill_frame: bytes  # the same, as the registry serves it
    auth: ClusterAuth

    @property
    def layout_hash(self) -> int:
        return self.prefill.layout.compat_hash()

    def endpoints(self) -> dict[str, str]:
        return {
            "registry": self.registry,
            "prefill_inbox": self.prefill_inbox,
            "decode_inbox": self.decode_inbox,
        }


class Witness:
    """An inbox of ours, a member of the cluster, named as the reply address of hostile
    frames: what the servers send there is counted by type."""

    def __init__(self, auth: ClusterAuth, layout_hash: int) -> None:
        self._lock = threading.Lock()
        self._received: Counter[str] = Counter()
        self._inbox = Inbox(HOST, FrameCodec(layout_hash), self._on_message, "witness", auth=auth)

    @property
    def endpoint(self) -> str:
        return self._inbox.endpoint

    def received(self) -> int:
        with self._lock:
            return sum(self._received.values())

    def by_type(self) -> dict[str, int]:
        with self._lock:
            return dict(self._received)

    def close(self) -> None:
        self._inbox.close()

    def _on_message(self, message: Message) -> None:
        with self._lock:
            self._received[type(message).__name__] += 1


def find_targets(cluster: PdCluster, log_dir: Path, timeout_s: float) -> tuple[Targets, Witness]:
    """The three listeners of `cluster` (started by `pd_cluster` in `log_dir`), and a
    witness inbox. The prefill inbox comes from the registry, as a decoder learns it; the
    decode rank's inbox is published nowhere, so it is the listening port of the decode
    server's processes that greets like ZMQ and completes a handshake with the cluster key."""
    auth = ClusterAuth.from_secret(read_secret_file(str(log_dir / SECRET_FILE)))
    registry = f"{HOST}:{cluster.bootstrap_port}"
    with RegistryClient("hostile-campaign", auth=auth) as client:
        frames = client.query(registry, timeout_s=timeout_s)
    reg = FrameCodec(frame_layout_hash(frames[0])).decode(frames[0])
    if not isinstance(reg, ShardRegistration):
        raise SglPdError(f"the registry at {registry} served a {type(reg).__name__}")
    witness = Witness(auth, reg.layout.compat_hash())
    try:
        decode_inbox = find_inbox(cluster.decode, auth, timeout_s)
    except BaseException:
        witness.close()
        raise
    targets = Targets(f"tcp://{registry}", reg.inbox, decode_inbox, reg, frames[0], auth)
    return targets, witness


def listening_ports(pid: int) -> list[int]:
    """TCP ports on loopback or any address that `pid` and its children listen on."""
    root = psutil.Process(pid)
    ports: set[int] = set()
    for proc in [root, *root.children(recursive=True)]:
        try:
            conns = proc.net_connections(kind="tcp")
        except psutil.Error:
            continue
        ports |= {
            c.laddr.port for c in conns if c.status == psutil.CONN_LISTEN and c.laddr.ip == HOST
        }
    return sorted(ports)


def greets_like_zmq(port: int, timeout_s: float = 1.0) -> bool:
    """Sends nothing, reads what the listener says first: a ZMTP 3 peer sends its
    signature on connect, other servers (HTTP, torch's store, Mooncake) wait."""
    head = b""
    try:
        with socket.create_connection((HOST, port), timeout=timeout_s) as conn:
            while len(head) < 10 and (chunk := conn.recv(10 - len(head))):
                head += chunk
    except OSError:
        return False
    return len(head) == 10 and (head[:1], head[9:]) == ZMTP_SIGNATURE


def find_inbox(server: Server, auth: ClusterAuth, timeout_s: float) -> str:
    """The sgl_pd inbox among `server`'s listening ports (see `find_targets`): the one
    ZMQ listener that completes a CURVE handshake with the cluster's key (SGLang's own ZMQ
    sockets speak plain ZMTP)."""
    assert server.process.process is not None
    http_port = int(server.url.rsplit(":", 1)[1])
    candidates = [p for p in listening_ports(server.process.process.pid) if p != http_port]
    zmtp = [p for p in candidates if greets_like_zmq(p)]
    for port in zmtp:
        if completes_cluster_handshake(port, auth, timeout_s):
            return f"tcp://{HOST}:{port}"
    raise SglPdError(
        f"no sgl_pd inbox among the ports of {server.url}'s processes: {candidates}"
        f" (ZMQ-speaking: {zmtp})"
    )


def completes_cluster_handshake(port: int, auth: ClusterAuth, timeout_s: float) -> bool:
    """Connects as a cluster member and watches the socket's own events: a handshake that
    succeeds proves an authenticated sgl_pd listener, without sending it a message."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    auth.make_client(sock)
    monitor = sock.get_monitor_socket(
        zmq.EVENT_HANDSHAKE_SUCCEEDED
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    )
    try:
        sock.connect(f"tcp://{HOST}:{port}")
        while monitor.poll(int(timeout_s * 1000)):
            event = recv_monitor_message(monitor)["event"]
            return bool(event == zmq.EVENT_HANDSHAKE_SUCCEEDED)
        return False
    finally:
        sock.disable_monitor()
        monitor.close(linger=0)
        sock.close(linger=0)
        ctx.term()


def frame(
    body: bytes, layout_hash: int, *, version: int = PROTOCOL_VERSION, flags: int = 0
) -> bytes:
    """A frame with a valid header and checksum around any `body`, built independently of
    `FrameCodec` (which refuses to encode what the campaign sends)."""
    head = struct.pack("<4sHHQI", MAGIC, version, flags, layout_hash, len(body))
    return head + struct.pack("<I", zlib.crc32(head[4:] + body)) + body


def body_of(message: Message) -> bytes:
    return msgspec.msgpack.encode(message)


def decode_registration(
    prefill: ShardRegistration, inbox: str, num_pages: int, instance: int
) -> ShardRegistration:
    """A decode rank's registration shaped like the prefill rank's: what a transfer
    request carries."""
    return ShardRegistration(
        role=Role.DECODE,
        rank=0,
        scheme=ShardingScheme(1),
        session="127.0.0.1:1",
        inbox=inbox,
        instance=instance,
        layout=prefill.layout,
        num_pages=num_pages,
        kv_regions=prefill.kv_regions,
        layer_group_size=1,
        metadata=prefill.metadata,
        completion=SlotArea(region=Region(1 << 20, 1 << 20), slot_bytes=64, num_slots=16),
    )


def sample_messages(targets: Targets, reply_to: str, room: int = 12345) -> list[Message]:
    """One valid message of every type; every reply address is `reply_to`."""
    decoder = decode_registration(targets.prefill, reply_to, 64, instance=room)
    return [
        targets.prefill,
        decoder,
        PrefillRequest(
            request_id=room,
            token_ids=(1, 2, 3),
            sampling=SamplingParams(max_new_tokens=4),
            dst_pages=(0, 1, 2),
            decoder=ShardingScheme(1),
            decoder_sessions=("127.0.0.1:1",),
            metadata_slot=0,
            completion_slot=0,
        ),
        ChunkNotice(
            request_id=room,
            chunk_index=0,
            token_start=0,
            token_stop=3,
            page_ids=(0, 1, 2),
            is_last=True,
            prefill_instance=targets.prefill.instance,
            num_chunks=1,
        ),
        Abort(request_id=room, reason=AbortReason.CLIENT, decoder_instance=1, reply_to=reply_to),
        AbortAck(request_id=room, prefill_rank=0, prefill_instance=targets.prefill.instance),
        ErrorMsg(request_id=None, code=ErrorCode.INTERNAL, message="stranger"),
        Heartbeat(sender=reply_to, seq=1, time_s=0.0),
        HeartbeatAck(sender=reply_to, seq=1, time_s=0.0),
        RegisterShard(
            rank=0,
            tp_size=1,
            instance=targets.prefill.instance,
            registration=targets.prefill_frame,
        ),
        RegisterAck(rank=0),
        RegistryQuery(sender=reply_to),
        RegistryReply(tp_size=1, registrations=(targets.prefill_frame,)),
        TransferRequest(
            request_id=room,
            decoder=decoder,
            dst_pages=(0, 1, 2),
            metadata_slot=0,
            completion_slot=0,
        ),
    ]


def target_hash(name: str, targets: Targets) -> int:
    return REGISTRY_LAYOUT_HASH if name == "registry" else targets.layout_hash
