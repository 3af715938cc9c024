"""Wire protocol: round trips, and every malformed frame rejected with a typed error."""

from __future__ import annotations

import struct
import zlib
from typing import Any

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_pd.core.errors import (
    CorruptFrame,
    InvalidMessage,
    LayoutMismatch,
    MalformedMessage,
    ProtocolVersionMismatch,
    TruncatedFrame,
    WireError,
)
from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.regions import Region
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.wire import (
    HEADER_BYTES,
    MAGIC,
    MAX_TEXT,
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
    MetadataBuffers,
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
)

LAYOUT = KvLayout.gqa(
    num_layers=3,
    num_kv_heads=8,
    head_dim=128,
    page_size=64,
    elem_bytes=2,
    page_layout=PageLayout.HND,
)
CODEC = FrameCodec(LAYOUT.compat_hash())

u32 = st.integers(0, 2**32 - 1)
u64 = st.integers(0, 2**64 - 1)
text = st.text(max_size=20)
hosts = st.from_regex(r"[a-z0-9.\-]{1,20}", fullmatch=True) | st.ip_addresses(v=4).map(str)
ports = st.integers(1, 65535).map(str)
sessions = st.builds(lambda h, p: f"{h}:{p}", hosts, ports)
endpoints = sessions.map(lambda s: f"tcp://{s}")
floats = st.floats(allow_nan=False, allow_infinity=False)


@st.composite
def registrations(draw: st.DrawFn, role: Role | None = None) -> ShardRegistration:
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    role = role or draw(st.sampled_from(Role))
    regions = tuple(
        Region(draw(st.integers(0, 2**48)), draw(st.integers(0, 2**40)))
        for _ in range(LAYOUT.num_regions)
    )
    area = SlotArea(region=Region(4096, 1 << 20), slot_bytes=256, num_slots=4096)
    meta = MetadataBuffers(regions=(Region(1 << 24, 4096),), row_bytes=(64,), rows=64)
    return ShardRegistration(
        role=role,
        rank=draw(st.integers(0, tp - 1)),
        scheme=ShardingScheme(tp),
        session=draw(sessions),
        inbox=draw(endpoints),
        instance=draw(u64),
        layout=LAYOUT,
        num_pages=draw(u32),
        kv_regions=regions,
        layer_group_size=draw(st.integers(1, 8)),
        metadata=meta if role is Role.DECODE else None,
        completion=area if role is Role.DECODE else None,
    )


sampling = st.builds(
    SamplingParams,
    max_new_tokens=u32,
    temperature=st.floats(0, 10),
    top_p=st.floats(0.01, 1.0),
    top_k=st.none() | st.integers(1, 1000),
    stop_token_ids=st.lists(u32, max_size=4).map(tuple),
    seed=st.none() | u64,
    json_schema=st.none() | text,
)


@st.composite
def prefill_requests(draw: st.DrawFn) -> PrefillRequest:
    tp = draw(st.sampled_from([1, 2, 4, 8]))
    return PrefillRequest(
        request_id=draw(u64),
        token_ids=tuple(draw(st.lists(u32, min_size=2, max_size=50))),
        sampling=draw(sampling),
        dst_pages=tuple(draw(st.lists(u32, max_size=20))),
        decoder=ShardingScheme(tp),
        decoder_sessions=tuple(f"10.0.0.{i}:170{i}" for i in range(tp)),
        metadata_slot=draw(u32),
        completion_slot=draw(u32),
    )


@st.composite
def chunk_notices(draw: st.DrawFn) -> ChunkNotice:
    start = draw(st.integers(0, 2**31))
    return ChunkNotice(
        request_id=draw(u64),
        chunk_index=draw(u32),
        token_start=start,
        token_stop=start + draw(st.integers(1, 2**20)),
        page_ids=tuple(draw(st.lists(u32, max_size=10))),
        is_last=draw(st.booleans()),
        prefill_instance=draw(u64),
        num_chunks=draw(u32),
    )


@st.composite
def register_shards(draw: st.DrawFn) -> RegisterShard:
    tp = draw(st.integers(1, 64))
    return RegisterShard(
        rank=draw(st.integers(0, tp - 1)),
        tp_size=tp,
        instance=draw(u64),
        registration=draw(st.binary(max_size=100)),
    )


@st.composite
def registry_replies(draw: st.DrawFn) -> RegistryReply:
    frames = draw(st.lists(st.binary(max_size=50), min_size=1, max_size=8))
    return RegistryReply(tp_size=len(frames), registrations=tuple(frames))


@st.composite
def transfer_requests(draw: st.DrawFn) -> TransferRequest:
    """Requests whose every index lies inside the decoder's registration."""
    decoder = draw(registrations(Role.DECODE).filter(lambda r: r.num_pages > 0))
    assert decoder.metadata is not None and decoder.completion is not None
    page = st.integers(0, decoder.num_pages - 1)
    return TransferRequest(
        request_id=draw(u64),
        decoder=decoder,
        dst_pages=tuple(draw(st.lists(page, max_size=min(20, decoder.num_pages)))),
        metadata_slot=draw(st.integers(0, decoder.metadata.rows - 1)),
        completion_slot=draw(st.integers(0, decoder.completion.num_slots - 1)),
    )


messages: st.SearchStrategy[Message] = st.one_of(
    registrations(),
    prefill_requests(),
    chunk_notices(),
    st.builds(
        Abort,
        request_id=u64,
        reason=st.sampled_from(AbortReason),
        decoder_instance=u64,
        detail=text,
        reply_to=st.none() | endpoints,
    ),
    st.builds(
        ErrorMsg,
        request_id=st.none() | u64,
        code=st.sampled_from(ErrorCode),
        message=text,
        sender_instance=st.none() | u64,
    ),
    st.builds(Heartbeat, sender=endpoints, seq=u64, time_s=floats),
    st.builds(HeartbeatAck, sender=endpoints, seq=u64, time_s=floats),
    st.builds(
        AbortAck, request_id=u64, prefill_rank=st.integers(0, 2**16 - 1), prefill_instance=u64
    ),
    register_shards(),
    st.builds(RegisterAck, rank=st.integers(0, 2**16 - 1)),
    st.builds(RegistryQuery, sender=text),
    registry_replies(),
    transfer_requests(),
)


@settings(max_examples=200, deadline=None)
@given(msg=messages)
def test_round_trip(msg: Message) -> None:
    frame = CODEC.encode(msg)
    assert frame[:4] == MAGIC
    assert CODEC.decode(frame) == msg
    assert CODEC.decode(memoryview(bytearray(frame))) == msg


@settings(max_examples=60, deadline=None)
@given(msg=messages, data=st.data())
def test_every_truncation_is_typed(msg: Message, data: st.DataObject) -> None:
    frame = CODEC.encode(msg)
    cut = data.draw(st.integers(0, len(frame) - 1))
    with pytest.raises(TruncatedFrame):
        CODEC.decode(frame[:cut])


def _expected_for_flip(byte: int) -> type[WireError] | tuple[type[WireError], ...]:
    if byte < 4:
        return CorruptFrame  # magic
    if byte < 6:
        return ProtocolVersionMismatch
    if 16 <= byte < 20:
        return (TruncatedFrame, CorruptFrame)  # body length
    return CorruptFrame  # flags, hash, checksum, body: the CRC catches it


@settings(max_examples=150, deadline=None)
@given(msg=messages, data=st.data())
def test_every_bit_flip_is_typed(msg: Message, data: st.DataObject) -> None:
    frame = bytearray(CODEC.encode(msg))
    byte = data.draw(st.integers(0, len(frame) - 1))
    frame[byte] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(_expected_for_flip(byte)):
        CODEC.decode(bytes(frame))


@settings(max_examples=200, deadline=None)
@given(junk=st.binary(max_size=200), keep_header=st.booleans())
def test_random_bytes_never_crash(junk: bytes, keep_header: bool) -> None:
    data = (MAGIC + struct.pack("<H", PROTOCOL_VERSION) + junk) if keep_header else junk
    with pytest.raises(WireError):
        CODEC.decode(data)


def _frame(
    body: bytes, *, version: int = PROTOCOL_VERSION, layout_hash: int | None = None, flags: int = 0
) -> bytes:
    """An independently built frame with a valid checksum."""
    h = LAYOUT.compat_hash() if layout_hash is None else layout_hash
    head = struct.pack("<4sHHQI", MAGIC, version, flags, h, len(body))
    return head + struct.pack("<I", zlib.crc32(head[4:] + body)) + body


def test_independent_frame_matches_codec() -> None:
    msg = Abort(request_id=5, reason=AbortReason.CLIENT, decoder_instance=9)
    assert _frame(msgspec.msgpack.encode(msg)) == CODEC.encode(msg)
    assert len(CODEC.encode(msg)) - HEADER_BYTES == len(msgspec.msgpack.encode(msg))


def test_version_and_layout_are_checked_before_the_body() -> None:
    with pytest.raises(ProtocolVersionMismatch, match=f"protocol {PROTOCOL_VERSION + 1}"):
        CODEC.decode(_frame(b"\xc1 not msgpack", version=PROTOCOL_VERSION + 1))
    with pytest.raises(LayoutMismatch):
        CODEC.decode(_frame(b"\xc1 not msgpack", layout_hash=LAYOUT.compat_hash() ^ 1))
    other = FrameCodec(LAYOUT.compat_hash() + 1)
    with pytest.raises(LayoutMismatch):
        CODEC.decode(other.encode(Heartbeat(sender="tcp://p0:1", seq=1, time_s=0.5)))
    with pytest.raises(CorruptFrame, match="flags"):
        CODEC.decode(_frame(b"", flags=1))


def test_trailing_and_oversize() -> None:
    frame = CODEC.encode(Heartbeat(sender="tcp://p0:1", seq=1, time_s=0.5))
    with pytest.raises(CorruptFrame, match="trailing"):
        CODEC.decode(frame + b"\0")
    huge = bytearray(frame)
    huge[16:20] = struct.pack("<I", 2**32 - 1)
    with pytest.raises(CorruptFrame, match="exceeds"):
        CODEC.decode(bytes(huge))


def _raw(tag: str, **fields: object) -> bytes:
    return msgspec.msgpack.encode({"type": tag, **fields})


GOOD_CHUNK = dict(
    request_id=1, chunk_index=0, token_start=0, token_stop=4, page_ids=[1], is_last=True
)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xc1",  # never-used msgpack byte
        msgspec.msgpack.encode([1, 2, 3]),
        _raw("nope", request_id=1),  # unknown tag
        _raw("abort", request_id=-1, reason="client"),  # negative id
        _raw("abort", request_id=1, reason="bored"),  # unknown enum value
        _raw("abort", request_id=1, reason="client", extra=1),  # unknown field
        _raw("chunk", **{**GOOD_CHUNK, "token_stop": 0}),  # empty chunk
        _raw("chunk", **{k: v for k, v in GOOD_CHUNK.items() if k != "is_last"}),
        _raw("heartbeat", sender="x", seq=-1, time_s=0.0),  # negative seq
        _raw(
            "register",
            role="prefill",
            rank=0,
            scheme={"tp_size": 0},
            session="s:1",
            inbox="tcp://127.0.0.1:1",
            instance=7,
            layout=msgspec.to_builtins(LAYOUT),
            num_pages=1,
            kv_regions=[],
            layer_group_size=1,
        ),  # tp_size 0: the dataclass's own check
        _raw(
            "register",
            role="prefill",
            rank=0,
            scheme={"tp_size": 1},
            session="s:1",
            inbox="tcp://127.0.0.1:1",
            instance=7,
            layout={**msgspec.to_builtins(LAYOUT), "page_size": 0},
            num_pages=1,
            kv_regions=[],
            layer_group_size=1,
        ),  # a layout that KvLayout rejects
        _raw(
            "register",
            role="decode",
            rank=0,
            scheme={"tp_size": 1},
            session="s:1",
            inbox="tcp://127.0.0.1:1",
            instance=7,
            layout=msgspec.to_builtins(LAYOUT),
            num_pages=1,
            kv_regions=[{"base": 0, "length": 1}] * LAYOUT.num_regions,
            layer_group_size=1,
        ),  # a decoder without its metadata / completion areas
    ],
)
def test_malformed_bodies(body: bytes) -> None:
    with pytest.raises(MalformedMessage):
        CODEC.decode(_frame(body))


def test_inconsistent_messages_cannot_be_built() -> None:
    with pytest.raises(InvalidMessage):
        ChunkNotice(
            request_id=1,
            chunk_index=0,
            token_start=3,
            token_stop=3,
            page_ids=(),
            is_last=False,
            prefill_instance=1,
            num_chunks=0,
        )
    with pytest.raises(InvalidMessage, match="D16"):
        PrefillRequest(
            request_id=1,
            token_ids=(5,),
            sampling=SamplingParams(max_new_tokens=1),
            dst_pages=(),
            decoder=ShardingScheme(1),
            decoder_sessions=("a:1",),
            metadata_slot=0,
            completion_slot=0,
        )
    with pytest.raises(InvalidMessage):
        SlotArea(region=Region(0, 10), slot_bytes=4, num_slots=3)


def test_bootstrap_messages_check_their_counts() -> None:
    with pytest.raises(InvalidMessage):
        RegisterShard(rank=2, tp_size=2, instance=1, registration=b"")
    with pytest.raises(InvalidMessage):
        RegistryReply(tp_size=2, registrations=(b"only one",))
    with pytest.raises(MalformedMessage):
        CODEC.decode(_frame(_raw("registry_reply", tp_size=2, registrations=[b"x"])))
    with pytest.raises(MalformedMessage):
        CODEC.decode(_frame(_raw("transfer", request_id=1, decoder_rank=0)))  # fields missing


def test_registry_frames_nest_layout_checked_registrations() -> None:
    """The registry relays registrations as opaque frames under hash 0; the decoder's codec
    checks the layout hash of each one, so a model mismatch is a LayoutMismatch there."""
    meta = MetadataBuffers(regions=(Region(1 << 30, 4096),), row_bytes=(64,), rows=64)
    reg = ShardRegistration(
        role=Role.PREFILL,
        rank=0,
        scheme=ShardingScheme(1),
        session="10.0.0.1:17000",
        inbox="tcp://10.0.0.1:5555",
        instance=2**64 - 1,
        layout=LAYOUT,
        num_pages=16,
        kv_regions=tuple(Region(i << 20, 1 << 20) for i in range(LAYOUT.num_regions)),
        layer_group_size=1,
        metadata=meta,
    )
    registry = FrameCodec(REGISTRY_LAYOUT_HASH)
    reply = registry.decode(
        registry.encode(RegistryReply(tp_size=1, registrations=(CODEC.encode(reg),)))
    )
    assert isinstance(reply, RegistryReply)
    assert CODEC.decode(reply.registrations[0]) == reg
    with pytest.raises(LayoutMismatch):
        FrameCodec(LAYOUT.compat_hash() ^ 1).decode(reply.registrations[0])
    with pytest.raises(LayoutMismatch):
        CODEC.decode(registry.encode(RegistryQuery(sender="d0")))
    assert registry.layout_hash == REGISTRY_LAYOUT_HASH


@settings(max_examples=50, deadline=None)
@given(request=transfer_requests(), field=st.sampled_from(["page", "metadata", "completion"]))
def test_indices_outside_the_decoders_registration_are_refused(
    request: TransferRequest, field: str
) -> None:
    """Every index a decoder sends is checked against its own registration on decode, so
    a hostile body with a valid header comes back as a typed error, never as a write."""
    decoder = request.decoder
    assert decoder.metadata is not None and decoder.completion is not None
    fields = msgspec.structs.asdict(request)
    if field == "page":
        fields["dst_pages"] = (*request.dst_pages, decoder.num_pages)
    elif field == "metadata":
        fields["metadata_slot"] = decoder.metadata.rows
    else:
        fields["completion_slot"] = decoder.completion.num_slots
    body = msgspec.msgpack.encode({"type": "transfer", **msgspec.to_builtins(fields)})
    with pytest.raises(MalformedMessage, match=r"outside|the decoder has"):
        CODEC.decode(_frame(body))


def test_peer_text_fields_are_bounded() -> None:
    long = "x" * (MAX_TEXT + 1)
    for body in (
        {
            "type": "abort",
            "request_id": 1,
            "reason": "client",
            "decoder_instance": 1,
            "detail": long,
        },
        {"type": "heartbeat", "sender": long, "seq": 1, "time_s": 0.0},
        {"type": "registry_query", "sender": long},
    ):
        with pytest.raises(MalformedMessage, match="length"):
            CODEC.decode(_frame(msgspec.msgpack.encode(body)))


# Every message's fields at this protocol version. Peers reject unknown fields, so a
# message whose fields change needs a new version (the peer then says "run the same
# sgl_pd version" instead of dropping each frame as malformed): bump PROTOCOL_VERSION,
# then update this table.
FIELDS_AT_VERSION = (
    14,
    {
        "abort": ("request_id", "reason", "decoder_instance", "detail", "reply_to"),
        "abort_ack": ("request_id", "prefill_rank", "prefill_instance"),
        "delivered": ("receiver", "instance", "seqs"),
        "sequenced": ("sender", "instance", "seq", "message"),
        "chunk": ("request_id", "chunk_index", "token_start", "token_stop", "page_ids",
                  "is_last", "prefill_instance", "num_chunks", "checksums"),
        "error": ("request_id", "code", "message", "sender_instance"),
        "heartbeat": ("sender", "seq", "time_s"),
        "heartbeat_ack": ("sender", "seq", "time_s"),
        "prefill": ("request_id", "token_ids", "sampling", "dst_pages", "decoder",
                    "decoder_sessions", "metadata_slot", "completion_slot"),
        "register": ("role", "rank", "scheme", "session", "inbox", "instance", "layout",
                     "num_pages", "kv_regions", "layer_group_size", "metadata", "completion",
                     "decoder_samples_first", "staging", "writes_end_within_ms", "state"),
        "register_ack": ("rank",),
        "register_shard": ("rank", "tp_size", "instance", "registration"),
        "registry_query": ("sender",),
        "registry_reply": ("tp_size", "registrations", "refused"),
        "skip_prefill": ("request_id", "sender"),
        "submit_ack": ("request_id",),
        "submit_prefill": ("request_id", "sender", "request", "attempt"),
        "transfer": ("request_id", "decoder", "dst_pages", "metadata_slot", "completion_slot",
                     "staging_base", "held_tokens", "stage_all", "kv_tokens", "state_slots"),
    },
)  # fmt: skip


# the fields of the structs messages carry, at the same version
PARTS_AT_VERSION = (
    14,
    {
        "MetadataBuffers": ("regions", "row_bytes", "rows"),
        "RefusedSubmission": ("request_id", "message"),
        "SamplingParams": ("max_new_tokens", "temperature", "top_p", "top_k", "min_p",
                           "repetition_penalty", "frequency_penalty", "presence_penalty",
                           "stop_token_ids", "ignore_eos", "seed", "json_schema", "regex"),
        "SlotArea": ("region", "slot_bytes", "num_slots"),
        "StateSlicing": ("units", "outer", "groups"),
        "StateSlots": ("kind", "regions", "slot_bytes", "slots", "dtypes", "window", "slicing"),
    },
)  # fmt: skip


def _parts(message_types: tuple[type, ...]) -> dict[str, tuple[str, ...]]:
    """Every struct inside the messages (not the messages): name -> its fields."""
    import msgspec.inspect as mi

    found: dict[str, tuple[str, ...]] = {}

    def walk(info: Any) -> None:
        if isinstance(info, mi.StructType):
            if info.cls.__name__ not in found:
                found[info.cls.__name__] = tuple(f.name for f in info.fields)
                for f in info.fields:
                    walk(f.type)
        elif isinstance(info, mi.UnionType):
            for t in info.types:
                walk(t)
        elif isinstance(info, mi.DictType):
            walk(info.key_type)
            walk(info.value_type)
        else:
            for t in (getattr(info, "item_type", None), *getattr(info, "item_types", ())):
                if t is not None:
                    walk(t)

    for info in mi.multi_type_info(list(message_types)):
        walk(info)
    names = {cls.__name__ for cls in message_types}
    return {name: fields for name, fields in found.items() if name not in names}


def _schema_digest(message_types: tuple[type, ...]) -> str:
    """A digest of every message's JSON schema, field types and bounds included (their
    descriptions left out: a docstring is not the protocol)."""
    import hashlib
    import json

    _, components = msgspec.json.schema_components(message_types)

    def bare(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: bare(v) for k, v in node.items() if k not in ("description", "title")}
        if isinstance(node, list):
            return [bare(v) for v in node]
        return node

    text = json.dumps(bare(components), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


# the digest of every message's schema at this version (types changed with names kept
# are a new protocol too: an older peer would fail to decode the frame)
SCHEMA_AT_VERSION = (14, "f8eb214c12c49a7b")


def test_a_change_of_any_message_comes_with_a_new_protocol_version() -> None:
    import typing

    from sgl_pd.core import wire

    types = typing.get_args(wire.Message)
    fields = {cls.__struct_config__.tag: tuple(cls.__struct_fields__) for cls in types}
    version, pinned = FIELDS_AT_VERSION
    assert (wire.PROTOCOL_VERSION, fields) == (version, pinned), (
        "a message's fields changed: bump PROTOCOL_VERSION and update FIELDS_AT_VERSION"
    )
    version, pinned_parts = PARTS_AT_VERSION
    assert (wire.PROTOCOL_VERSION, _parts(types)) == (version, pinned_parts), (
        "a struct inside a message changed: bump PROTOCOL_VERSION and update PARTS_AT_VERSION"
    )
    assert (wire.PROTOCOL_VERSION, _schema_digest(types)) == SCHEMA_AT_VERSION, (
        "a message's types or bounds changed: bump PROTOCOL_VERSION and update SCHEMA_AT_VERSION"
    )
