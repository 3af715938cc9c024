"""Wire protocol: typed messages in checked frames.

Frame = 24-byte header, then the msgpack body of one tagged message:

    offset  size  field
    0       4     magic b"SGPD"
    4       2     PROTOCOL_VERSION (u16, little endian)
    6       2     flags (u16, must be 0)
    8       8     layout compat hash (u64, `KvLayout.compat_hash`)
    16      4     body length (u32, bytes)
    20      4     CRC-32 of bytes 4..20 and the body

Decoding checks, in order: magic, version, length, checksum, flags, layout hash - and only
then decodes the body, so version or model skew is reported as such, never as a decode
crash. Every failure is a `WireError` subclass.
"""

from __future__ import annotations

import enum
import struct
import zlib
from typing import Annotated

import msgspec

from sgl_pd.core.errors import (
    CorruptFrame,
    InvalidMessage,
    LayoutMismatch,
    MalformedMessage,
    ProtocolVersionMismatch,
    TruncatedFrame,
)
from sgl_pd.core.layout import KvLayout
from sgl_pd.core.regions import Region
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.state_components import PLANS, Named
from sgl_pd.errors import SglPdError

# 2: count words, drain acks, heartbeat echoes, self-describing requests
# 3: senders named in Abort, ErrorMsg and ChunkNotice (ownership checks), bounded requests
# 4: decoders submit prefills to a prefill server's registry (direct mode)
# 5: registry replies carry the asker's submissions the prefill server refused
# 6: decoders register a receive staging area and grant requests part of it (re-layout)
# 7: decoders name the prefix they hold (held_tokens); last notices carry the chunk count;
#    a decoder with fragmented pages asks for every link into its staging (stage_all)
# 8: control messages whose loss matters travel in `Sequenced` envelopes until `Delivered`
# 9: decoders say how many prompt tokens' KV they expect (kv_tokens); a submission
#    names its attempt (a recompute of a retracted request under its room)
# 10: decoders tell a prefill server's registry to skip a request they prefill (SkipPrefill)
# 11: state slots besides the KV pages (Mamba): ShardRegistration.state and
#     TransferRequest.state_slot
# 12: sliding-window pages as state slots: TransferRequest.state_slots (a slot per
#     window page), StateSlots.window
# 13: state in components, one per SGLang state type (ShardRegistration.state, and
#     TransferRequest.state_slots a list per component)
# 14: how TP splits each state region (StateSlots.slicing): state moves between ranks of
#     different TP sizes, each prefill rank's slice counted as one group of its count word
PROTOCOL_VERSION = 14
MAGIC = b"SGPD"
MAX_BODY_BYTES = 64 << 20  # a 1M-token prompt with its page table stays far below this
_HEADER = struct.Struct("<4sHHQII")
HEADER_BYTES = _HEADER.size  # 24
MAX_FRAME_BYTES = HEADER_BYTES + MAX_BODY_BYTES  # what a listener lets ZMQ receive

U32 = Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]
U64 = Annotated[int, msgspec.Meta(ge=0)]  # msgpack ints stop at 2**64 - 1
Rank = Annotated[int, msgspec.Meta(ge=0, lt=1 << 16)]
Positive = Annotated[int, msgspec.Meta(ge=1, lt=1 << 32)]
# state kinds (`StateSlots.kind`) whose request names its one row, at most one slot, and
# the pages of a sliding window (`core.state_components` plans each)
NAMED_ONCE = frozenset(k for k, p in PLANS.items() if p.named is Named.ROW)
NAMED_AT_MOST = {k: 1 for k, p in PLANS.items() if p.named is Named.PENDING_BLOCK}
WINDOW_KINDS = frozenset(k for k, p in PLANS.items() if p.named is Named.WINDOW_PAGES)
NAMED_RANGES = frozenset(k for k, p in PLANS.items() if p.named is Named.TAIL_RANGES)
MAX_TEXT = 256  # characters of a free-text or address field a peer may send
Text = Annotated[str, msgspec.Meta(max_length=MAX_TEXT)]
# "tcp://host:port": an inbox, where answers go. The host is an IPv4 address, a bracketed
# IPv6 address or a DNS name; nothing else (no other transport, no spaces or controls).
Endpoint = Annotated[
    str,
    msgspec.Meta(
        max_length=MAX_TEXT,
        pattern=r"^tcp://([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}$",
    ),
]
HostPort = Annotated[  # "host:port": a transfer engine session
    str,
    msgspec.Meta(
        max_length=MAX_TEXT,
        pattern=r"^([A-Za-z0-9.\-]+|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}$",
    ),
]


class Role(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"


class ErrorCode(enum.Enum):
    BAD_REQUEST = "bad_request"  # the request cannot be served as sent; do not retry
    OVERLOADED = "overloaded"  # no pages or queue space now; retry elsewhere or later
    UNKNOWN_REQUEST = "unknown_request"
    UNKNOWN_PEER = "unknown_peer"  # no registration seen for the sender
    TRANSFER_FAILED = "transfer_failed"
    INTERNAL = "internal"
    NOT_READY = "not_ready"  # prefill ranks still starting (not all registered); retry
    CONFLICT = "conflict"  # another live instance holds that identity; do not retry
    NOT_OWNER = "not_owner"  # the sender does not own the request it names


class AbortReason(enum.Enum):
    CLIENT = "client"  # the client went away or cancelled
    TIMEOUT = "timeout"
    SHUTDOWN = "shutdown"
    ERROR = "error"


def decoder_aborted(reason: AbortReason) -> str:
    """Why a prefill server stopped a request its decoder gave up on: the failure SGLang
    reports for it (and a direct-mode submission's answer carries)."""
    return f"decoder aborted: {reason.value}"


class _Message(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    pass


class SlotArea(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A registered region cut into equal per-request slots (metadata or completion words)."""

    region: Region
    slot_bytes: Positive
    num_slots: Positive

    def __post_init__(self) -> None:
        if self.slot_bytes * self.num_slots > self.region.length:
            raise InvalidMessage("slots do not fit their region")


class MetadataBuffers(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """D9 buffers: one row per request slot in each of several registered regions (first
    output token, logprobs, hidden states, ... - whatever the engine keeps per request)."""

    regions: tuple[Region, ...]
    row_bytes: tuple[Positive, ...]  # bytes of one row of each region
    rows: Positive  # request slots

    def __post_init__(self) -> None:
        if not self.regions or len(self.regions) != len(self.row_bytes):
            raise InvalidMessage("metadata buffers need one row size per region")
        if any(r.length < self.rows * n for r, n in zip(self.regions, self.row_bytes, strict=True)):
            raise InvalidMessage("metadata rows do not fit their regions")


class StateSlicing(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How TP splits one region's slot (`core.state_slices`): `outer` rows of `units`
    consecutive units of the sliced axis on this rank, the axis made of sub-blocks each
    split on its own (`groups`: their full sizes in units; () for one). `units` 0: the
    slot is the same on every rank."""

    units: U32  # units of the sliced axis in one row of a slot on this rank
    outer: Positive = 1  # rows per slot (a page's tokens in NHD order)
    groups: tuple[Positive, ...] = ()  # full units of each sub-block ([q | k | v] conv)


class StateSlots(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One component of a model's per-request state besides the paged KV (SGLang's state
    types, planned in `core.state_components`), in slots of several registered regions:
    slot i of region r is `slot_bytes[r]` bytes at `regions[r].base + i * slot_bytes[r]`.
    Prefill and decode ranks of one TP size hold the same slice of every layer's state,
    so a slot moves as one write per region. A request names, on each role, the slots of
    its state in an order that pairs them up, e.g.:

    - "mamba" (SGLang's Mamba / linear-attention pool): each layer's conv and recurrent
      state, the request's one slot;
    - "swa" (SGLang's hybrid SWA pool): the sliding-window layers' K and V, a slot per
      page of their own page space; the pages of the request's window, the last
      `window` tokens of the prompt's KV (`core.sliding_window`)."""

    kind: Annotated[str, msgspec.Meta(max_length=32)]  # SGLang's state type: "mamba", "swa"
    regions: tuple[Region, ...]
    slot_bytes: tuple[Positive, ...]  # bytes of one slot of each region
    slots: Positive  # slots every region holds
    # the state's element types as the server chose them, e.g. "conv=bfloat16,ssm=float32"
    # (SGLang reads them from its environment: two servers may differ at equal sizes)
    dtypes: Annotated[str, msgspec.Meta(max_length=64)] = ""
    window: U32 = 0  # window kinds: the sliding window, in tokens (SGLang's)
    # how TP splits each region's slot (one per region), for ranks of another TP size;
    # () when the server cannot say: then only ranks of its own TP size take its state
    slicing: tuple[StateSlicing, ...] = ()

    def __post_init__(self) -> None:
        if not self.regions or len(self.regions) != len(self.slot_bytes):
            raise InvalidMessage("state slots need one slot size per region")
        sizes = zip(self.regions, self.slot_bytes, strict=True)
        if any(r.length < self.slots * n for r, n in sizes):
            raise InvalidMessage("state slots do not fit their regions")
        if self.kind not in PLANS:
            raise InvalidMessage(f"state of unknown kind {self.kind!r}")
        if (self.kind in WINDOW_KINDS) != (self.window > 0):
            raise InvalidMessage("a sliding window goes with window pages, and only there")
        if self.slicing and len(self.slicing) != len(self.regions):
            raise InvalidMessage("state slicing needs one entry per region, or none")

    def named_wrong(self, slots: tuple[int, ...]) -> str | None:
        """Why a request cannot name `slots` of this state, or None."""
        if self.kind in NAMED_RANGES:
            return f"{self.kind} names ranges of a row, not slots: sgl_pd does not move it"
        most = NAMED_AT_MOST.get(self.kind)
        if self.kind in NAMED_ONCE and len(slots) != 1:
            return f"{len(slots)} {self.kind} state slots named, not one"
        if most is not None and len(slots) > most:
            return f"{len(slots)} {self.kind} state slots named, at most {most}"
        if len(slots) > self.slots:
            return f"{len(slots)} {self.kind} state slots named, {self.slots} in all"
        if len(set(slots)) != len(slots):
            return f"a {self.kind} state slot named twice"
        if slots and max(slots) >= self.slots:
            return f"{self.kind} state slot {max(slots)} outside the {self.slots} registered"
        if self.kind in WINDOW_KINDS and 0 in slots:  # (SGLang's padding page: no request's)
            return f"{self.kind} page 0 named: SGLang's padding page, no request's"
        return None


def state_named_wrong(
    state: tuple[StateSlots, ...], slots: tuple[tuple[int, ...], ...]
) -> str | None:
    """Why a request cannot name `slots` (one list per component of `state`), or None."""
    if len(slots) != len(state):
        return f"state slots named for {len(slots)} components, {len(state)} registered"
    return next((why for c, s in zip(state, slots, strict=True) if (why := c.named_wrong(s))), None)


class ShardRegistration(_Message, tag="register", frozen=True):
    """One shard's memory, sent once per shard when a peer connects."""

    role: Role
    rank: Rank
    scheme: ShardingScheme
    session: HostPort  # transfer engine session id, "host:port"
    inbox: Endpoint  # ZMQ endpoint of this rank's inbox, "tcp://host:port"
    instance: U64  # random per process start: a new one for the same (role, rank) = restart
    layout: KvLayout
    num_pages: U32
    kv_regions: tuple[Region, ...]  # indexed by KvLayout.region_index(layer, part)
    layer_group_size: Positive  # prefill: layers per completion group
    metadata: MetadataBuffers | None = None  # D9 buffers (the prefiller's are its source)
    completion: SlotArea | None = None  # decode: completion words (counting.WORD_BYTES)
    # D16: the decoder samples each request's first token (prefill sends all but the last
    # prompt token's KV); both sides of a pair must agree (--pd-first-token)
    decoder_samples_first: bool = True
    # decode: registered memory that receives re-laid-out KV blocks (`core.relayout`)
    staging: Region | None = None
    # prefill: once a decoder lost contact with this rank, its writes have ended (or
    # will never start) within this many ms: its hang timeout plus its transfer engine's
    # (`core.bounds`); a decoder must hold an ended request's pages at least this long
    writes_end_within_ms: U32 = 0
    # per-request state besides the KV pages, a component per SGLang state type, in its
    # order (a Mamba pool, a hybrid SWA pool's window pages, ...); none for most models
    state: tuple[StateSlots, ...] = ()

    def __post_init__(self) -> None:
        if self.rank >= self.scheme.tp_size:
            raise InvalidMessage(f"rank {self.rank} outside TP {self.scheme.tp_size}")
        if len(self.kv_regions) != self.layout.num_regions:
            raise InvalidMessage("kv_regions must hold one region per (layer, part)")
        if self.role is Role.DECODE and (self.metadata is None or self.completion is None):
            raise InvalidMessage("a decode shard registers its metadata and completion areas")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Sampling as the decoder will apply it (D16: the prefiller never samples)."""

    max_new_tokens: U32
    temperature: Annotated[float, msgspec.Meta(ge=0.0)] = 1.0
    top_p: Annotated[float, msgspec.Meta(gt=0.0, le=1.0)] = 1.0
    top_k: Positive | None = None  # None: no top-k cut
    min_p: Annotated[float, msgspec.Meta(ge=0.0, le=1.0)] = 0.0
    repetition_penalty: Annotated[float, msgspec.Meta(gt=0.0)] = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    stop_token_ids: tuple[U32, ...] = ()
    ignore_eos: bool = False
    seed: U64 | None = None
    json_schema: str | None = None
    regex: str | None = None


class PrefillRequest(_Message, tag="prefill", frozen=True):
    """Decoder -> prefiller (D3): prefill tokens[:-1] (D16) into the given pages."""

    request_id: U64  # bootstrap room; also seeds the replica-set choice
    token_ids: tuple[U32, ...]
    sampling: SamplingParams
    dst_pages: tuple[U32, ...]  # decoder page per logical page of the prompt
    decoder: ShardingScheme
    decoder_sessions: tuple[Text, ...]  # session of each decoder rank
    metadata_slot: U32
    completion_slot: U32

    def __post_init__(self) -> None:
        if len(self.token_ids) < 2:
            raise InvalidMessage("a prompt needs >= 2 tokens: the last one is decoded (D16)")
        if len(self.decoder_sessions) != self.decoder.tp_size:
            raise InvalidMessage("one decoder session per decoder rank")


class ChunkNotice(_Message, tag="chunk", frozen=True):
    """Prefiller -> decoder: chunk `chunk_index` covers tokens [token_start, token_stop).
    The last notice also says how many chunks carried KV (`num_chunks`): zero when the
    decoder held every token the prefiller computed, and only the metadata moved."""

    request_id: U64
    chunk_index: U32
    token_start: U32
    token_stop: U32
    page_ids: tuple[U32, ...]  # destination pages the chunk touches
    is_last: bool
    prefill_instance: U64  # the sending prefill rank: only a rank that was asked counts
    num_chunks: U32  # chunks that carried KV so far (all of them, in the last notice)
    # --pd-kv-checksum: per region (layer, part), the keyed sum of the KV this prefill rank
    # wrote into the decode rank over the whole request (`core.kv_checksum`); () when off
    checksums: Annotated[tuple[U64, ...], msgspec.Meta(max_length=1 << 16)] = ()

    def __post_init__(self) -> None:
        if self.token_start >= self.token_stop:
            raise InvalidMessage("empty chunk")


class Abort(_Message, tag="abort", frozen=True):
    """Decode rank -> prefill rank: stop writing this request. Obeyed only from the decode
    rank that asked for the request's pages (or, before any did, from the first to speak
    of it: the prefill rank then refuses the others' requests for it)."""

    request_id: U64
    reason: AbortReason
    decoder_instance: U64  # the sending decode rank's `ShardRegistration.instance`
    detail: Text = ""
    reply_to: Endpoint | None = None  # the inbox owed an `AbortAck` once nothing is in flight


class ErrorMsg(_Message, tag="error", frozen=True):
    request_id: U64 | None  # None: about the connection, not one request
    code: ErrorCode
    message: Annotated[str, msgspec.Meta(max_length=4 * MAX_TEXT)]
    # The prefill rank that reports it (a decoder obeys only ranks it asked); None from a
    # registry, whose answers come on the asker's own connection.
    sender_instance: U64 | None = None


class AbortAck(_Message, tag="abort_ack", frozen=True):
    """Prefill rank -> decoder rank, after an `Abort`: this rank has no write to the
    request's pages in flight and will start none (the drain-ack; the decoder may now
    return the pages to its pool)."""

    request_id: U64
    prefill_rank: Rank
    prefill_instance: U64


class Heartbeat(_Message, tag="heartbeat", frozen=True):
    """A liveness ping; the receiver answers with a `HeartbeatAck` to `sender`."""

    sender: Endpoint  # the pinging rank's inbox endpoint
    seq: U64
    time_s: float  # sender's monotonic clock, seconds


class HeartbeatAck(_Message, tag="heartbeat_ack", frozen=True):
    sender: Endpoint  # the answering rank's inbox endpoint (the one that was pinged)
    seq: U64  # the ping's sequence number
    time_s: float  # the ping's time, echoed: the pinger measures its round trip


# -- bootstrap: prefill ranks register with their server's registry, decoders query it ------
# The registry does not know the model, so its frames use REGISTRY_LAYOUT_HASH and carry each
# rank's `ShardRegistration` as an opaque frame; the decoder decodes those with its own
# layout hash, which is where a model or layout mismatch surfaces (`LayoutMismatch`).

REGISTRY_LAYOUT_HASH = 0


class RegisterShard(_Message, tag="register_shard", frozen=True):
    """Prefill rank -> registry: this rank's registration, already encoded as a frame."""

    rank: Rank
    tp_size: Positive
    instance: U64  # same as in the registration: lets the registry see a restart
    registration: bytes  # a ShardRegistration frame, encoded with the model's layout hash

    def __post_init__(self) -> None:
        if self.rank >= self.tp_size:
            raise InvalidMessage(f"rank {self.rank} outside TP {self.tp_size}")


class RegisterAck(_Message, tag="register_ack", frozen=True):
    rank: Rank


class RegistryQuery(_Message, tag="registry_query", frozen=True):
    sender: Text  # who asks, for the registry's log


class RefusedSubmission(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A submitted request the prefill server took, then could not serve (its API answered
    an error, or the request never reached it)."""

    request_id: U64
    message: Annotated[str, msgspec.Meta(max_length=4 * MAX_TEXT)]


MAX_REFUSED_PER_REPLY = 256


class RegistryReply(_Message, tag="registry_reply", frozen=True):
    """Registry -> decoder, sent only once every rank registered (else ErrorMsg NOT_READY)."""

    tp_size: Positive
    registrations: tuple[bytes, ...]  # ShardRegistration frames, indexed by rank
    # Direct mode: the asker's recent submissions this server took and then refused, so
    # the asker fails them at its next probe rather than at its transfer timeout.
    refused: Annotated[
        tuple[RefusedSubmission, ...], msgspec.Meta(max_length=MAX_REFUSED_PER_REPLY)
    ] = ()

    def __post_init__(self) -> None:
        if len(self.registrations) != self.tp_size:
            raise InvalidMessage("a registry reply carries one registration per prefill rank")


MAX_SUBMIT_BYTES = 16 << 20  # one submitted request's JSON (a 1M-token prompt as ids fits)


class SubmitPrefill(_Message, tag="submit_prefill", frozen=True):
    """Decoder front end -> a prefill server's registry (direct mode, D3): run this
    request's prefill. `request` is the generate request as SGLang's HTTP API takes it
    (prompt, sampling parameters, bootstrap room = `request_id`), the same body a router
    would send; destination pages and the decoder's sharding follow from each decode rank
    in its `TransferRequest`, as in the router flow."""

    request_id: U64  # the bootstrap room both sides use
    sender: Text  # who submits, for the prefill server's log
    request: Annotated[bytes, msgspec.Meta(max_length=MAX_SUBMIT_BYTES)]  # JSON object
    # the room's n-th hand-off: a retracted request's KV is recomputed under its room
    # (attempts 1, 2, ...); copies of one attempt are answered as its first copy was
    attempt: U32 = 0


class SkipPrefill(_Message, tag="skip_prefill", frozen=True):
    """Decoder (one rank) -> a prefill server's registry (router flow): the decoder
    prefills room `request_id` itself, so the prefill server's copy of the request - the
    router sent it one - is answered at once without a prefill. Sent until acknowledged
    (`SubmitAck`); a repeated copy changes nothing."""

    request_id: U64  # the bootstrap room
    sender: Text  # who skips, for the prefill server's log


class SubmitAck(_Message, tag="submit_ack", frozen=True):
    """Registry -> submitter: the request was handed to the prefill server's scheduler
    (or, answering `SkipPrefill`, the room is known to be skipped)."""

    request_id: U64


class TransferRequest(_Message, tag="transfer", frozen=True):
    """Decoder rank -> each prefill rank that feeds it (router flow): where to write the KV
    of request `request_id` (SGLang's bootstrap room), which the router sent to both sides."""

    request_id: U64
    decoder: ShardRegistration  # the asking rank, whole: no separate greeting to lose
    # decoder page per logical page of the prompt from `held_tokens` on: the pages of
    # the prefix it holds are not named, so no write can reach them
    dst_pages: tuple[U32, ...]
    metadata_slot: U32
    completion_slot: U32
    # where the request's receive staging starts in the decoder's staging area (absolute
    # address); None: strided destination slices are written one token slot at a time
    staging_base: U64 | None = None
    # the prompt's first tokens whose KV the decoder holds already (its prefix cache,
    # whole pages): only the KV after them is written
    held_tokens: U32 = 0
    # the decoder's pages are fragmented: every link writes into its receive staging
    # (`core.relayout.fragmented`), not only those strided on the decoder
    stage_all: bool = False
    # the prompt tokens whose KV the decoder expects, held ones included: the prefill
    # must compute exactly these (`backend.first_token`), or the request fails at once
    # rather than decode from the wrong token; None: the decoder did not say
    kv_tokens: U32 | None = None
    # the decoder's slots for the request's state besides the KV, one list per component
    # of its registration's state (a Mamba slot, the sliding window's pages, ...): the
    # prefill writes its state there with the metadata; () where the model has none
    state_slots: tuple[tuple[U32, ...], ...] = ()

    def __post_init__(self) -> None:
        decoder = self.decoder
        if self.stage_all and self.staging_base is None:
            raise InvalidMessage("a request staged whole needs a staging grant")
        if self.kv_tokens is not None and self.held_tokens > self.kv_tokens:
            raise InvalidMessage(
                f"held prefix of {self.held_tokens} tokens past the {self.kv_tokens} expected"
            )
        if self.held_tokens % decoder.layout.page_size:
            raise InvalidMessage(
                f"held prefix of {self.held_tokens} tokens is not whole pages of"
                f" {decoder.layout.page_size}"
            )
        if self.staging_base is not None:
            area = decoder.staging
            if area is None or not area.base <= self.staging_base < area.base + area.length:
                raise InvalidMessage("the staging grant is outside the decoder's staging area")
        if decoder.role is not Role.DECODE or decoder.completion is None:
            raise InvalidMessage("a transfer request carries a decode rank's registration")
        # Every index is checked against what the decode rank registered (its pool).
        if len(self.dst_pages) > decoder.num_pages:
            raise InvalidMessage(
                f"{len(self.dst_pages)} destination pages, the decoder has {decoder.num_pages}"
            )
        if self.dst_pages and max(self.dst_pages) >= decoder.num_pages:
            raise InvalidMessage(f"a destination page is outside the decoder's {decoder.num_pages}")
        if self.completion_slot >= decoder.completion.num_slots:
            raise InvalidMessage(
                f"completion slot {self.completion_slot} outside the decoder's"
                f" {decoder.completion.num_slots}"
            )
        if decoder.metadata is not None and self.metadata_slot >= decoder.metadata.rows:
            raise InvalidMessage(
                f"metadata slot {self.metadata_slot} outside the decoder's {decoder.metadata.rows}"
            )
        if (why := state_named_wrong(decoder.state, self.state_slots)) is not None:
            raise InvalidMessage(why)

    @property
    def decoder_inbox(self) -> str:
        """Where the prefiller sends chunk notices, errors and drain acks."""
        return self.decoder.inbox


# Messages whose loss would leave a request waiting for its timeout, or let writes run on
# into pages that are freed: sent in a `Sequenced` envelope until acknowledged
# (`messenger.reliable`).
Guarded = TransferRequest | ChunkNotice | Abort | AbortAck | ErrorMsg
MAX_ACKS_PER_FRAME = 1024


class Sequenced(_Message, tag="sequenced", frozen=True):
    """A guarded message, numbered by its sender: resent until the receiver answers
    `Delivered`, handed to the receiver's role once per (sender instance, seq)."""

    sender: Endpoint  # the sending rank's inbox, where `Delivered` goes
    instance: U64  # the sending process (sequence numbers count per process start)
    seq: U64
    message: Guarded


class Delivered(_Message, tag="delivered", frozen=True):
    """The receiver got these `Sequenced` messages of `instance` (sent to `receiver`)."""

    receiver: Endpoint  # the acknowledging rank's inbox: only its own deliveries count
    instance: U64
    seqs: Annotated[tuple[U64, ...], msgspec.Meta(max_length=MAX_ACKS_PER_FRAME)]


Message = (
    ShardRegistration
    | PrefillRequest
    | ChunkNotice
    | Abort
    | AbortAck
    | ErrorMsg
    | Heartbeat
    | HeartbeatAck
    | RegisterShard
    | RegisterAck
    | RegistryQuery
    | RegistryReply
    | SubmitPrefill
    | SkipPrefill
    | SubmitAck
    | TransferRequest
    | Sequenced
    | Delivered
)


def frame_layout_hash(frame: bytes | bytearray | memoryview) -> int:
    """The layout hash a frame was encoded with (read from its header, nothing checked):
    lets a party that does not know the model decode a frame with the matching codec."""
    data = memoryview(frame).cast("B")
    if len(data) < HEADER_BYTES:
        raise TruncatedFrame(f"frame of {len(data)} bytes, a header needs {HEADER_BYTES}")
    return int(_HEADER.unpack_from(data)[3])


class FrameCodec:
    """Encodes and decodes frames for one layout hash; reusable, not thread-safe."""

    def __init__(self, layout_hash: int) -> None:
        self._hash = layout_hash
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(Message)

    @property
    def layout_hash(self) -> int:
        """The hash this codec writes and expects (build one codec per thread from it)."""
        return self._hash

    def encode(self, msg: Message) -> bytes:
        body = self._encoder.encode(msg)
        if len(body) > MAX_BODY_BYTES:
            raise CorruptFrame(f"message body of {len(body)} bytes exceeds {MAX_BODY_BYTES}")
        head = _HEADER.pack(MAGIC, PROTOCOL_VERSION, 0, self._hash, len(body), 0)
        crc = zlib.crc32(body, zlib.crc32(head[4:20]))
        return head[:20] + struct.pack("<I", crc) + body

    def decode(self, frame: bytes | bytearray | memoryview) -> Message:
        data = memoryview(frame).cast("B")
        if len(data) < 6:
            raise TruncatedFrame(f"frame of {len(data)} bytes, a header needs {HEADER_BYTES}")
        if bytes(data[:4]) != MAGIC:
            raise CorruptFrame(f"bad magic {bytes(data[:4])!r}: not an sgl_pd frame")
        (version,) = struct.unpack_from("<H", data, 4)
        if version != PROTOCOL_VERSION:
            raise ProtocolVersionMismatch(
                f"peer speaks protocol {version}, this side {PROTOCOL_VERSION}:"
                " run the same sgl_pd version on prefillers and decoders"
            )
        if len(data) < HEADER_BYTES:
            raise TruncatedFrame(f"frame of {len(data)} bytes, a header needs {HEADER_BYTES}")
        _, _, flags, layout_hash, body_len, crc = _HEADER.unpack_from(data)
        if body_len > MAX_BODY_BYTES:
            raise CorruptFrame(f"body length {body_len} exceeds {MAX_BODY_BYTES}")
        if len(data) < HEADER_BYTES + body_len:
            raise TruncatedFrame(f"frame has {len(data) - HEADER_BYTES} of {body_len} body bytes")
        if len(data) > HEADER_BYTES + body_len:
            raise CorruptFrame(f"{len(data) - HEADER_BYTES - body_len} trailing bytes")
        body = data[HEADER_BYTES:]
        if zlib.crc32(body, zlib.crc32(data[4:20])) != crc:
            raise CorruptFrame("checksum mismatch: the frame was damaged in transit")
        if flags != 0:
            raise CorruptFrame(f"unknown flags {flags:#x}")
        if layout_hash != self._hash:
            raise LayoutMismatch(
                f"peer layout hash {layout_hash:#018x} != ours {self._hash:#018x}: serve the"
                " same model, page size, KV dtype and page layout on both sides"
            )
        try:
            return self._decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError, SglPdError) as e:
            raise MalformedMessage(f"invalid message body: {e}") from e
