"""A prefill server and a decoder of any TP sizes, every rank a messenger over one
in-memory fabric (`transfer.fake`): what the sharded messenger tests run requests
through (KV under re-layout, checksums, state slices besides the KV)."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import numpy as np

from sgl_pd.backend.decode.messenger import DecodeMessenger
from sgl_pd.backend.kv_sums import KvSums
from sgl_pd.backend.metrics import TransferMetrics
from sgl_pd.backend.pool import PoolDescription
from sgl_pd.backend.prefill.messenger import PrefillMessenger
from sgl_pd.backend.prefill.room_types import StreamedState
from sgl_pd.backend.relayout_copies import PoolCopies
from sgl_pd.backend.staging_area import Staging, StagingArea
from sgl_pd.core.clock import ManualClock
from sgl_pd.core.layer_steps import LayerSteps
from sgl_pd.core.page_ids import PageIds
from sgl_pd.core.regions import Region, RegionTable
from sgl_pd.core.sharding import ShardingScheme, local_heads
from sgl_pd.core.states import DecodeState
from sgl_pd.core.wire import (
    Abort,
    AbortAck,
    ChunkNotice,
    ErrorMsg,
    MetadataBuffers,
    Role,
    ShardRegistration,
    StateSlicing,
    StateSlots,
    TransferRequest,
)
from sgl_pd.transfer.fake import FakeFabric, FakeTransferEngine

NUM_PAGES, AUX_ROWS, AUX_ITEM, KEY = 64, 8, 16, 0x1234
STATE_SLOTS = 8  # slots of every state region


@dataclass(frozen=True)
class StateRegion:
    """One region of a model's state as TP splits it: a slot holds `outer` rows of the
    axis's units (`groups`: full sizes of its independently split sub-blocks), `unit`
    bytes each; `groups` () for a slot the same on every rank (`unit` bytes whole)."""

    groups: tuple[int, ...]
    unit: int
    outer: int = 1
    grouped: bool = False  # the axis names its sub-blocks (GDN conv's [q | k | v])

    def slicing(self, tp: int) -> StateSlicing:
        if not self.groups:
            return StateSlicing(units=0)
        units = sum(g // tp for g in self.groups)
        return StateSlicing(
            units=units, outer=self.outer, groups=self.groups if self.grouped else ()
        )

    def item(self, tp: int) -> int:
        """Bytes of one slot on a rank of TP `tp`."""
        return self.unit * (self.outer * self.slicing(tp).units if self.groups else 1)

    def shard(self, whole: np.ndarray, rank: int, tp: int) -> np.ndarray:
        """Rank `rank`'s slot of the whole slot `whole` ((outer, sum(groups), unit), or
        (unit,) replicated), flat: each row the rank's share of every group in order."""
        if not self.groups:
            return whole
        rows = []
        for row in whole:
            parts, at = [], 0
            for full in self.groups:
                n = full // tp
                parts.append(row[at + rank * n : at + (rank + 1) * n])
                at += full
            rows.append(np.concatenate(parts))
        return np.stack(rows).reshape(-1)

    def whole(self, rng: np.random.Generator) -> np.ndarray:
        shape = (self.outer, sum(self.groups), self.unit) if self.groups else (self.unit,)
        return rng.integers(1, 255, shape, dtype=np.uint8)


@dataclass
class StateModel:
    """A model's state components, each a kind and its regions; the prefill's slots hold
    the shards of random whole slots (`wholes`), the decoder's start zeroed."""

    components: tuple[tuple[str, tuple[StateRegion, ...]], ...]
    window: int = 0  # for "swa"
    # layer-wise: the model layer of each region of each component, and of each KV layer
    # (`core.layer_steps`); () streams no state layer by layer
    layers: tuple[tuple[int, ...], ...] = ()
    kv_layers: tuple[int, ...] = ()
    seed: int = 7
    wholes: dict[tuple[int, int, int], np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        rng = np.random.default_rng(self.seed)
        for c, (_, regions) in enumerate(self.components):
            for r, region in enumerate(regions):
                for slot in range(STATE_SLOTS):
                    self.wholes[c, r, slot] = region.whole(rng)

    def make(self, engine, rank: int, tp: int, fill: bool) -> tuple[tuple[StateSlots, ...], list]:  # type: ignore[no-untyped-def]
        """This rank's state components and their buffers (registered with `engine`)."""
        components, buffers = [], []
        for c, (kind, regions) in enumerate(self.components):
            mine = []
            for r, region in enumerate(regions):
                item = region.item(tp)
                buf = np.zeros(STATE_SLOTS * item, np.uint8)
                if fill:
                    for slot in range(STATE_SLOTS):
                        buf[slot * item : (slot + 1) * item] = region.shard(
                            self.wholes[c, r, slot], rank, tp
                        )
                engine.register(int(buf.ctypes.data), buf.nbytes)
                mine.append(buf)
            buffers.append(mine)
            components.append(
                StateSlots(
                    kind=kind,
                    regions=tuple(Region(int(b.ctypes.data), b.nbytes) for b in mine),
                    slot_bytes=tuple(region.item(tp) for region in regions),
                    slots=STATE_SLOTS,
                    window=self.window if kind == "swa" else 0,
                    slicing=tuple(region.slicing(tp) for region in regions),
                )
            )
        return tuple(components), buffers

    def expected(self, component: int, region: int, src_slot: int, rank: int, tp: int) -> bytes:
        """What decode rank `rank` (TP `tp`) holds once prefill slot `src_slot` moved."""
        _, regions = self.components[component]
        whole = self.wholes[component, region, src_slot]
        return regions[region].shard(whole, rank, tp).tobytes()


def _pool(layout, lh, engine, fill, draft=0, state=(), state_layers=()):
    rng = np.random.default_rng(fill)
    size = NUM_PAGES * layout.page_size * lh * layout.row_bytes
    kv = [
        rng.integers(0, 255, size, dtype=np.uint8) if fill is not None else np.zeros(size, np.uint8)
        for _ in range(layout.num_regions)
    ]
    aux = np.zeros(AUX_ROWS * AUX_ITEM, np.uint8)
    for b in (*kv, aux):
        engine.register(int(b.ctypes.data), b.nbytes)
    regions = tuple(Region(int(b.ctypes.data), b.nbytes) for b in kv)
    pool = PoolDescription(
        layout=layout,
        local_heads=lh,
        kv=RegionTable.for_layout(layout, regions),
        draft_layers=draft,
        num_pages=NUM_PAGES,
        aux=(Region(int(aux.ctypes.data), aux.nbytes),),
        aux_item_bytes=(AUX_ITEM,),
        aux_rows=AUX_ROWS,
        state=state,
        state_layers=state_layers,
    )
    return pool, (kv, aux)


def _drained(messenger: PrefillMessenger):  # type: ignore[no-untyped-def]
    """Counts `messenger`'s write jobs from `put` to their end; returns a wait for none
    left (each job, its state writes included, then landed)."""
    writers = messenger.writers
    pending, cond = [0], threading.Condition()
    put, execute = writers.put, writers._execute

    def counted_put(job):  # type: ignore[no-untyped-def]
        with cond:
            pending[0] += 1
        put(job)

    def counted_execute(job):  # type: ignore[no-untyped-def]
        try:
            execute(job)
        finally:
            with cond:
                pending[0] -= 1
                cond.notify_all()

    writers.put, writers._execute = counted_put, counted_execute

    def wait() -> None:
        with cond:
            assert cond.wait_for(lambda: pending[0] == 0, timeout=10), "write jobs did not end"

    return wait


def _registration(
    role, rank, scheme, engine, pool, instance, layer_group_size, completion=None, staging=None
):
    return ShardRegistration(
        role=role,
        rank=rank,
        scheme=scheme,
        session=engine.session_id,
        inbox=f"{role.value}-{rank}",
        instance=instance,
        layout=pool.layout,
        num_pages=NUM_PAGES,
        kv_regions=pool.kv.regions,
        layer_group_size=layer_group_size,
        metadata=MetadataBuffers(regions=pool.aux, row_bytes=(AUX_ITEM,), rows=AUX_ROWS),
        completion=completion,
        staging=staging,
        state=pool.state,
    )


class Cluster:
    def __init__(
        self, layout, ptp, dtp, layerwise=False, gather=0, recv=0, draft=0, sums=True, state=None
    ):
        """`sums`: every rank runs --pd-kv-checksum; `state`: a `StateModel` whose
        slots every rank holds (`state_memory[role][rank]`: its buffers)."""
        self.layout, self.fabric, self.clock = layout, FakeFabric(), ManualClock()
        self.state = state
        self.state_memory: dict[str, list] = {"prefill": [], "decode": []}
        self.keep = []
        self.prefills, self.pregs, self.decoders, self.dregs = [], [], [], []
        self._drains = []  # per prefill rank: waits for its write jobs to end
        ps = ShardingScheme(ptp)
        for r in range(ptp):
            eng = FakeTransferEngine(self.fabric)
            pool = self._memory("prefill", eng, r, ps, draft, state)
            staging = None
            if gather:
                staging = Staging(StagingArea(gather, "cpu", eng), PoolCopies(pool, "cpu"))
            m = PrefillMessenger(
                rank=r,
                instance=100 + r,
                scheme=ps,
                pool=pool,
                engine=eng,
                sums=KvSums(pool, "cpu", KEY) if sums else None,
                layerwise=layerwise,
                send_to_decoder=self._to_decoder,
                metrics=TransferMetrics(False, "prefill"),
                timeout_s=30.0,
                clock=self.clock,
                staging=staging,
            )
            self.prefills.append(m)
            self._drains.append(_drained(m))
            self.pregs.append(
                _registration(Role.PREFILL, r, ps, eng, pool, 100 + r, m.layer_group_size)
            )
        ds = ShardingScheme(dtp)
        for r in range(dtp):
            eng = FakeTransferEngine(self.fabric)
            pool = self._memory("decode", eng, r, ds, draft, state)
            staging, sreg = None, None
            if recv:
                area = StagingArea(recv, "cpu", eng)
                staging = Staging(area, PoolCopies(pool, "cpu"))
                sreg = Region(area.base, area.capacity)
            m = DecodeMessenger(
                rank=r,
                instance=200 + r,
                scheme=ds,
                pool=pool,
                engine=eng,
                send_to_prefill=self._to_prefill,
                transfer_timeout_s=30.0,
                metrics=TransferMetrics(False, "decode"),
                clock=self.clock,
                sums=KvSums(pool, "cpu", KEY) if sums else None,
                staging=staging,
            )
            self.decoders.append(m)
            self.dregs.append(
                _registration(Role.DECODE, r, ds, eng, pool, 200 + r, 1, m.completion_area, sreg)
            )

    def _memory(self, role, engine, rank, scheme, draft, state):
        """A rank's pool (a prefill's filled, a decoder's zeroed), its buffers kept."""
        prefill = role == "prefill"
        comps, bufs = state.make(engine, rank, scheme.tp_size, prefill) if state else ((), [])
        self.state_memory[role].append(bufs)
        fill = 100 + rank if prefill else None
        heads = local_heads(self.layout, scheme)
        layers = state.layers if state else ()
        pool, mem = _pool(
            self.layout, heads, engine, fill=fill, draft=draft, state=comps, state_layers=layers
        )
        self.keep.append(mem)
        return pool

    def _last_forward(self, p, chunks, steps: LayerSteps, src_state) -> None:  # type: ignore[no-untyped-def]
        """The last chunk's forward as the state sees it: each state region of the
        request's slots holds zeros (the decoders' starting bytes) until the step of its
        layer, when the layer "computes" its bytes; every write job then drains before
        the next step, so a region written before its layer ran lands zeros."""
        assert self.state is not None
        buffers = self.state_memory["prefill"][p.rank]
        final: dict[tuple[int, int], dict[int, bytes]] = {}
        for comp, layers in enumerate(self.state.layers):
            for reg in range(len(layers)):
                buf, item = buffers[comp][reg], p.rooms.state_slots[comp].slot_bytes[reg]
                final[comp, reg] = {
                    slot: buf[slot * item : (slot + 1) * item].tobytes() for slot in src_state[comp]
                }
                for slot in src_state[comp]:
                    buf[slot * item : (slot + 1) * item] = 0

        def compute(layer: int | None) -> None:
            for (comp, reg), slots in final.items():
                if layer is None or self.state.layers[comp][reg] == layer:
                    item = p.rooms.state_slots[comp].slot_bytes[reg]
                    for slot, data in slots.items():
                        buffers[comp][reg][slot * item : (slot + 1) * item] = np.frombuffer(
                            data, np.uint8
                        )

        drained = self._drains[p.rank]
        for step in range(len(steps)):
            one = range(step, step + 1)
            state_layers = steps.state_layers(one)
            for layer in state_layers:
                compute(layer)
            p.write_layers(chunks, steps.kv_layers(one), state_layers)
            drained()
        compute(None)  # regions in layers no step reports: final once the forward ended

    def _steps(self, num_kv_layers: int) -> LayerSteps | None:
        """The forward's steps where the state model places its regions in layers."""
        if self.state is None or not self.state.layers:
            return None
        kv = self.state.kv_layers or tuple(range(num_kv_layers))
        assert len(kv) == num_kv_layers
        # (a region placed in layer -1 is in a layer no step reports)
        state = {layer for ids in self.state.layers for layer in ids if layer >= 0}
        return LayerSteps.of(kv, state)

    def _to_decoder(self, inbox, message):
        d = self.decoders[int(inbox.split("-")[1])]
        if isinstance(message, ChunkNotice):
            d.on_chunk_notice(message)
        elif isinstance(message, AbortAck):
            d.on_abort_ack(message)
        elif isinstance(message, ErrorMsg):
            d.on_error(message)
        return True

    def _to_prefill(self, inbox, message):
        p = self.prefills[int(inbox.split("-")[1])]
        if isinstance(message, TransferRequest):
            p.on_transfer_request(message)
        elif isinstance(message, Abort):
            p.on_abort(message)
        return True

    def run(
        self,
        room,
        tokens,
        chunk_tokens,
        held_pages=0,
        src_order=None,
        dst_order=None,
        state_slots=((), ()),
        check=True,
        named_state=None,
        before_last_send=None,
        state_so_far=None,
    ):
        """Runs one request through every rank; `state_slots`: (the prefill's, the
        decoder's) slots of its state, a list per component. Returns each decode rank's
        (hand-off verdict, error); `check`: each must complete first (else the ranks'
        (state, error)).

        Layer-wise with a state model that places its regions in layers, the prefill
        reads its slots before the last chunk's forward and the forward reports one
        step at a time (`core.layer_steps`); SGLang's last send then names
        `named_state` (default: the same slots), after `before_last_send(rank)` ran.
        After the forward, send i before the last carries `state_so_far[i]` (the slots
        final so far), if given."""
        src_state, dst_state = state_slots
        L = self.layout
        ps = L.page_size
        npages = -(-tokens // ps)
        for r, d in enumerate(self.decoders):
            dst = (
                np.arange(20, 20 + npages)[held_pages:]
                if dst_order is None
                else np.asarray(dst_order)[held_pages:]
            )
            d.request(
                room,
                self.pregs,
                self.dregs[r],
                np.asarray(dst, np.int64),
                room % AUX_ROWS,
                held_tokens=held_pages * ps,
                state_slots=dst_state,
            )
        src_all = list(range(1, 1 + npages)) if src_order is None else list(src_order)
        for p in self.prefills:
            p.track(room)
            p.expect(room, npages - held_pages, aux_index=room % AUX_ROWS)
            if p.layerwise:
                target = range(L.num_layers - p.draft_layers)
                steps = self._steps(len(target))
                sent_pages = held_pages
                for start in range(0, tokens, chunk_tokens):
                    end = min(start + chunk_tokens, tokens)
                    last = end == tokens
                    endp = -(-end // ps)
                    read = None
                    if last and steps is not None and src_state:
                        ids = PageIds.ready([i for slots in src_state for i in slots])
                        read = StreamedState(ids, tuple(len(slots) for slots in src_state))
                    c = p.notice_chunk(room, PageIds.ready(src_all[:endp]), end, last, read)
                    chunks = [] if c is None else [c]
                    if steps is None:
                        p.write_layers(chunks, target)
                    elif not last:
                        for step in range(len(steps)):
                            one = range(step, step + 1)
                            p.write_layers(chunks, steps.kv_layers(one), steps.state_layers(one))
                    else:
                        self._last_forward(p, chunks, steps, src_state)
                    p.forward_done(chunks)
                    if last and before_last_send is not None:
                        before_last_send(p.rank)
                    # SGLang sends whole pages except at the end
                    upto = endp if last else end // ps
                    upto = max(upto, held_pages)
                    part = np.asarray(src_all[sent_pages:upto], np.int64)
                    sent_pages = max(sent_pages, upto)
                    named = src_state if named_state is None else named_state
                    if len(part) or last:
                        p.submit_chunk(room, part, len(part), state_slots=named if last else None)
            else:
                sent_tok = held_pages * ps
                sends = 0
                for start in range(0, tokens, chunk_tokens):
                    end = min(start + chunk_tokens, tokens)
                    last = end == tokens
                    upto_tok = end if last else (end // ps) * ps
                    if upto_tok <= sent_tok and not last:
                        continue
                    first_p, last_p = sent_tok // ps, -(-upto_tok // ps)
                    part = np.asarray(src_all[first_p:last_p], np.int64)
                    n = max(0, upto_tok - sent_tok)
                    sent_tok = max(sent_tok, upto_tok)
                    if last:
                        if before_last_send is not None:
                            before_last_send(p.rank)
                        named = src_state if named_state is None else named_state
                        p.submit_chunk(room, part, n, state_slots=named)
                    else:
                        so_far = state_so_far[sends] if state_so_far else None
                        p.submit_chunk(room, part, n, state_so_far=so_far)
                        sends += 1
        results = []
        for d in self.decoders:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                st, err = d.poll(room)
                if st is DecodeState.COMPLETE or err is not None:
                    break
                time.sleep(0.005)
            st, err = d.poll(room)
            if not check:
                results.append((st, err))
                continue
            assert st is DecodeState.COMPLETE, (d.rank, st, err)
            ok = d.hand_off(room)
            results.append((ok, d.poll(room)[1]))
        for p in self.prefills:
            p.writers.close()
        return results
