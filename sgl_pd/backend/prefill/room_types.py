"""The records of a prefill rank's requests: `Room` (one request), `Destination` (one decode
rank it writes to), `Chunk` (one prefill chunk of it) and `WriteEnd` (what a write job's
end settled).

Plain data: `PrefillRooms` reads and changes them under its lock, except the fields marked
as the writer thread's, which only the destination's writer thread touches.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sgl_pd.core.page_ids import PageIds
from sgl_pd.core.plan import AddressedPlan, TokenRange
from sgl_pd.core.sharding import ShardLink
from sgl_pd.core.state_slices import Block
from sgl_pd.core.states import MetadataWait
from sgl_pd.core.wire import TransferRequest


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


@dataclass(frozen=True)
class StreamedState:
    """A request's state slots on this rank, read before its last chunk's forward, for
    layer-wise streaming: each state layer's share goes once the forward finished that
    layer (`core.layer_steps`). SGLang names the slots again in its last send, after the
    forward; where it names others (`PrefillMessenger._streamed_state_differs`), every
    region goes again from those (`Room.state_renamed`)."""

    ids: PageIds  # every component's slots, concatenated (may still be on their way)
    lengths: tuple[int, ...]  # slots of each component

    def slots(self) -> tuple[np.ndarray, ...]:
        """(slots,) int64 per component; the first call may wait for their copy."""
        return self._split

    @functools.cached_property
    def _split(self) -> tuple[np.ndarray, ...]:
        # (asked by every state layer's job of every destination, and at the last send:
        # split once; two threads racing here compute the same views)
        ids = self.ids.array()
        cuts = np.cumsum((0, *self.lengths))
        return tuple(ids[a:b] for a, b in itertools.pairwise(cuts))


@dataclass
class Destination:
    """One decode rank that a request's KV (or state) goes to from this prefill rank."""

    request: TransferRequest
    links: tuple[ShardLink, ...]  # every link into that decode rank, in counting order
    mine: frozenset[int]  # indices into `links` of the ones this rank writes
    writes_metadata: bool  # this rank writes the decode rank's metadata row (D9)
    # the blocks this rank writes of each slot of the decode rank's state besides the
    # KV (its share of a Mamba slot, of each window page: `core.state_slices`), per
    # component and region; () when it writes none. Counted as one group.
    state_blocks: tuple[tuple[tuple[Block, ...], ...], ...] = ()
    # the regions of each component whose share was written already, layer by layer
    # during the last chunk's forward (writer thread only); the rest go after it
    state_written: dict[int, set[int]] = field(default_factory=dict)
    # after the forward: per component, its leading slot pairs written for every region
    # already, with an earlier chunk's KV (`Room.state_so_far`; writer thread only)
    state_slots_written: dict[int, int] = field(default_factory=dict)
    state_bytes_early: int = 0  # of its state, written with earlier chunks (writer only)
    state_bytes_after: int = 0  # of its state, written after that forward (writer only)
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
    def writes_state(self) -> bool:
        return bool(self.state_blocks)

    @property
    def session(self) -> str:
        return self.request.decoder.session


@dataclass
class Room:
    """One request (SGLang's bootstrap room) on this prefill rank."""

    room: int
    created_s: float
    owned: bool = False  # SGLang holds a sender for it (else only a decoder asked so far)
    requests: dict[int, TransferRequest] = field(default_factory=dict)  # by decode rank
    destinations: dict[int, Destination] = field(default_factory=dict)  # ranks we write to
    decoder_tp: int | None = None
    aux_index: int | None = None  # this rank's metadata row
    # this rank's state slots, one list per component (a Mamba slot, the sliding
    # window's pages, ...), from the last send; None until then
    state_slots: tuple[tuple[int, ...], ...] | None = None
    # layer-wise: the same slots, read before the last chunk's forward; None: not read
    streamed_state: StreamedState | None = None
    # after the forward: per component, the leading slots of those lists whose bytes
    # the forwards so far made final (the sliding window's pages of the chunks done; a
    # Mamba slot is final only after the last), read at each send before the last; they
    # go with that send's KV (`PrefillRooms.state_so_far`)
    state_so_far: tuple[tuple[int, ...], ...] | None = None
    # SGLang named other slots after that forward, or at a later send than at an
    # earlier one (its prefix cache swapped the request's pages for the tree's, of the
    # same KV): every region is written again from the last named, after the forward
    state_renamed: bool = False
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
    """What `PrefillRooms.end_write` settled."""

    acks: set[str]  # decoder inboxes owed a drain ack now
    completed: Room | None  # the request, if this job was its last
