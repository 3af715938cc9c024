"""What the member phase draws from (`Campaign`) and the hypothesis strategies that draw
its frames: well-framed messages with hostile bodies, or damaged headers around valid ones.
"""

from __future__ import annotations

import functools
import struct
import threading
from dataclasses import dataclass

import msgspec
from hypothesis import strategies as st

from sgl_pd.cluster.hostile.targets import (
    Targets,
    body_of,
    decode_registration,
    frame,
    sample_messages,
    target_hash,
)
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.wire import (
    MAX_TEXT,
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
    RegisterShard,
    RegistryQuery,
    TransferRequest,
)
from sgl_pd.messenger.registry import MAX_REGISTRY_FRAME_BYTES

INJECTED_LINE = "FORGED-LOG-LINE"  # starts a line of a server log only if escaping failed


class RealRooms:
    """Request ids of the real requests sent during the campaign: under way, and done
    (forged aborts and transfer requests name only done ones: the first decoder to speak
    of a request owns it, so a forgery that outran the real decoder would win, by design)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._live: set[int] = set()
        self._done: list[int] = []

    def start(self, room: int) -> None:
        with self._lock:
            self._live.add(room)

    def finish(self, room: int) -> None:
        with self._lock:
            self._live.discard(room)
            self._done.append(room)

    def snapshot(self) -> tuple[list[int], list[int]]:
        with self._lock:
            return sorted(self._live), list(self._done)


@dataclass(frozen=True)
class Campaign:
    """What the member phase draws from."""

    targets: Targets
    witness: str  # the witness inbox's endpoint
    rooms: RealRooms
    samples: tuple[Message, ...] = ()  # one valid message of each type

    @classmethod
    def create(cls, targets: Targets, witness: str, rooms: RealRooms) -> Campaign:
        return cls(targets, witness, rooms, tuple(sample_messages(targets, witness)))


u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
_NASTY = ("\n", "\r\n", "\x1b[2J", "\x00", "\u202e", "%s", "%(x)s", "{0}", "'", '"', "\\", "é")
_INBOX_KINDS = (
    "abort", "error", "chunk", "abort_ack", "transfer", "transfer_out_of_range",
    "heartbeat", "heartbeat_ack", "other", "random_body", "bad_fields", "bad_header",
)  # fmt: skip
_REGISTRY_KINDS = ("register", "query", "random_body", "bad_fields", "bad_header")
_TAGS = (
    "register", "prefill", "chunk", "abort", "abort_ack", "error", "heartbeat",
    "heartbeat_ack", "register_shard", "register_ack", "registry_query", "registry_reply",
    "transfer", "nonsense",
)  # fmt: skip


@functools.cache  # strategies are built once: building them costs more than drawing
def texts(max_len: int = MAX_TEXT) -> st.SearchStrategy[str]:
    """Short text, escape-filled text (that tries to start a log line of its own),
    and text far over the limit."""
    nasty = st.lists(st.sampled_from(_NASTY), max_size=24).map(
        lambda parts: "".join(parts) + f"\n{INJECTED_LINE} " + "".join(parts)
    )
    giant = st.integers(max_len + 1, 70_000).map(lambda n: "X" * n)
    return st.one_of(st.text(max_size=24), nasty.map(lambda s: s[:max_len]), nasty, giant)


@functools.cache
def endpoints(c: Campaign) -> st.SearchStrategy[str]:
    """Reply addresses: ours, the cluster's own listeners, closed and unroutable ports."""
    t = c.targets
    return st.one_of(
        st.sampled_from([c.witness, t.prefill_inbox, t.decode_inbox, t.registry]),
        st.integers(1, 1023).map(lambda p: f"tcp://127.0.0.1:{p}"),
        st.integers(1, 254).map(lambda h: f"tcp://192.0.2.{h}:9"),  # TEST-NET-1: no route
        texts(),
    )


@st.composite
def room_ids(draw: st.DrawFn, c: Campaign, live_too: bool) -> int:
    """A random id, an extreme one, or the id of a real request (done, or under way when
    `live_too`). The same draws whatever requests exist: hypothesis replays draws and
    needs them to depend on nothing outside."""
    kind, value = draw(st.integers(0, 3)), draw(u64)
    live, done = c.rooms.snapshot()
    pool = {1: [0, 1, 2**63 - 1, 2**64 - 1], 2: done, 3: live if live_too else []}.get(kind)
    return pool[value % len(pool)] if pool else value


def _transfer_fields(draw: st.DrawFn, c: Campaign) -> tuple[dict[str, object], int]:
    num_pages = draw(st.integers(1, 64))
    decoder = decode_registration(c.targets.prefill, draw(endpoints(c)), num_pages, draw(u64))
    request = TransferRequest(
        request_id=draw(room_ids(c, live_too=False)),
        decoder=decoder,
        dst_pages=tuple(draw(st.lists(st.integers(0, num_pages - 1), max_size=num_pages))),
        metadata_slot=0,
        completion_slot=draw(st.integers(0, 15)),
    )
    return msgspec.to_builtins(request), num_pages


@st.composite
def inbox_body(draw: st.DrawFn, c: Campaign, kind: str) -> bytes:
    """A msgpack body of the given kind, meant for an inbox."""
    instance = draw(u64)  # a forger does not know who was asked
    if kind == "abort":
        return body_of(Abort(
            request_id=draw(room_ids(c, live_too=False)),
            reason=draw(st.sampled_from(AbortReason)),
            decoder_instance=instance,
            detail=draw(texts()),
            reply_to=draw(endpoints(c)),
        ))  # fmt: skip
    if kind == "error":
        return body_of(ErrorMsg(
            request_id=draw(st.none() | room_ids(c, live_too=True)),
            code=draw(st.sampled_from(ErrorCode)),
            message=draw(texts(4 * MAX_TEXT)),
            sender_instance=draw(st.none() | st.just(instance)),
        ))  # fmt: skip
    if kind == "chunk":
        start = draw(st.integers(0, 2**32 - 2))
        return body_of(ChunkNotice(
            request_id=draw(room_ids(c, live_too=True)),
            chunk_index=draw(u32),
            token_start=start,
            token_stop=draw(st.integers(start + 1, 2**32 - 1)),
            page_ids=tuple(draw(st.lists(u32, max_size=16))),
            is_last=draw(st.booleans()),
            prefill_instance=instance,
            num_chunks=draw(u32),
        ))  # fmt: skip
    if kind == "abort_ack":
        return body_of(AbortAck(
            request_id=draw(room_ids(c, live_too=True)),
            prefill_rank=draw(st.integers(0, 2**16 - 1)),
            prefill_instance=instance,
        ))  # fmt: skip
    if kind == "transfer":
        return msgspec.msgpack.encode(_transfer_fields(draw, c)[0])
    if kind == "transfer_out_of_range":  # what TransferRequest's constructor refuses
        fields, num_pages = _transfer_fields(draw, c)
        decoder = fields["decoder"]
        assert isinstance(decoder, dict)
        how = draw(st.sampled_from(["page", "count", "completion", "metadata", "role"]))
        if how == "page":
            fields["dst_pages"] = [draw(st.integers(num_pages, 2**32 - 1))]
        elif how == "count":
            fields["dst_pages"] = [0] * (num_pages + draw(st.integers(1, 1000)))
        elif how == "completion":
            fields["completion_slot"] = draw(st.integers(16, 2**32 - 1))
        elif how == "metadata":
            fields["metadata_slot"] = draw(st.integers(1 << 20, 2**32 - 1))
        else:
            decoder["role"], decoder["completion"] = "prefill", None
        return msgspec.msgpack.encode(fields)
    if kind == "heartbeat":
        return body_of(
            Heartbeat(sender=draw(endpoints(c)), seq=draw(u64), time_s=draw(st.floats()))
        )
    if kind == "heartbeat_ack":
        return body_of(
            HeartbeatAck(sender=draw(endpoints(c)), seq=draw(u64), time_s=draw(st.floats()))
        )
    if kind == "other":
        return body_of(draw(st.sampled_from(c.samples)))
    return draw(any_body(c, kind))


@st.composite
def registry_body(draw: st.DrawFn, c: Campaign, kind: str) -> bytes:
    prefill = c.targets.prefill
    if kind == "query":
        return body_of(RegistryQuery(sender=draw(texts())))
    if kind != "register":
        return draw(any_body(c, kind))
    how = draw(st.sampled_from(["other_rank", "other_tp", "garbage", "oversized", "lying"]))
    tp = draw(st.integers(2, 8))
    rank = draw(st.integers(1, tp - 1)) if how == "other_rank" else 0
    instance = draw(u64)
    if how in ("other_rank", "other_tp"):
        reg = msgspec.structs.replace(
            prefill,
            rank=rank,
            scheme=ShardingScheme(tp),
            instance=instance,
            inbox=draw(endpoints(c)),
        )
        registration = FrameCodec(c.targets.layout_hash).encode(reg)
    elif how == "lying":  # a decode rank's registration in a prefill rank's slot
        lie = decode_registration(prefill, draw(endpoints(c)), 16, instance)
        registration = FrameCodec(c.targets.layout_hash).encode(lie)
    elif how == "garbage":
        registration = draw(st.binary(max_size=256))
    else:
        registration = b"\0" * (MAX_REGISTRY_FRAME_BYTES - 4096 + 1)
    return body_of(
        RegisterShard(rank=rank, tp_size=tp, instance=instance, registration=registration)
    )


@st.composite
def any_body(draw: st.DrawFn, c: Campaign, kind: str) -> bytes:
    """Bodies of no valid message: random bytes, or a tagged map of wrong fields."""
    if kind == "bad_fields":
        junk = st.one_of(
            st.none(),
            st.integers(-(2**63), 2**64 - 1),
            st.text(max_size=8),
            st.binary(max_size=8),
            st.lists(st.integers(-(2**63), 2**64 - 1), max_size=4),
            st.floats(),
        )
        fields = draw(st.dictionaries(st.text(max_size=12), junk, max_size=6))
        return msgspec.msgpack.encode({"type": draw(st.sampled_from(_TAGS)), **fields})
    return draw(st.binary(max_size=1024))


@st.composite
def hostile_frames(draw: st.DrawFn, c: Campaign) -> tuple[str, bytes]:
    """(listener name, frame): a frame with a valid header around a hostile body, or a
    damaged header around a valid one."""
    name = draw(st.sampled_from(["registry", "prefill_inbox", "prefill_inbox", "decode_inbox"]))
    for_registry = (name == "registry") != draw(st.integers(0, 9).map(lambda n: n == 0))
    kind = draw(st.sampled_from(_REGISTRY_KINDS if for_registry else _INBOX_KINDS))
    body = draw(registry_body(c, kind) if for_registry else inbox_body(c, kind))
    layout_hash = target_hash(name, c.targets)
    if kind != "bad_header":
        return name, frame(body, layout_hash)
    how = draw(st.sampled_from(["version", "flags", "hash", "crc", "length"]))
    if how == "version":
        return name, frame(body, layout_hash, version=draw(st.integers(0, 2**16 - 1)))
    if how == "flags":
        return name, frame(body, layout_hash, flags=draw(st.integers(1, 2**16 - 1)))
    if how == "hash":
        return name, frame(body, draw(u64))
    damaged = bytearray(frame(body, layout_hash))
    at = 20 if how == "crc" else 16
    damaged[at : at + 4] = struct.pack("<I", draw(u32))
    return name, bytes(damaged)
