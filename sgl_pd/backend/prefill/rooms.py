"""Every request on one prefill rank: its state machine, its destinations, its writes in
flight, and the drain acks it owes.

A request (SGLang's bootstrap room) moves WAITING_FOR_DECODER -> READY -> SENDING -> DONE
(`core.states.PREFILL_TABLE`), or to FAILED / ABORTED / TIMED_OUT from any of them.

May its pages be freed? Everything that answers it is here (`_settle`): a request is
*drained* once it is final, no write job is between `begin_write` and `end_write`, and
no failed batch may still be landing (a failed Mooncake batch reports failure as soon as
one of its writes fails, while others may still be posted: the request stays undrained
for `FAILED_BATCH_QUARANTINE_S`, the engine's transfer timeout, after such a failure).
No job starts once a request is final (`begin_write` refuses). Then, and only then:
- its source pages are unpinned (`core.pins`): SGLang may reuse them, however and
  whenever it freed them (radix de-duplication, its own aborts, a failed request's
  release: SGLang's `poll` reports Failed at once, so its client hears without waiting
  for a failed batch's quarantine, and the pins keep the pages meanwhile);
- the `AbortAck`s owed to decoders go out, which is what lets a decoder free its own
  pages (so a decoder never frees pages a write of ours may still land in).

Threads: SGLang's scheduler thread, the inbox thread, the layer streamer and the
destination writers all call in; every method takes the one lock and never does I/O.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_pd.core.bounds import DEFAULT_ENGINE_TRANSFER_TIMEOUT_S, failed_batch_quarantine_s
from sgl_pd.core.clock import Clock
from sgl_pd.core.counting import links_into
from sgl_pd.core.layout import KvLayout
from sgl_pd.core.liveness import FreezeWatch
from sgl_pd.core.page_ids import PageIds
from sgl_pd.core.pins import PagePins
from sgl_pd.core.plan import AddressedPlan, TokenRange
from sgl_pd.core.sharding import ShardingScheme, ShardLink, link_shards
from sgl_pd.core.states import (
    METADATA_DUE,
    PREFILL_TABLE,
    MetadataWait,
    PrefillState,
    RequestTracker,
)
from sgl_pd.core.wire import ErrorCode, TransferRequest

_P = PrefillState
# A final, drained request SGLang has not forgotten this long after it ended never will
# be (SGLang dropped it on one of its own paths, or never made a sender for it): dropped.
UNOWNED_GRACE_S = 60.0
# Seconds a request stays undrained after one of its write batches failed: the engine's
# transfer timeout twice, after which no write of that batch is posted (`core.bounds`).
FAILED_BATCH_QUARANTINE_S = failed_batch_quarantine_s(DEFAULT_ENGINE_TRANSFER_TIMEOUT_S)
# Requests decoders asked for that SGLang has not seen (yet): in the router flow both sides
# get a request at about the same time, so a few; more is a peer flooding this rank.
MAX_UNOWNED_ROOMS = 4096
# Chunks of one request whose write stamps are kept for its timeline: a 128k-token prompt
# in 8k-token chunks has 16; past this many the rest go unstamped (memory stays bounded)
MAX_STAMPED_CHUNKS = 256


@dataclass(frozen=True)
class Chunk:
    """One prefill chunk of one request: the tokens it makes (and any cached prefix before
    them that was not sent yet)."""

    room: int
    index: int  # chunk number of the request, from 0
    tokens: TokenRange
    # (pages,) this rank's page per logical page from `src_first_page`, up to the
    # chunk's end; layer-wise, the ids may still be on their way from the device (read
    # them with `.array()`)
    src_pages: PageIds
    is_last: bool
    src_first_page: int = 0  # after-forward: SGLang sends no page of a held prefix


@dataclass
class Destination:
    """One decode rank that a request's KV goes to from this prefill rank."""

    request: TransferRequest
    links: tuple[ShardLink, ...]  # every link into that decode rank, in counting order
    mine: frozenset[int]  # indices into `links` of the ones this rank writes
    writes_metadata: bool  # this rank writes the decode rank's metadata row (D9)
    groups_done: int = 0  # groups this rank finished into it: its count word (writer only)
    # chunk index -> its plan, addressed for every layer, until its last layers are written
    plans: dict[int, AddressedPlan] = field(default_factory=dict)  # (writer thread only)
    # chunk index -> the same chunk's plan without the gathering its fragmented source
    # pages asked for: its layers go out this way while the gather area is full
    ungathered: dict[int, AddressedPlan] = field(default_factory=dict)  # (writer thread only)
    # --pd-kv-checksum: (regions,) int64 on the pool's device, the keyed sums of what this
    # rank wrote into the decode rank so far (`backend.kv_sums`; writer thread only)
    sums: Any = None

    @property
    def session(self) -> str:
        return self.request.decoder.session


@dataclass
class Room:
    room: int
    created_s: float
    owned: bool = False  # SGLang holds a sender for it (else only a decoder asked so far)
    requests: dict[int, TransferRequest] = field(default_factory=dict)  # by decode rank
    destinations: dict[int, Destination] = field(default_factory=dict)  # ranks we write to
    decoder_tp: int | None = None
    aux_index: int | None = None  # this rank's metadata row
    # the prompt's first tokens every decode rank holds already (their prefix caches):
    # no chunk covers them, and SGLang's sends start after them
    held_tokens: int = 0
    held_read: bool = False  # SGLang read it (`pop_decode_prefix_len`): it is fixed now
    num_pages: int | None = None  # pages SGLang will send in all
    pages_sent: int = 0  # pages SGLang has handed to `send` so far
    tokens_planned: int = 0  # tokens covered by chunks so far
    prompt_tokens: int | None = None  # tokens this prefill computes, once SGLang fixed them
    src_pages: list[int] = field(default_factory=list)  # after-forward mode
    chunks: int = 0
    # What the metadata job waits for (`core.states.MetadataWait`): the draft model's
    # layers go at SGLang's send, since the draft runs after the target
    metadata: MetadataWait = MetadataWait.LAST_SEND | MetadataWait.TARGET_LAYERS
    awaiting_draft: list[Chunk] = field(default_factory=list)  # layer-wise, forwarded chunks
    metadata_pending: int = 0  # destinations whose metadata job has not finished
    inflight: int = 0  # write jobs between begin_write and end_write
    quarantine_until_s: float | None = None  # a failed batch may land until then
    error: str | None = None
    refused: bool = False  # SGLang refused the request as sent: decoders hear BAD_REQUEST
    acks_owed: set[str] = field(default_factory=set)  # decoder inboxes awaiting a drain ack
    # decode ranks (instances) that aborted before they asked for pages: their requests
    # for this room, should a copy still come, are refused (their abort was acked)
    aborted_early: set[int] = field(default_factory=set)
    ended_s: float | None = None  # when it became final
    # SGLang stopped tracking it (aborted it itself, or cleared it while writes ran): it
    # will not poll again, so `sweep` drops it once drained
    released: bool = False
    bytes_sent: int = 0
    writes_posted: int = 0  # KV and metadata writes (completion words not counted)
    first_write_s: float | None = None
    last_chunk_first_write_s: float | None = None
    forward_end_s: float | None = None
    ready_s: float | None = None  # every decode rank's pages known (bootstrap over)
    last_send_s: float | None = None
    done_s: float | None = None
    # chunk index -> [its first write's start, its last write's end] (monotonic s)
    chunk_writes: dict[int, list[float]] = field(default_factory=dict)
    traced: bool = False  # its timeline went out (once per request)


@dataclass(frozen=True)
class WriteEnd:
    acks: set[str]  # decoder inboxes owed a drain ack now
    completed: Room | None  # the request, if this job was its last


class PrefillRooms:
    def __init__(
        self,
        *,
        rank: int,
        scheme: ShardingScheme,
        layout: KvLayout,
        layerwise: bool,
        timeout_s: float,
        clock: Clock,
        draft_layers: int = 0,
        freeze: FreezeWatch | None = None,
        pins: PagePins | None = None,
        quarantine_s: float = FAILED_BATCH_QUARANTINE_S,
    ) -> None:
        self.rank = rank
        self.scheme = scheme
        self.layout = layout
        self.layerwise = layerwise
        # the draft model's layers (the layout's last ones); layer-wise mode sends them
        # at SGLang's send, after the draft forward, and the rest as the target runs
        self.draft_layers = range(layout.num_layers - draft_layers, layout.num_layers)
        self.timeout_s = timeout_s
        self.quarantine_s = quarantine_s  # a failed batch's writes may land this long
        self._clock = clock
        self._freeze = freeze
        self.pins = pins if pins is not None else PagePins()
        self._lock = threading.Lock()
        self._rooms: dict[int, Room] = {}
        deadlines = {_P.WAITING_FOR_DECODER: timeout_s, _P.READY: timeout_s, _P.SENDING: timeout_s}
        self._states: RequestTracker[PrefillState] = RequestTracker(PREFILL_TABLE, deadlines, clock)

    def __len__(self) -> int:
        with self._lock:
            return len(self._rooms)

    # -- arrivals ---------------------------------------------------------------------------

    def track(self, room_id: int) -> None:
        """SGLang made a sender for this request (router flow: its copy of the request)."""
        with self._lock:
            self._room(room_id).owned = True

    def add_request(self, request: TransferRequest) -> str | None:
        """A decode rank's destinations. Returns why it is refused, or None."""
        decoder = request.decoder
        with self._lock:
            if request.request_id not in self._rooms and self._unowned() >= MAX_UNOWNED_ROOMS:
                return (
                    f"{MAX_UNOWNED_ROOMS} requests wait for their prefill here already: send"
                    " each request to the prefill server as well (the router does)"
                )
            room = self._room(request.request_id)
            if room.error is not None:
                return room.error
            if decoder.instance in room.aborted_early:
                return f"decode rank {decoder.rank} aborted request {room.room} before it asked"
            held = room.requests.get(decoder.rank)
            if held == request:
                return None  # a copy of what this rank asked: nothing changes
            if held is not None and held.decoder.instance != decoder.instance:
                return (
                    f"decode rank {decoder.rank} of another instance already asked for"
                    f" request {room.room}"
                )
            if room.decoder_tp not in (None, decoder.scheme.tp_size):
                return (
                    f"decode ranks disagree on TP ({room.decoder_tp} vs {decoder.scheme.tp_size})"
                )
            others = {q.held_tokens for r, q in room.requests.items() if r != decoder.rank}
            if others and others != {request.held_tokens}:
                return (
                    f"decode ranks disagree on the prefix they hold ({sorted(others)} vs"
                    f" {request.held_tokens} tokens)"
                )
            fixed = room.held_read or room.chunks
            if fixed and request.held_tokens != room.held_tokens:
                return (
                    f"the held prefix changed from {room.held_tokens} to"
                    f" {request.held_tokens} tokens after the prefill fixed where it sends from"
                )
            links = links_into(
                link_shards(self.layout, self.scheme, decoder.scheme, request.request_id),
                decoder.rank,
            )
            mine = frozenset(i for i, link in enumerate(links) if link.src_rank == self.rank)
            first = min(links, key=lambda link: (link.head_lo, link.src_rank))
            room.requests[decoder.rank] = request
            room.decoder_tp = decoder.scheme.tp_size
            room.held_tokens = request.held_tokens
            if not room.chunks:
                room.tokens_planned = request.held_tokens
            if mine:
                room.destinations[decoder.rank] = Destination(
                    request, links, mine, first.src_rank == self.rank
                )
            waiting = self._states.state(room.room) is _P.WAITING_FOR_DECODER
            if waiting and len(room.requests) == room.decoder_tp:
                self._states.transition(room.room, _P.READY)
                room.ready_s = self._clock.monotonic()
            return None

    def expect(self, room_id: int, num_pages: int, aux_index: int | None) -> None:
        """SGLang will send `num_pages` pages (those after the held prefix)."""
        with self._lock:
            room = self._room(room_id)
            room.num_pages, room.aux_index = num_pages, aux_index
            if num_pages == 0:
                # the decoder holds every token computed here: no chunk will carry KV,
                # so the metadata waits for SGLang's last send only
                room.metadata &= ~(MetadataWait.TARGET_LAYERS | MetadataWait.DRAFT_LAYERS)

    def held_tokens(self, room_id: int) -> int:
        """The prefix the decoder holds (SGLang's `pop_decode_prefix_len`): asked once
        every decode rank's request arrived, before the first forward; fixed from then."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return 0
            room.held_read = True
            return room.held_tokens

    def refuse(self, room_id: int, why: str) -> list[TransferRequest] | None:
        """SGLang refused this server's copy of the request before it made a sender: no
        prefill of it will run here. Returns the decode ranks to tell now (None when it
        had ended already); those that ask later are refused with `why` as they ask,
        until the room is swept (`UNOWNED_GRACE_S` after this)."""
        with self._lock:
            if room_id not in self._rooms and self._unowned() >= MAX_UNOWNED_ROOMS:
                return None  # no decoder asked: none is waiting for it
            room = self._room(room_id)
            if room.error is not None or room.owned:
                return None  # ended already, or SGLang holds it (its own abort applies)
            room.refused = True
            self._stop(room, why, _P.FAILED)
            return list(room.requests.values())

    def error_code(self, room_id: int) -> ErrorCode:
        """What a decode rank that asks for an ended request is told it ended with."""
        with self._lock:
            room = self._rooms.get(room_id)
            refused = room is not None and room.refused
            return ErrorCode.BAD_REQUEST if refused else ErrorCode.TRANSFER_FAILED

    def prompt_known(self, room_id: int, prompt_tokens: int) -> str | None:
        """SGLang fixed the tokens this prefill computes (`prompt_tokens`); returns why
        the decoders cannot be served them, or None (see `prompt_mismatch`)."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return None
            room.prompt_tokens = prompt_tokens
            return _prompt_mismatch(room)

    def prompt_mismatch(self, room_id: int) -> str | None:
        """Why the decode ranks that asked cannot be served the prompt this prefill
        computes, or None (also while that is not known yet): a decoder expecting the KV
        of other tokens would decode from the wrong one (`TransferRequest.kv_tokens`),
        and one holding more than are computed would never get the last send."""
        with self._lock:
            room = self._rooms.get(room_id)
            return None if room is None else _prompt_mismatch(room)

    # -- chunks -----------------------------------------------------------------------------

    def notice_chunk(
        self, room_id: int, src_pages: PageIds, end_token: int, is_last: bool
    ) -> Chunk | None:
        """Layer-wise mode, before the forward (D7). None when nothing is to be sent."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.error is not None or end_token <= room.tokens_planned:
                return None
            chunk = Chunk(
                room_id,
                room.chunks,
                TokenRange(room.tokens_planned, end_token),
                src_pages,
                is_last,
            )
            self.pins.pin(room_id, chunk.src_pages)
            room.chunks += 1
            room.tokens_planned = end_token
            self._states.progressed(room_id)
            if self.draft_layers:
                room.awaiting_draft.append(chunk)
                room.metadata |= MetadataWait.DRAFT_LAYERS
            self._sending(room)
            return chunk

    def submit_chunk(
        self, room_id: int, pages: np.ndarray, num_tokens: int
    ) -> list[tuple[Chunk, range]]:
        """SGLang's `send` after a forward: the (chunk, layers) writes due now, to be
        queued before `writes_queued` is called with them. After-forward mode: the chunk
        SGLang hands over, every layer; layer-wise mode: the draft model's layers of the
        chunks forwarded so far (the target's went as the forward ran). Both learn
        whether this send was the last."""
        with self._lock:
            room = self._rooms.get(room_id)  # gone: SGLang concluded it, nothing to send
            if room is None or room.error is not None:
                return []
            room.pages_sent += len(pages)
            self.pins.pin(room_id, pages)
            if not PREFILL_TABLE.is_final(self._states.state(room_id)):
                self._states.progressed(room_id)
            is_last = room.num_pages is not None and room.pages_sent >= room.num_pages
            due: list[tuple[Chunk, range]] = []
            page_size = self.layout.page_size
            if not self.layerwise and num_tokens > 0:
                # SGLang's sends start at the held prefix (whole pages)
                start = room.held_tokens + len(room.src_pages) * page_size
                room.src_pages.extend(int(p) for p in pages)
                chunk = Chunk(
                    room_id,
                    room.chunks,
                    TokenRange(start, start + num_tokens),
                    PageIds.ready(room.src_pages),
                    is_last,
                    src_first_page=room.held_tokens // page_size,
                )
                room.chunks += 1
                room.tokens_planned = start + num_tokens
                self._sending(room)
                due.append((chunk, range(self.layout.num_layers)))
            elif self.layerwise:
                # a chunk's draft KV exists once SGLang sends the pages that chunk filled
                sent_tokens = room.held_tokens + room.pages_sent * page_size
                forwarded = [
                    c for c in room.awaiting_draft if is_last or c.tokens.stop <= sent_tokens
                ]
                room.awaiting_draft = room.awaiting_draft[len(forwarded) :]  # in order
                due.extend((c, self.draft_layers) for c in forwarded)
            if is_last:
                room.metadata &= ~MetadataWait.LAST_SEND
                room.last_send_s = self._clock.monotonic()
            return due

    def writes_queued(self, room_id: int, writes: list[tuple[Chunk, range]]) -> None:
        """The writes `submit_chunk` returned are queued for every destination."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return
            for chunk, layers in writes:
                if not chunk.is_last:
                    continue
                if len(layers) == self.layout.num_layers:  # after-forward: all of them
                    room.metadata &= ~(MetadataWait.TARGET_LAYERS | MetadataWait.DRAFT_LAYERS)
                elif layers == self.draft_layers:
                    room.metadata &= ~MetadataWait.DRAFT_LAYERS

    def chunk_queued(self, chunk: Chunk) -> None:
        """Layer-wise mode: every target layer of `chunk` is queued for its destinations."""
        if chunk.is_last:
            with self._lock:
                room = self._rooms.get(chunk.room)
                if room is not None:
                    room.metadata &= ~MetadataWait.TARGET_LAYERS

    def take_metadata_due(self, room_id: int) -> list[Destination]:
        """The destinations whose metadata job should be queued now: once, after every
        layer of the last chunk is queued and SGLang has filled the metadata row."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.error is not None or room.metadata != METADATA_DUE:
                return []
            room.metadata = MetadataWait.QUEUED
            room.metadata_pending = len(room.requests)
            self._sending(room)  # a full prefix hit sends its metadata only
            return [self._destination_or_notice(room, rank) for rank in sorted(room.requests)]

    def _destination_or_notice(self, room: Room, rank: int) -> Destination:
        """Decode ranks this rank writes nothing to still get the last chunk's notice."""
        existing = room.destinations.get(rank)
        if existing is not None:
            return existing
        request = room.requests[rank]
        return Destination(request, (), frozenset(), False)

    # -- writes -----------------------------------------------------------------------------

    def begin_write(self, room_id: int, chunk: Chunk | None = None) -> Room | None:
        """A writer is about to write for this request; None: do not (it failed or is
        gone). Every non-None answer must be followed by `end_write`."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.error is not None:
                return None
            room.inflight += 1
            now = self._clock.monotonic()
            if room.first_write_s is None:
                room.first_write_s = now
            if chunk is not None and chunk.is_last and room.last_chunk_first_write_s is None:
                room.last_chunk_first_write_s = now
            if chunk is not None and len(room.chunk_writes) < MAX_STAMPED_CHUNKS:
                room.chunk_writes.setdefault(chunk.index, [now, now])
            return room

    def end_write(
        self,
        room_id: int,
        bytes_sent: int,
        writes: int = 0,
        metadata_done: bool = False,
        batch_failed: bool = False,
        chunk_index: int | None = None,
    ) -> WriteEnd:
        """A write job ended (either way): the drain acks now owed, and whether this job
        completed the request. `batch_failed`: the engine reported a failed batch, some
        of whose writes may still be posted; `chunk_index`: the chunk it wrote, if any."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return WriteEnd(set(), None)
            room.inflight -= 1
            room.bytes_sent += bytes_sent
            room.writes_posted += writes
            now = self._clock.monotonic()
            stamps = None if chunk_index is None else room.chunk_writes.get(chunk_index)
            if stamps is not None:
                stamps[1] = now
            if batch_failed:
                room.quarantine_until_s = now + self.quarantine_s
            elif bytes_sent and room.error is None:
                self._states.progressed(room_id)
            completed = None
            if metadata_done and room.error is None:
                room.metadata_pending -= 1
                if room.metadata_pending == 0:
                    room.done_s = now
                    self._end(room, _P.DONE)
                    completed = room
            return WriteEnd(self._settle(room), completed)

    # -- failures ---------------------------------------------------------------------------

    def fail(
        self, room_id: int, reason: str, state: PrefillState = _P.FAILED
    ) -> list[TransferRequest]:
        """Stops the request's writes; returns the decode ranks to tell (first failure only)."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None or room.error is not None:
                return []
            self._stop(room, reason, state)
            return list(room.requests.values())

    def abort(
        self, room_id: int, reason: str, ack_to: str | None, decoder_instance: int | None
    ) -> set[str] | None:
        """A decoder's abort (`decoder_instance`: the sending decode rank), or SGLang's own
        (None). Returns inboxes to drain-ack now (later acks come from `end_write` once the
        writes in flight ended), or None when refused: other decode ranks asked for it."""
        with self._lock:
            room = self._rooms.get(room_id)
            owners = {q.decoder.instance for q in room.requests.values()} if room else set()
            if (
                room is not None
                and decoder_instance is not None
                and owners
                and decoder_instance not in owners
            ):
                if len(room.requests) < (room.decoder_tp or 0):
                    # Another rank of the request's decoder whose TransferRequest has not
                    # come (it was resent, and its abort overtook it): this rank never
                    # wrote to it and never will - the copy is refused when it comes -
                    # so its abort is acked, and nothing else changes.
                    room.aborted_early.add(decoder_instance)
                    return {ack_to} if ack_to else set()
                return None
            if room is None:
                # Nothing of it is or will be in flight. Remember it failed, so that the
                # router's copy, if it comes later, fails at once instead of waiting
                # (unless too many such records exist: then that copy times out).
                if self._unowned() >= MAX_UNOWNED_ROOMS:
                    return {ack_to} if ack_to else set()
                room = self._room(room_id)
                room.error = reason
                self._end(room, _P.ABORTED)
                return {ack_to} if ack_to else set()
            if room.error is None:
                room.error = reason
                self._end(room, _P.ABORTED)
            if ack_to:
                room.acks_owed.add(ack_to)
            return self._settle(room)

    def abort_own(self, room_id: int, reason: str) -> list[TransferRequest]:
        """SGLang aborts the request itself: it stops like a decoder's abort; returns the
        decode ranks to tell (they would otherwise wait for KV until their timeout)."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return []
            room.released = True
            if room.error is not None:
                return []
            self._stop(room, reason, _P.ABORTED)
            return list(room.requests.values())

    def decoder_lost(self, inbox: str, why: str) -> list[tuple[int, list[TransferRequest]]]:
        """A decode rank is lost: fail every request writing to it. Returns (room, the
        room's *other* decode ranks): they must hear, or they wait for KV that never
        comes until their transfer timeout."""
        with self._lock:
            rooms = [
                r
                for r in self._rooms.values()
                if self._live(r) and any(q.decoder_inbox == inbox for q in r.requests.values())
            ]
            out = []
            for room in rooms:
                room.acks_owed.discard(inbox)
                self._stop(room, why, _P.FAILED)
                others = [q for q in room.requests.values() if q.decoder_inbox != inbox]
                out.append((room.room, others))
            return out

    def expire(self) -> list[tuple[int, str]]:
        """Requests past their state's deadline, now TIMED_OUT: (room, reason)."""
        with self._lock:
            out = []
            for e in self._states.poll_timeouts():
                room = self._rooms[e.request_id]
                if e.state is _P.WAITING_FOR_DECODER and room.requests:
                    why = (
                        f"{len(room.requests)} of request {room.room}'s {room.decoder_tp} decode"
                        f" ranks asked for it, the others not within {self.timeout_s:g} s: they"
                        " wait for receive staging (raise --pd-staging-mb) or are stuck"
                    )
                elif e.state is _P.WAITING_FOR_DECODER:
                    why = (
                        f"no decoder asked for request {room.room} within {self.timeout_s:g} s:"
                        " the decode server waits for receive staging (raise --pd-staging-mb),"
                        " or does not reach this prefiller's bootstrap port"
                    )
                else:
                    why = (
                        f"request {room.room} made no progress for {e.waited_s:.1f} s "
                        f"({e.state.value})"
                    )
                room.error = why
                room.ended_s = self._clock.monotonic()
                self._settle(room)
                out.append((room.room, why))
            return out

    def settle_quarantined(self) -> list[tuple[int, set[str]]]:
        """Requests whose failed-batch quarantine ended: (room, drain acks now owed)."""
        with self._lock:
            now = self._clock.monotonic()
            out = []
            for room in self._rooms.values():
                until = room.quarantine_until_s
                if until is not None and now >= until:
                    room.quarantine_until_s = None
                    room.ended_s = now  # SGLang's poll gets its grace from now
                    acks = self._settle(room)
                    if acks:
                        out.append((room.room, acks))
            return out

    # -- SGLang's view ----------------------------------------------------------------------

    def state(self, room_id: int) -> tuple[PrefillState, bool, str | None] | None:
        """(state, drained, error) or None when unknown. Drained: no write in flight."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return None
            return self._states.state(room_id), self._drained(room), room.error

    def forget(self, room_id: int) -> Room | None:
        """SGLang is done with the request (it no longer holds pages for it)."""
        with self._lock:
            room = self._rooms.get(room_id)
            if room is None:
                return None
            if not self._drained(room):
                # SGLang gave up on it while writes run: they stop, and the request
                # stays until they ended (its pins with it); `sweep` drops it then
                room.released = True
                if room.error is None:
                    room.error = "dropped by the prefill scheduler"
                    self._end(room, _P.FAILED)
                return room
            del self._rooms[room_id]
            self._states.forget(room_id)
            self.pins.unpin(room_id)
            return room

    def sweep(self) -> int:
        """Drops final, drained requests SGLang will not conclude: no SGLang sender
        claimed it (a decoder asked, the router's copy never came), or SGLang released it
        on a path that stops polling (its own aborts, a clear while writes ran). A grace
        period after they ended: bounded memory whatever peers send and whatever SGLang
        does. A request SGLang still holds stays, however long its prefill runs: its next
        poll must find it. Returns how many."""
        with self._lock:
            now = self._clock.monotonic()
            stale = [
                r.room
                for r in self._rooms.values()
                if (r.released or not r.owned)
                and r.ended_s is not None
                and self._drained(r)
                and now - r.ended_s > UNOWNED_GRACE_S
            ]
            for room_id in stale:
                del self._rooms[room_id]
                self._states.forget(room_id)
                self.pins.unpin(room_id)
            return len(stale)

    def frozen(self) -> bool:
        """This process was stopped about as long as the hang timeout and the liveness
        thread has not beaten since: nothing may be written (the writers fail the
        request instead)."""
        return self._freeze is not None and self._freeze.frozen()

    def freeze_limit_s(self) -> float:
        return 0.0 if self._freeze is None else self._freeze.limit_s

    def counts(self) -> tuple[int, int]:
        """(requests known, write jobs in flight), for the gauges and the pool line."""
        with self._lock:
            return len(self._rooms), sum(r.inflight for r in self._rooms.values())

    def active_decoders(self) -> dict[str, str | None]:
        """Inbox -> transfer session of the decode ranks this rank has live requests with
        (for liveness)."""
        with self._lock:
            return {
                q.decoder_inbox: q.decoder.session
                for r in self._rooms.values()
                if self._live(r) or r.inflight
                for q in r.requests.values()
            }

    def fail_all(self, why: str) -> list[list[TransferRequest]]:
        """Fails every live request (this process was frozen past the hang timeout);
        returns each one's decode ranks to tell."""
        with self._lock:
            rooms = [r for r in self._rooms.values() if self._live(r)]
            for room in rooms:
                self._stop(room, why, _P.FAILED)
            return [list(room.requests.values()) for room in rooms]

    def rooms_of(self, room_ids: Iterable[int]) -> list[Room]:
        with self._lock:
            return [r for i in room_ids if (r := self._rooms.get(i)) is not None]

    def mark_forward_end(self, room_ids: Iterable[int], at_s: float) -> None:
        """The forward of these requests' last chunk had ended by `at_s`: the latest of
        the stamps given wins (``run_batch`` returning stamps only the launch under the
        overlap scheduler; the layer streamer stamps when the device reported the last
        layer)."""
        with self._lock:
            for room_id in room_ids:
                room = self._rooms.get(room_id)
                if room is not None:
                    room.forward_end_s = max(at_s, room.forward_end_s or at_s)

    # -- lock held --------------------------------------------------------------------------

    def _room(self, room_id: int) -> Room:
        room = self._rooms.get(room_id)
        if room is None:
            room = self._rooms[room_id] = Room(room_id, self._clock.monotonic())
            self._states.add(room_id)
        return room

    def _unowned(self) -> int:
        return sum(1 for r in self._rooms.values() if not r.owned)

    def _live(self, room: Room) -> bool:
        return not PREFILL_TABLE.is_final(self._states.state(room.room))

    def _sending(self, room: Room) -> None:
        if self._states.state(room.room) is _P.READY:
            self._states.transition(room.room, _P.SENDING)

    def _end(self, room: Room, state: PrefillState) -> None:
        current = self._states.state(room.room)
        if not PREFILL_TABLE.is_final(current):
            self._states.transition(room.room, state)
        room.ended_s = self._clock.monotonic()

    def _stop(self, room: Room, why: str, state: PrefillState) -> None:
        """The request ends here with `why`: no write starts for it any more, and what
        `_settle` allows happens now (a live request owes no drain acks yet)."""
        room.error = why
        self._end(room, state)
        self._settle(room)

    def _drained(self, room: Room) -> bool:
        """No write of the request is running or may still land."""
        return room.inflight == 0 and room.quarantine_until_s is None

    def _settle(self, room: Room) -> set[str]:
        """The one answer to "may its pages be freed?" (see the module's docstring):
        once the request is final and drained its pins go and its drain acks are due.
        Returns the decoder inboxes to ack now."""
        if not (self._drained(room) and PREFILL_TABLE.is_final(self._states.state(room.room))):
            return set()
        self.pins.unpin(room.room)
        if room.error is None or not room.acks_owed:
            return set()
        acks, room.acks_owed = room.acks_owed, set()
        return acks


def _prompt_mismatch(room: Room) -> str | None:
    computed = room.prompt_tokens
    if computed is None:
        return None
    if room.held_tokens > computed:
        return (
            f"the decoder holds {room.held_tokens} tokens of a prompt whose prefill computes"
            f" {computed}: start the decode server through sgl_pd.launch_server with the"
            " installed patches (launch/install.sh)"
        )
    expected = {r.kv_tokens for r in room.requests.values() if r.kv_tokens is not None}
    if expected and expected != {computed}:
        return (
            f"the prefill server computes the KV of {computed} prompt tokens and the decoder"
            f" expects {', '.join(str(t) for t in sorted(expected))}: the two servers read"
            " the request's prompt differently"
        )
    return None
