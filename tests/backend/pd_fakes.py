"""A prefill rank and decode ranks of the backend, in one process, over the in-memory
transfer engine: messages are delivered by direct calls, KV bytes are real numpy memory."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_pd.backend.decode.messenger import DecodeMessenger
from sgl_pd.backend.kv_sums import KvSums
from sgl_pd.backend.metrics import TransferMetrics
from sgl_pd.backend.pool import PoolDescription
from sgl_pd.backend.prefill.messenger import PrefillMessenger
from sgl_pd.backend.relayout_copies import PoolCopies
from sgl_pd.backend.staging_area import Staging, StagingArea
from sgl_pd.backend.tracing import RequestTracing
from sgl_pd.core.clock import ManualClock
from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.liveness import FreezeWatch
from sgl_pd.core.page_ids import PageIds
from sgl_pd.core.regions import Region, RegionTable
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.states import DecodeState
from sgl_pd.core.wire import (
    WINDOW_KINDS,
    Abort,
    AbortAck,
    ChunkNotice,
    ErrorMsg,
    Message,
    MetadataBuffers,
    Role,
    ShardRegistration,
    StateSlots,
    TransferRequest,
)
from sgl_pd.transfer.engine import Writes
from sgl_pd.transfer.fake import FakeFabric, FakeTransferEngine
from sgl_pd.transfer.faults import FaultInjectingEngine, WriteFaults

LAYOUT = KvLayout.gqa(
    num_layers=4, num_kv_heads=2, head_dim=8, page_size=1, elem_bytes=1,
    page_layout=PageLayout.NHD,
)  # fmt: skip
NUM_PAGES = 64
AUX_ROWS = 8
AUX_ITEM = 16  # bytes per metadata row
CHECKSUM_KEY = 0x5EC2E7  # both sides' key (the cluster secret's, in a served cluster)
# state beside the KV in three regions, bytes per slot: Mamba-like, one slot per request
# (conv and recurrent tensors of two layers, say), or sliding-window pages, a request's
# window being several slots (K, V and a third buffer, say)
STATE_SLOT_BYTES = (24, 40, 8)
STATE_SLOTS = 8
SWA_WINDOW = 6  # tokens, for "swa" state


@dataclass(frozen=True)
class StateShape:
    """One state component of a rank's pools: its kind, bytes per slot of each region,
    slots per region (`core.wire.StateSlots`)."""

    kind: str
    slot_bytes: tuple[int, ...] = STATE_SLOT_BYTES
    slots: int = STATE_SLOTS

    @property
    def window(self) -> int:
        return SWA_WINDOW if self.kind in WINDOW_KINDS else 0


StateSpec = bool | str | tuple[StateShape, ...]  # False: none; True: "mamba"; a kind


def state_shapes(spec: StateSpec) -> tuple[StateShape, ...]:
    if isinstance(spec, tuple):
        return spec
    if spec is False:
        return ()
    return (StateShape("mamba" if spec is True else spec),)


@dataclass
class Memory:
    """One rank's KV regions and metadata buffer, registered with its engine."""

    kv: list[np.ndarray]  # one (pages * page_bytes,) uint8 buffer per (layer, part)
    aux: np.ndarray  # (AUX_ROWS * AUX_ITEM,) uint8
    # per state component: its shape and one (slots * slot bytes,) uint8 buffer per region
    state: list[tuple[StateShape, list[np.ndarray]]]

    @classmethod
    def make(cls, engine: FakeTransferEngine, fill: int | None, state: StateSpec = False) -> Memory:
        """`state`: the state components it keeps (`state_shapes`)."""
        page_bytes = LAYOUT.page_bytes(LAYOUT.num_kv_heads)
        rng = np.random.default_rng(fill)

        def buffer(n: int) -> np.ndarray:
            if fill is None:
                return np.zeros(n, dtype=np.uint8)
            return rng.integers(0, 255, n, dtype=np.uint8)

        kv = [buffer(NUM_PAGES * page_bytes) for _ in range(LAYOUT.num_regions)]
        aux = np.zeros(AUX_ROWS * AUX_ITEM, dtype=np.uint8)
        components = [
            (shape, [buffer(shape.slots * n) for n in shape.slot_bytes])
            for shape in state_shapes(state)
        ]
        for buf in (*kv, aux, *(b for _, bufs in components for b in bufs)):
            engine.register(int(buf.ctypes.data), buf.nbytes)
        return cls(kv, aux, components)

    def state_slots(self) -> tuple[StateSlots, ...]:
        return tuple(
            StateSlots(
                kind=shape.kind,
                regions=tuple(Region(int(b.ctypes.data), b.nbytes) for b in bufs),
                slot_bytes=shape.slot_bytes,
                slots=shape.slots,
                window=shape.window,
            )
            for shape, bufs in self.state
        )

    def slot(self, slot: int, component: int = 0) -> bytes:
        """The bytes of state slot `slot` of a component, every region's in turn."""
        shape, bufs = self.state[component]
        return b"".join(
            bytes(b[slot * n : (slot + 1) * n]) for b, n in zip(bufs, shape.slot_bytes, strict=True)
        )

    def pool(self, draft_layers: int = 0) -> PoolDescription:
        regions = tuple(Region(int(b.ctypes.data), b.nbytes) for b in self.kv)
        return PoolDescription(
            layout=LAYOUT,
            local_heads=LAYOUT.num_kv_heads,
            kv=RegionTable.for_layout(LAYOUT, regions),
            draft_layers=draft_layers,
            num_pages=NUM_PAGES,
            aux=(Region(int(self.aux.ctypes.data), self.aux.nbytes),),
            aux_item_bytes=(AUX_ITEM,),
            aux_rows=AUX_ROWS,
            state=self.state_slots(),
        )

    def page(self, page: int) -> bytes:
        page_bytes = self.kv[0].nbytes // NUM_PAGES
        return b"".join(bytes(b[page * page_bytes : (page + 1) * page_bytes]) for b in self.kv)

    def set_page(self, page: int, value: int) -> None:
        """Every byte of `page`, in every (layer, part) region, set to `value`."""
        page_bytes = self.kv[0].nbytes // NUM_PAGES
        for b in self.kv:
            b[page * page_bytes : (page + 1) * page_bytes] = value


class GatedEngine(FakeTransferEngine):
    """Data batches wait for `gate` (set = open), so a test can hold writes in flight;
    with `hold_peer` set, only those to that peer; with `hold_into` set, only those
    writing into one of those address ranges."""

    def __init__(self, fabric: FakeFabric) -> None:
        super().__init__(fabric)
        self.gate = threading.Event()
        self.gate.set()
        self.waiting = threading.Event()  # a data batch is held at the gate
        self.data_batches = 0
        self.data_writes = 0  # one-sided writes in those batches
        self.hold_peer: str | None = None
        self.hold_into: list[range] | None = None

    def write(self, peer: str, writes: Writes) -> None:
        if writes.total_bytes > 8 * len(writes):
            self.data_batches += 1
            self.data_writes += len(writes)
            into = self.hold_into is None or any(
                int(d) in r for d in writes.dst for r in self.hold_into
            )
            if not self.gate.is_set() and self.hold_peer in (None, peer) and into:
                self.waiting.set()
                self.gate.wait(10)
        super().write(peer, writes)


@dataclass
class Decoder:
    messenger: DecodeMessenger
    memory: Memory
    registration: ShardRegistration
    engine: FakeTransferEngine


@dataclass
class Rig:
    """One prefill rank (TP 1) and any number of decode ranks (TP 1 each). `layerwise`:
    the prefill rank streams layer by layer; `draft_layers`: the layout's last layers are
    a speculative draft model's."""

    layerwise: bool = False
    draft_layers: int = 0
    engine_type: type[GatedEngine] = field(default_factory=lambda: GatedEngine)
    fabric: FakeFabric = field(default_factory=FakeFabric)
    clock: ManualClock = field(default_factory=ManualClock)
    sent: list[tuple[str, Message]] = field(default_factory=list)
    decoders: dict[str, Decoder] = field(default_factory=dict)  # by inbox
    # metered: real metrics, each rank's in its own registry (role -> registry)
    metered: bool = False
    registries: dict[str, Any] = field(default_factory=dict)
    tracing: RequestTracing = field(default_factory=lambda: RequestTracing(False))
    gather_bytes: int = 0  # the prefill rank's gather area (none when 0)
    freeze: FreezeWatch | None = None  # the prefill process's freeze watch
    checksum: bool = False  # --pd-kv-checksum on both sides
    decoder_checksum: bool | None = None  # ... on the decoders, when it differs
    corruption_rate: float = 0.0  # of the prefill rank's data batches
    # the model's state components on every rank (`state_shapes`): True or "mamba" (a
    # slot per request), "swa", or the shapes of several
    state: StateSpec = False
    lose_errors: bool = False  # ErrorMsgs to decoders are lost (their resends still due)

    def _metrics(self, role: str) -> TransferMetrics:
        if not self.metered:
            return TransferMetrics(False, role)
        from prometheus_client import CollectorRegistry

        self.registries[role] = CollectorRegistry()
        return TransferMetrics(True, role, self.registries[role])

    def __post_init__(self) -> None:
        self.prefill_engine = self.engine_type(self.fabric)
        self.prefill_memory = Memory.make(self.prefill_engine, fill=1, state=self.state)
        pool = self.prefill_memory.pool(self.draft_layers)
        self.gather_area = None
        if self.gather_bytes:
            self.gather_area = StagingArea(self.gather_bytes, "cpu", self.prefill_engine)
        engine: Any = self.prefill_engine
        if self.corruption_rate:
            engine = FaultInjectingEngine(engine, WriteFaults(corruption_rate=self.corruption_rate))
        self.faulty_engine = engine
        self.prefill = PrefillMessenger(
            rank=0,
            instance=1,
            scheme=ShardingScheme(1),
            pool=pool,
            engine=engine,
            sums=KvSums(pool, "cpu", CHECKSUM_KEY) if self.checksum else None,
            layerwise=self.layerwise,
            send_to_decoder=self._to_decoder,
            metrics=self._metrics("prefill"),
            timeout_s=30.0,
            clock=self.clock,
            tracing=self.tracing,
            freeze=self.freeze,
            staging=(
                None
                if self.gather_area is None
                else Staging(self.gather_area, PoolCopies(pool, "cpu"))
            ),
        )
        self.prefill_registration = ShardRegistration(
            role=Role.PREFILL, rank=0, scheme=ShardingScheme(1),
            session=self.prefill_engine.session_id, inbox="prefill-0", instance=1,
            layout=LAYOUT, num_pages=NUM_PAGES, kv_regions=pool.kv.regions,
            layer_group_size=self.prefill.layer_group_size,
            metadata=MetadataBuffers(regions=pool.aux, row_bytes=(AUX_ITEM,), rows=AUX_ROWS),
            state=pool.state,
        )  # fmt: skip

    @property
    def _decoder_checksum(self) -> bool:
        return self.checksum if self.decoder_checksum is None else self.decoder_checksum

    def add_decoder(self, inbox: str, state: StateSpec | None = None) -> Decoder:
        """`state`: the state slots its model keeps (`Rig.state`; None: as the rig's)."""
        engine = FakeTransferEngine(self.fabric)
        memory = Memory.make(engine, fill=None, state=self.state if state is None else state)
        pool = memory.pool(self.draft_layers)
        instance = len(self.decoders) + 7
        messenger = DecodeMessenger(
            rank=0,
            instance=instance,
            scheme=ShardingScheme(1),
            pool=pool,
            engine=engine,
            send_to_prefill=self._to_prefill,
            transfer_timeout_s=30.0,
            metrics=self._metrics("decode"),
            clock=self.clock,
            tracing=self.tracing,
            sums=KvSums(pool, "cpu", CHECKSUM_KEY) if self._decoder_checksum else None,
        )
        registration = ShardRegistration(
            role=Role.DECODE, rank=0, scheme=ShardingScheme(1), session=engine.session_id,
            inbox=inbox, instance=instance, layout=LAYOUT, num_pages=NUM_PAGES,
            kv_regions=pool.kv.regions, layer_group_size=1,
            metadata=MetadataBuffers(regions=pool.aux, row_bytes=(AUX_ITEM,), rows=AUX_ROWS),
            completion=messenger.completion_area,
            state=pool.state,
        )  # fmt: skip
        decoder = Decoder(messenger, memory, registration, engine)
        self.decoders[inbox] = decoder
        return decoder

    def request(
        self,
        decoder: Decoder,
        room: int,
        dst_pages: list[int],
        slot: int,
        held_tokens: int = 0,
        kv_tokens: int | None = None,
        state_slots: tuple[tuple[int, ...], ...] = (),
    ) -> None:
        """The decode rank's side: its receiver made and the prefiller found (the
        bootstrap, stamped as the receiver does), then its pages asked for. `held_tokens`:
        the prefix its cache holds (`dst_pages` are the pages after it); `kv_tokens`: the
        prompt tokens whose KV the request needs (None: unchecked); `state_slots`: its
        state slots (a decoder with state)."""
        seen_s = self.clock.monotonic()
        bootstrap = (seen_s, self.clock.monotonic())
        decoder.messenger.request(
            room,
            [self.prefill_registration],
            decoder.registration,
            np.asarray(dst_pages, dtype=np.int64),
            slot,
            bootstrap=bootstrap,
            held_tokens=held_tokens,
            kv_tokens=kv_tokens,
            state_slots=state_slots,
        )

    def prefill_all(
        self,
        room: int,
        src_pages: list[int],
        chunk: int = 4,
        held_pages: int = 0,
        state_slots: tuple[tuple[int, ...], ...] | None = None,
    ) -> None:
        """SGLang's side of a request on the prefill rank, after-forward mode: it chunks
        the prompt from its start, and sends only the pages after the decoder's held
        prefix (`held_pages`, what `pop_decode_prefix_len` said); a last send without
        pages when the decoder holds them all. `state_slots`: its state slots, named in
        the last send."""
        self.prefill.track(room)
        self.prefill.expect(room, len(src_pages) - held_pages, aux_index=room % AUX_ROWS)
        for start in range(0, len(src_pages), chunk):
            end = min(start + chunk, len(src_pages))
            part = np.asarray(src_pages[max(start, held_pages) : end], dtype=np.int64)
            last = end == len(src_pages)
            if len(part) or last:
                slots = state_slots if last else None
                self.prefill.submit_chunk(room, part, len(part), state_slots=slots)

    def prefill_layerwise(
        self,
        room: int,
        src_pages: list[int],
        chunk: int = 4,
        streamer_lags: bool = False,
        held_pages: int = 0,
        state_slots: tuple[tuple[int, ...], ...] | None = None,
    ) -> None:
        """SGLang's side of a request on the prefill rank, layer-wise mode: per chunk, its
        notice, the target's layers as the streamer reports them, SGLang's send after the
        draft ran. `streamer_lags`: the streamer reports the forward done after the send
        (as it may on a GPU); else before it."""
        self.prefill.track(room)
        self.prefill.expect(room, len(src_pages) - held_pages, aux_index=room % AUX_ROWS)
        target_layers = range(LAYOUT.num_layers - self.draft_layers)
        for start in range(0, len(src_pages), chunk):
            end = min(start + chunk, len(src_pages))
            part = np.asarray(src_pages[max(start, held_pages) : end], dtype=np.int64)
            noticed = self.prefill.notice_chunk(
                room, PageIds.ready(src_pages[:end]), end, end == len(src_pages)
            )
            assert (noticed is not None) == (end > held_pages)  # held chunks send nothing
            chunks = [] if noticed is None else [noticed]
            self.prefill.write_layers(chunks, target_layers)
            if not streamer_lags:
                self.prefill.forward_done(chunks)
            last = end == len(src_pages)
            if len(part) or last:
                slots = state_slots if last else None
                self.prefill.submit_chunk(room, part, len(part), state_slots=slots)
            if streamer_lags:
                self.prefill.forward_done(chunks)

    # -- message delivery (what the inboxes would do) ------------------------------------

    def _to_prefill(self, inbox: str, message: Message) -> bool:
        self.sent.append((inbox, message))
        if isinstance(message, TransferRequest):
            self.prefill.on_transfer_request(message)
        elif isinstance(message, Abort):
            self.prefill.on_abort(message)
        return True

    def _to_decoder(self, inbox: str, message: Message) -> bool:
        self.sent.append((inbox, message))
        decoder = self.decoders.get(inbox)
        if decoder is None:
            return False
        if isinstance(message, ChunkNotice):
            decoder.messenger.on_chunk_notice(message)
        elif isinstance(message, AbortAck):
            decoder.messenger.on_abort_ack(message)
        elif isinstance(message, ErrorMsg) and not self.lose_errors:
            decoder.messenger.on_error(message)
        return True


def wait_state(decoder: Decoder, room: int, want: DecodeState, timeout_s: float = 10.0) -> None:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        state, _ = decoder.messenger.poll(room)
        if state is want:
            return
        time.sleep(0.005)
    raise AssertionError(f"room {room}: {decoder.messenger.poll(room)} instead of {want}")
