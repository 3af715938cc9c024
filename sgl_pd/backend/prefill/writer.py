"""The writes of one prefill rank, one thread per destination (decode rank).

Each decode rank this rank writes to has its own FIFO queue and thread, so a slow or dead
decoder delays only its own requests, and the writes of one (request, decode rank) run
in order on one thread: the count word this rank writes after each batch only grows.

A job writes one chunk's layers (`LayersJob`) or, after the last chunk, the metadata row
and the last chunk's notice (`MetadataJob`). Every job runs between `begin_write` and
`end_write` of `PrefillRooms`, which count it in flight for the drain rule
(`drain.Drain.settle`).

Under mismatched TP a link's heads may be strided in this rank's pages (`core.relayout`):
the job then gathers them into staging blocks, a few layers at a time as the staging
area allows, and writes the blocks; the destination side may be receive staging the
decoder granted. Either way the count word follows the job's last write.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from sgl_pd.backend.failure_cause import cause_of
from sgl_pd.backend.kv_sums import KvSums, token_slots
from sgl_pd.backend.pool import PoolDescription
from sgl_pd.backend.prefill.room_types import Chunk, Destination, Room
from sgl_pd.backend.prefill.rooms import PrefillRooms
from sgl_pd.backend.staging_area import Staging
from sgl_pd.core.counting import count_word, metadata_word, source_word_offset
from sgl_pd.core.failures import FailureCause
from sgl_pd.core.plan import AddressedPlan, TransferPlan, plan_transfer
from sgl_pd.core.regions import Region, RegionTable
from sgl_pd.core.relayout import ReceivePlacement, Relayout, fragmented, receive_placement
from sgl_pd.core.state_slices import slot_writes
from sgl_pd.core.wire import ChunkNotice, Guarded
from sgl_pd.errors import SglPdError
from sgl_pd.messenger.keyed_workers import KeyedWorkers
from sgl_pd.transfer.completion import CompletionWordWriter
from sgl_pd.transfer.engine import MetadataWrites, TransferEngine, Writes
from sgl_pd.transfer.errors import TransferFailed

logger = logging.getLogger("sgl_pd.prefill")

IDLE_EXIT_S = 30.0  # a destination's thread exits after this long without jobs
# Seconds a job waits for gather staging: other jobs hold it for one write each, so only
# writes stuck past Mooncake's own timeout make it run out
STAGING_WAIT_S = 60.0


@dataclass(frozen=True)
class LayersJob:
    destination: Destination
    chunk: Chunk
    layers: range
    # an event the chunk's KV is complete after (SGLang's early send under the overlap
    # scheduler: a CUDA event on the forward stream); the writer synchronizes on it
    ready: Any = None
    # layer-wise, a request's last chunk: the model layers whose state besides the KV
    # the forward finished, written with these layers (`core.layer_steps`)
    state_layers: frozenset[int] = frozenset()
    # after the forward, a send before the last: per state component, the leading slots
    # of the request's lists whose bytes are final already (`Room.state_so_far`),
    # written before these layers where the destination lacks them
    state_so_far: tuple[tuple[int, ...], ...] = ()


@dataclass(frozen=True)
class MetadataJob:
    destination: Destination
    room: int


Job = LayersJob | MetadataJob
# (inbox endpoint, message): never blocks; sent until acknowledged (`messenger.reliable`)
SendFn = Callable[[str, Guarded], object]
FailFn = Callable[[int, str, FailureCause], None]  # (room, reason, cause)
AckFn = Callable[[int, set[str]], None]  # (room, decoder inboxes owed a drain ack)
BytesFn = Callable[[int], None]


def layer_writes(addressed: AddressedPlan, layers: range) -> tuple[Writes, int]:
    """The writes of `layers` (whole layer groups) of one planned chunk on one sender's
    links, and how many completion groups they finish; the count word follows them all."""
    groups = addressed.group_count(layers)
    return Writes.trusted(*addressed.columns(layers)), groups


@dataclass(frozen=True)
class Sent:
    """What one job wrote: payload bytes and the one-sided writes that carried them."""

    bytes: int = 0
    writes: int = 0


def _gathers(plan: TransferPlan, links: Iterable[int]) -> bool:
    """One of `links` (indices into the plan's links) gathers under `plan`."""
    return any(plan.links[i].staging.gathers for i in links)


class KvWriter:
    """What a job writes, in Mooncake batches: data first, then this rank's count word."""

    def __init__(
        self,
        rank: int,
        instance: int,
        pool: PoolDescription,
        engine: TransferEngine,
        layer_group_size: int,
        send: SendFn,
        staging: Staging | None = None,
        sums: KvSums | None = None,
    ) -> None:
        self.rank = rank
        self.instance = instance
        self.pool = pool
        self.layout = pool.layout
        self.layer_group_size = layer_group_size
        self._words = CompletionWordWriter(engine)
        self._engine = engine
        self._send = send
        self._staging = staging  # gather blocks for strided source slices; None: per slot
        self._sums = sums  # --pd-kv-checksum: what this rank writes is summed as it goes

    def write_layers(
        self,
        dest: Destination,
        chunk: Chunk,
        layers: range,
        room: Room | None = None,
        state_layers: frozenset[int] = frozenset(),
        state_so_far: tuple[tuple[int, ...], ...] = (),
    ) -> Sent:
        """Writes `layers` of `chunk` on this rank's links into `dest`, after this rank's
        share of the state of `state_layers` (model layer ids) of `room`, or of the
        slots `state_so_far`, if any: that state is counted with the metadata
        (`_write_state`), not here."""
        state = Sent()
        if state_layers and room is not None and dest.writes_state:
            state = self._write_streamed_state(dest, room, state_layers)
        elif state_so_far and dest.writes_state:
            state = self._write_state_so_far(dest, state_so_far)
        if not layers:
            return state
        kv = self._write_kv_layers(dest, chunk, layers)
        return Sent(state.bytes + kv.bytes, state.writes + kv.writes)

    def _write_kv_layers(self, dest: Destination, chunk: Chunk, layers: range) -> Sent:
        decoder = dest.request.decoder
        addressed = self._addressed(dest, chunk)
        ungathered = dest.ungathered.get(chunk.index)
        writes, groups = layer_writes(addressed, layers)
        if layers.stop == addressed.plan.layers.stop:
            del dest.plans[chunk.index]  # the chunk's last layers: its plan is done
            dest.ungathered.pop(chunk.index, None)
        if not groups:
            return Sent()
        if self._sums is not None:
            self._sum_layers(dest, chunk, layers)
        # the count covers every group of this batch, written once they all completed
        word = self._count_word(dest, groups)
        if _gathers(addressed.plan, addressed.sending):
            # one link per (source, destination) rank pair: it is the job's only one
            (link_index,) = addressed.sending
            posted = self._write_gathered(
                decoder.session, addressed, link_index, layers, ungathered
            )
            self._words.send_many(decoder.session, Writes.empty(), [word])
            return Sent(writes.total_bytes, posted)
        self._words.send_many(decoder.session, writes, [word])
        return Sent(writes.total_bytes, len(writes))

    def _write_gathered(
        self,
        session: str,
        addressed: AddressedPlan,
        link_index: int,
        layers: range,
        ungathered: AddressedPlan | None,
    ) -> int:
        """Gathers the link's heads of `layers` into staging blocks and writes them, as
        many layers at a time as the staging area holds (at least one: see `_addressed`);
        returns the writes posted. A chunk gathered only because its source pages are
        fragmented (`ungathered` is its plan without that) takes one layer's blocks at a
        time (the area holds four jobs' worth: a write stuck on one decoder leaves room
        for others) and never waits: a layer that finds the area full goes out as it
        lies."""
        assert self._staging is not None
        area, plan = self._staging.area, addressed.plan
        parts = len(self.layout.parts)
        per_layer = plan.gather_block(link_index) * parts  # bytes
        step = 1 if ungathered is not None else max(1, min(len(layers), area.capacity // per_layer))
        posted = 0
        for start in range(layers.start, layers.stop, step):
            some = range(start, min(start + step, layers.stop))
            nbytes = per_layer * len(some)
            if ungathered is None:
                offset = area.take(nbytes, STAGING_WAIT_S)
            elif (taken := area.try_take(nbytes)) is not None:
                offset = taken
            else:
                src, dst, lengths = ungathered.columns(some)
                self._engine.write(session, Writes.trusted(src, dst, lengths))
                posted += len(lengths)
                continue
            try:
                regions = range(some.start * parts, some.stop * parts)
                assert plan.gather_pages is not None
                self._staging.copies.gather(
                    area.view(offset, nbytes), regions, plan.links[link_index].link,
                    plan.gather_pages,
                )  # fmt: skip
                src, dst, lengths = addressed.columns(some)
                src = src + plan.gather_shift(link_index, some, area.base + offset)
                self._engine.write(session, Writes.trusted(src, dst, lengths))
                posted += len(lengths)
            finally:
                # a failed batch may still read the blocks: it failed its request, whose
                # destination pages stay held (`Drain.quarantine`): reused blocks reach no
                # live page
                area.give_back(offset)
        return posted

    def _addressed(self, dest: Destination, chunk: Chunk) -> AddressedPlan:
        """The chunk's plan into `dest` over every layer, made on its first layer group."""
        addressed = dest.plans.get(chunk.index)
        if addressed is None:
            receive = self._receive(dest)
            whole = dest.request.stage_all
            relayout = Relayout(self._staging is not None, receive is not None, whole)
            plan = self._plan(dest, chunk, relayout)
            if not self._gather_fits(plan):
                relayout = replace(relayout, gather=False)
                plan = self._plan(dest, chunk, relayout)
            if relayout.gather and not _gathers(plan, dest.mine) and self._scattered(chunk):
                gathered = self._plan(dest, chunk, replace(relayout, gather_all=True))
                if self._gather_fits(gathered):
                    dest.ungathered[chunk.index] = self._address(dest, plan, receive)
                    plan = gathered
            addressed = self._address(dest, plan, receive)
            dest.plans[chunk.index] = addressed
        return addressed

    def _address(
        self, dest: Destination, plan: TransferPlan, receive: tuple[ReceivePlacement, int] | None
    ) -> AddressedPlan:
        dst_table = RegionTable.for_layout(self.layout, dest.request.decoder.kv_regions)
        return AddressedPlan.for_sender(
            plan, dest.mine, self.pool.kv, dst_table, self.layer_group_size, receive
        )

    def _scattered(self, chunk: Chunk) -> bool:
        """The chunk's source pages are fragmented (this prefill's own prefix cache
        evicted and reused them): written as they lie, a write per short run."""
        size = self.layout.page_size
        first = chunk.tokens.start // size - chunk.src_first_page
        last = (chunk.tokens.stop - 1) // size - chunk.src_first_page
        return fragmented(chunk.src_pages.array()[first : last + 1])

    def _plan(self, dest: Destination, chunk: Chunk, relayout: Relayout) -> TransferPlan:
        request = dest.request
        return plan_transfer(
            self.layout,
            dest.links,
            chunk.src_pages.array(),
            request.dst_pages,
            chunk.tokens,
            relayout=relayout,
            src_first_page=chunk.src_first_page,
            held_pages=request.held_tokens // self.layout.page_size,
        )

    def _gather_fits(self, plan: TransferPlan) -> bool:
        """Every gathering link's blocks of one layer fit the staging area."""
        parts = len(self.layout.parts)
        return all(
            self._staging is not None and self._staging.area.fits(plan.gather_block(i) * parts)
            for i, lw in enumerate(plan.links)
            if lw.staging.gathers
        )

    def _receive(self, dest: Destination) -> tuple[ReceivePlacement, int] | None:
        """The decoder's receive staging for the request, if it granted some."""
        request = dest.request
        if request.staging_base is None:
            return None
        placement = receive_placement(
            self.layout, dest.links, len(request.dst_pages), all_links=request.stage_all
        )
        area = request.decoder.staging
        assert area is not None  # TransferRequest checks the grant against it
        if request.staging_base + placement.total > area.base + area.length:
            raise SglPdError(
                f"request {request.request_id}: the decoder's staging grant ends past its area"
            )
        return placement, request.staging_base

    def write_metadata(self, dest: Destination, aux_index: int | None, room: Room) -> Sent:
        """After the last chunk: this rank's slice of the request's state besides the KV
        (a Mamba slot, the sliding window's pages) if it writes some, then the metadata
        row (D9) if it writes it, then the last chunk's notice."""
        request, decoder = dest.request, dest.request.decoder
        sent = Sent()
        if dest.writes_state:
            sent = self._write_state(dest, room)
        if dest.writes_metadata:
            if aux_index is None or decoder.metadata is None:
                raise SglPdError(f"request {request.request_id}: no metadata row on one side")
            row_src, row_dst, row_lengths = _row_writes(
                self.pool.aux,
                decoder.metadata.regions,
                self.pool.aux_item_bytes,
                aux_index,
                request.metadata_slot,
            )
            writes = MetadataWrites.of(row_src, row_dst, row_lengths)
            self._words.send(
                decoder.session, writes, self._slot_base(dest), metadata_word(request.request_id)
            )
            sent = Sent(sent.bytes + writes.total_bytes, sent.writes + len(writes))
        self._send(
            decoder.inbox,
            ChunkNotice(
                request_id=request.request_id,
                chunk_index=max(0, room.chunks - 1),
                token_start=0,
                token_stop=max(1, room.tokens_planned),
                page_ids=(),
                is_last=True,
                prefill_instance=self.instance,
                num_chunks=room.chunks,
                checksums=self._checksums(dest),
            ),
        )
        return sent

    def _write_streamed_state(
        self, dest: Destination, room: Room, state_layers: frozenset[int]
    ) -> Sent:
        """Layer-wise, during the last chunk's forward: this rank's share of the state
        regions of `state_layers` into `dest`, from the slots read before the forward
        (`Room.streamed_state`). Nothing when none were read: then all of it goes after
        the forward."""
        streamed = room.streamed_state
        if streamed is None:
            return Sent()
        regions = self._regions_of(state_layers)
        writes = self._state_writes(dest, streamed.slots(), regions, _pairs_after({}))
        for i, wanted in enumerate(regions):
            dest.state_written.setdefault(i, set()).update(wanted)
        if len(writes):
            self._engine.write(dest.request.decoder.session, writes)
        return Sent(writes.total_bytes, len(writes))

    def _write_state_so_far(self, dest: Destination, so_far: tuple[tuple[int, ...], ...]) -> Sent:
        """After the forward, with a chunk before the last: every region of this rank's
        share of the slots of `so_far` (leading slots of each component's list, final
        already: the sliding window's pages of the chunks done) that `dest` lacks."""
        every = tuple(frozenset(range(len(c.regions))) for c in self.pool.state)
        done = dest.state_slots_written
        writes = self._state_writes(dest, so_far, every, _pairs_after(done, leading=True))
        for i, slots in enumerate(so_far):
            done[i] = max(done.get(i, 0), len(slots))
        dest.state_bytes_early += writes.total_bytes
        if len(writes):
            self._engine.write(dest.request.decoder.session, writes)
        return Sent(writes.total_bytes, len(writes))

    def _regions_of(self, state_layers: frozenset[int]) -> tuple[frozenset[int], ...]:
        """Per state component, its regions that hold a layer of `state_layers`."""
        layers_of = self.pool.state_layers or ((),) * len(self.pool.state)
        return tuple(
            frozenset(r for r, layer in enumerate(ids) if layer in state_layers)
            for ids in layers_of
        )

    def _write_state(self, dest: Destination, room: Room) -> Sent:
        """After the last chunk's forward: this rank's share of the request's state
        regions not written during it, then its count word one group on
        (`core.counting`: the state group, after every chunk's, which covers the
        regions written layer by layer too: they landed on this thread before)."""
        request = dest.request
        if room.state_slots is None:
            raise SglPdError(f"request {request.request_id}: SGLang named no state slots")
        # every region and slot again where SGLang named other slots than those written
        # from before: this job follows every earlier one on this thread, so its bytes
        # are the last
        renamed = room.state_renamed
        remaining = tuple(
            frozenset(range(len(c.regions)))
            - (set() if renamed else dest.state_written.get(i, set()))
            for i, c in enumerate(self.pool.state)
        )
        done = {} if renamed else dest.state_slots_written
        writes = self._state_writes(dest, room.state_slots, remaining, _pairs_after(done))
        dest.state_bytes_after += writes.total_bytes
        # SGLang frees the state slots once the request polls failed (they are not
        # pinned, as its pages are): only a request still live once the batch landed
        # read an intact state, and only then does its count go
        if len(writes):
            self._engine.write(request.decoder.session, writes)
        if room.error is not None:
            raise SglPdError(
                f"request {request.request_id} failed while its state was being"
                f" written ({room.error}): its count is not sent"
            )
        word = self._count_word(dest, 1)
        self._words.send_many(request.decoder.session, MetadataWrites.empty(), [word])
        return Sent(writes.total_bytes, len(writes))

    def _state_writes(
        self,
        dest: Destination,
        src_state: Sequence[Sequence[int] | np.ndarray],
        regions: tuple[frozenset[int], ...],
        pairs: PairsFn,
    ) -> Writes:
        """This rank's blocks of `regions` (per component) of the request's state slots
        `src_state` into the decode rank's, for the slot pairs `pairs` chooses (the
        same window positions on both sides, `core.sliding_window`, pair up in order),
        region by region: a whole slot per region at one TP size, this rank's share of
        the sliced axis at another (`core.state_slices`; `destinations.join` refused
        pairs that cannot be split, and chose the blocks)."""
        request = dest.request
        mine, theirs = self.pool.state, request.decoder.state
        if len(mine) != len(theirs) or len(request.state_slots) != len(theirs):
            raise SglPdError(f"request {request.request_id}: the two sides' state differs")
        if len(src_state) != len(mine):
            raise SglPdError(f"request {request.request_id}: SGLang named other state slots")
        parts = []
        for i, (component, target, src_slots, dst_slots, blocks, wanted) in enumerate(
            zip(
                mine, theirs, src_state, request.state_slots, dest.state_blocks, regions,
                strict=True,
            )
        ):  # fmt: skip
            chosen = pairs(i, src_slots, dst_slots)
            if chosen is None:
                raise SglPdError(
                    f"request {request.request_id}: the prefill named {len(src_slots)}"
                    f" {component.kind} state slots and the decoder {len(dst_slots)}"
                )
            if not wanted or not chosen or not any(blocks[r] for r in wanted):
                continue
            src = src_slots[chosen.start : chosen.stop]
            dst = dst_slots[chosen.start : chosen.stop]
            columns = slot_writes(component, target, blocks, src, dst, wanted)
            parts.append(MetadataWrites.of(*columns))
        return MetadataWrites.concat(parts)

    def _sum_layers(self, dest: Destination, chunk: Chunk, layers: range) -> None:
        """Adds `layers` of `chunk`, on every link this rank writes into `dest`, to the
        destination's sums (what the decoder will find in its pages, `core.kv_checksum`)."""
        sums = self._sums
        assert sums is not None
        if dest.sums is None:
            dest.sums = sums.zeros()
        start, stop = chunk.tokens.start, chunk.tokens.stop
        slots = token_slots(
            chunk.src_pages.array(), chunk.src_first_page, start, stop, self.layout.page_size
        )
        regions, room = sums.regions_of(layers), dest.request.request_id
        for i in sorted(dest.mine):
            link = dest.links[i]
            offset = link.src_head_offset
            sums.add_link(dest.sums, room, regions, link, offset, (start, stop), slots)

    def _checksums(self, dest: Destination) -> tuple[int, ...]:
        """The request's sums into `dest` for its last notice: () without checksums or
        links into it; zeros when every token it would send was held there."""
        if self._sums is None or not dest.mine:
            return ()
        if dest.sums is None:
            return (0,) * self.layout.num_regions
        return self._sums.read(dest.sums)

    def _count_word(self, dest: Destination, groups: int) -> tuple[int, int]:
        """(address, value) of this rank's count word in `dest` once `groups` more groups
        finished: the count only grows, on the destination's one writer thread."""
        dest.groups_done += groups
        address = self._slot_base(dest) + source_word_offset(self.rank)
        return address, count_word(dest.request.request_id, dest.groups_done)

    def _slot_base(self, dest: Destination) -> int:
        area = dest.request.decoder.completion
        assert area is not None  # TransferRequest checks that a decoder has one
        return area.region.base + dest.request.completion_slot * area.slot_bytes

    def close(self) -> None:
        self._words.close()


# (component, the prefill's slots, the decoder's) -> the slot pairs (positions in both
# lists) to write; None where the two lists cannot pair up
PairsFn = Callable[[int, Sequence[int], Sequence[int]], range | None]


def _pairs_after(written: dict[int, int], *, leading: bool = False) -> PairsFn:
    """The slot pairs past those `written` already (per component, its leading pairs)
    of two lists of one length (the whole lists: the two sides name one slot each for
    the same things), or, `leading`, of the prefill's leading slots, no more than the
    decoder named."""

    def pairs(component: int, src: Sequence[int], dst: Sequence[int]) -> range | None:
        if len(src) > len(dst) or (not leading and len(src) != len(dst)):
            return None
        return range(min(written.get(component, 0), len(src)), len(src))

    return pairs


def _row_writes(
    sources: Sequence[Region],
    targets: Sequence[Region],
    row_bytes: Sequence[int],
    src_row: int,
    dst_row: int,
) -> tuple[list[int], list[int], list[int]]:
    """(sources, destinations, lengths): row `src_row` of each source region into row
    `dst_row` of its target region, rows of `row_bytes[i]` bytes (a request's metadata
    rows, or its state slot)."""
    src, dst, lengths = [], [], []
    for source, target, item in zip(sources, targets, row_bytes, strict=True):
        src.append(source.base + src_row * item)
        dst.append(target.base + dst_row * item)
        lengths.append(item)
    return src, dst, lengths


class DestinationWriters:
    """One queue and one thread per decode rank (keyed by its transfer session)."""

    def __init__(
        self,
        rooms: PrefillRooms,
        writer: KvWriter,
        *,
        on_failure: FailFn,
        on_drained: AckFn,
        on_bytes: BytesFn,
        on_done: Callable[[Room], None],
        idle_exit_s: float = IDLE_EXIT_S,
    ) -> None:
        self._rooms = rooms
        self._writer = writer
        self._on_failure = on_failure
        self._on_drained = on_drained
        self._on_bytes = on_bytes
        self._on_done = on_done
        self._workers: KeyedWorkers[Job] = KeyedWorkers(
            lambda _session, job: self._execute(job),
            f"sgl-pd-writer-{writer.rank}",
            idle_exit_s=idle_exit_s,
        )

    @property
    def thread_failures(self) -> int:
        """Writer threads that died of a bug (for /health)."""
        return self._workers.thread_failures

    def put(self, job: Job) -> None:
        self._workers.put(job.destination.session, job)

    def close(self, timeout_s: float = 5.0) -> None:
        self._workers.close(timeout_s)
        self._writer.close()

    def _execute(self, job: Job) -> None:
        room_id = job.chunk.room if isinstance(job, LayersJob) else job.room
        if self._rooms.frozen():
            self._fail_frozen(room_id)
            return
        room = self._rooms.begin_write(room_id, job.chunk if isinstance(job, LayersJob) else None)
        if room is None:
            return  # failed or gone: nothing more is written for it
        sent, done, landing = Sent(), False, False
        try:
            if isinstance(job, LayersJob):
                if job.ready is not None:
                    job.ready.synchronize()
                    if self._rooms.frozen():  # stopped while waiting
                        self._fail_frozen(room_id)
                        return
                sent = self._writer.write_layers(
                    job.destination,
                    job.chunk,
                    job.layers,
                    room,
                    job.state_layers,
                    job.state_so_far,
                )
            else:
                sent = self._writer.write_metadata(job.destination, room.aux_index, room)
                done = True
        except TransferFailed as e:
            landing = e.may_still_land
            logger.error("request %d: %s", room_id, e)
            self._on_failure(room_id, str(e), cause_of(e))
        except SglPdError as e:
            logger.error("request %d: %s", room_id, e)
            self._on_failure(room_id, str(e), cause_of(e))
        except Exception as e:
            logger.exception("request %d: internal error", room_id)
            self._on_failure(room_id, f"internal error: {e!r}", cause_of(e))
        finally:
            end = self._rooms.end_write(
                room_id,
                sent.bytes,
                sent.writes,
                metadata_done=done,
                batch_failed=landing,
                chunk_index=job.chunk.index if isinstance(job, LayersJob) else None,
            )
            self._on_bytes(sent.bytes)
            if end.acks:
                self._on_drained(room_id, end.acks)
        if end.completed is not None:
            self._on_done(end.completed)

    def _fail_frozen(self, room_id: int) -> None:
        """This process did not run for about the hang timeout: its decoders may have
        declared it hung and freed the pages, so nothing more is written - and the job
        is not dropped quietly either (its count would never complete): the request
        fails here, and its decoders hear why. The liveness thread, which may have
        beaten again before it noticed (a freeze inside its own loop), need not."""
        why = (
            f"the prefill rank did not run for about {self._rooms.freeze_limit_s():.1f} s"
            " (stopped or starved): its decoders may have given up on this request"
        )
        self._on_failure(room_id, why, FailureCause.PEER_LOST)
