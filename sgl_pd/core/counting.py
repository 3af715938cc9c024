"""Completion by counting (D10): write groups, completion words and the decoder's counter.

Mooncake has no receiver-side counter, so the unit counted is a *write group*: all data
writes of one (source shard, destination shard, chunk, layer group). After the transfer
engine reports a group's writes complete (`batch_transfer_sync_write` returned), the source
writes one 8-byte *completion word* into the request's completion slot in the decoder's
registered memory. Ordering argument: the word is posted only after the data writes have
completed, so a visible word implies the group's data has landed (on fabrics where a
completion does not prove GPU visibility, e.g. EFA, the edge must add a fence/flush first).

The decoder cannot count data writes themselves: coalescing depends on the contiguity of
the *source* page ids, which it never sees. Groups depend only on what it knows - the
prefiller's scheme, its own, the request seed, the layer grouping and the chunk count:

    groups per chunk = len(links) * num_layer_groups,  independent of pages and tokens

Numbering, shared by both sides (G layer groups, L links sorted by (src, dst)):
    index = (chunk * G + g) * L + link_index           completion word index - 1
    seq   = (chunk * G + g) * L_src + j                 per-source sequence number,
                                                         j = rank of the link among its source's
Slot layout: word 0 = metadata (D9) written once by `metadata_source`; word 1 + index = group.
A word holds (tag << 32) | (index + 1), tag = low 32 bits of the request id, so a late word
from an earlier request that used the slot is recognised and ignored.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sgl_pd.core.errors import (
    CompletionOverflow,
    CountingError,
    DuplicateCompletion,
    UnknownSource,
)
from sgl_pd.core.layout import KvLayout
from sgl_pd.core.sharding import ShardingScheme, ShardLink, link_shards, metadata_source

WORD_BYTES = 8
METADATA_WORD = 0  # word index of the metadata completion inside a slot
_TAG_MASK = 0xFFFF_FFFF


@dataclass(frozen=True)
class WriteGroup:
    """One completion signal: the writes of one link for one chunk and one layer group."""

    src_rank: int
    dst_rank: int
    chunk_index: int
    layer_group: int
    layers: range
    link_index: int
    seq: int  # per-source sequence number
    index: int  # per-request group number; the completion word is 1 + index

    @property
    def word_offset(self) -> int:
        """Byte offset of this group's completion word inside the request's slot."""
        return (1 + self.index) * WORD_BYTES


def _source_positions(links: tuple[ShardLink, ...]) -> tuple[tuple[int, int], ...]:
    """(j, L_src) of every link: its rank among its source's links and their number."""
    totals: dict[int, int] = {}
    for link in links:
        totals[link.src_rank] = totals.get(link.src_rank, 0) + 1
    seen: dict[int, int] = {}
    out = []
    for link in links:
        j = seen.get(link.src_rank, 0)
        seen[link.src_rank] = j + 1
        out.append((j, totals[link.src_rank]))
    return tuple(out)


def chunk_groups(
    links: tuple[ShardLink, ...], chunk_index: int, layer_groups: tuple[range, ...]
) -> tuple[WriteGroup, ...]:
    """Every group of one chunk, in issue order (layer group, then link)."""
    if chunk_index < 0:
        raise CountingError(f"chunk index must be >= 0, got {chunk_index}")
    positions = _source_positions(links)
    num_groups, num_links = len(layer_groups), len(links)
    out = []
    for g, layers in enumerate(layer_groups):
        step = chunk_index * num_groups + g
        for li, (link, (j, per_src)) in enumerate(zip(links, positions, strict=True)):
            out.append(
                WriteGroup(
                    link.src_rank,
                    link.dst_rank,
                    chunk_index,
                    g,
                    layers,
                    li,
                    step * per_src + j,
                    step * num_links + li,
                )
            )
    return tuple(out)


def locate_group(index: int, links: tuple[ShardLink, ...]) -> tuple[int, int]:
    """(src_rank, seq) of group `index`: what a decoder does with a completion word."""
    if index < 0:
        raise CountingError(f"group index must be >= 0, got {index}")
    step, li = divmod(index, len(links))
    j, per_src = _source_positions(links)[li]
    return links[li].src_rank, step * per_src + j


def completion_word(request_id: int, index: int) -> int:
    """The 64-bit word a source writes after group `index` of `request_id` completed."""
    if not 0 <= index < _TAG_MASK:
        raise CountingError(f"group index {index} does not fit a completion word")
    return ((request_id & _TAG_MASK) << 32) | (index + 1)


def metadata_word(request_id: int) -> int:
    return ((request_id & _TAG_MASK) << 32) | _TAG_MASK


def parse_completion_word(word: int, request_id: int) -> int | None:
    """Group index carried by `word`, or None if the word is empty or from another request."""
    if word == 0 or (word >> 32) != (request_id & _TAG_MASK):
        return None
    low = word & _TAG_MASK
    return None if low in (0, _TAG_MASK) else low - 1


@dataclass(frozen=True)
class Expectation:
    """What a decoder expects for one request, before it knows the number of chunks."""

    per_chunk: tuple[tuple[int, int], ...]  # (source rank, groups per chunk), sorted
    metadata_source: int  # the source that writes the metadata word

    @property
    def groups_per_chunk(self) -> int:
        return sum(n for _, n in self.per_chunk)

    def total(self, num_chunks: int) -> int:
        """Groups of the whole request (the metadata word not included)."""
        return num_chunks * self.groups_per_chunk

    def max_chunks(self, slot_bytes: int) -> int:
        """Most chunks whose completion words fit a slot of `slot_bytes` (word 0: metadata).
        A prefiller must not split a request into more; pass it as the counter's limit."""
        return (slot_bytes // WORD_BYTES - 1) // self.groups_per_chunk


def expected_groups(
    layout: KvLayout,
    prefill: ShardingScheme,
    decode: ShardingScheme,
    seed: int,
    layer_group_size: int,
) -> Expectation:
    """Decoder-side count of the groups each prefill shard sends per chunk."""
    links = link_shards(layout, prefill, decode, seed)
    num_groups = len(layout.layer_groups(layer_group_size))
    per_src: dict[int, int] = {}
    for link in links:
        per_src[link.src_rank] = per_src.get(link.src_rank, 0) + num_groups
    return Expectation(tuple(sorted(per_src.items())), metadata_source(links))


class CompletionCounter:
    """Counts one request's completions per source shard, in any order.

    Before the last chunk is known (`seal`), sequence numbers up to `max_chunks` chunks are
    accepted; sealing checks nothing beyond the real total was already counted.
    """

    def __init__(
        self,
        expectation: Expectation,
        *,
        max_chunks: int,
        expect_metadata: bool = True,
    ) -> None:
        if max_chunks < 1:
            raise CountingError(f"max_chunks must be >= 1, got {max_chunks}")
        self._per_chunk: Mapping[int, int] = dict(expectation.per_chunk)
        self._seen: dict[int, set[int]] = {src: set() for src in self._per_chunk}
        self._metadata_source = expectation.metadata_source
        self._chunk_limit = max_chunks
        self._sealed = False
        self._metadata_pending = expect_metadata

    @property
    def received(self) -> int:
        return sum(len(s) for s in self._seen.values())

    @property
    def expected(self) -> int | None:
        """Total groups once sealed, else None."""
        if not self._sealed:
            return None
        return self._chunk_limit * sum(self._per_chunk.values())

    @property
    def is_complete(self) -> bool:
        return self._sealed and not self._metadata_pending and self.received == self.expected

    def seal(self, num_chunks: int) -> None:
        """The request has exactly `num_chunks` chunks (from the last chunk notice)."""
        if num_chunks < 1 or num_chunks > self._chunk_limit:
            raise CompletionOverflow(f"{num_chunks} chunks, the limit is {self._chunk_limit}")
        if self._sealed and num_chunks != self._chunk_limit:
            raise CountingError(f"sealed twice: {self._chunk_limit} then {num_chunks} chunks")
        for src, seen in self._seen.items():
            limit = num_chunks * self._per_chunk[src]
            if seen and max(seen) >= limit:
                raise CompletionOverflow(
                    f"source {src} sent group {max(seen)} but only {limit} exist"
                )
        self._chunk_limit, self._sealed = num_chunks, True

    def record(self, src_rank: int, seq: int) -> bool:
        """Count one group; returns `is_complete`."""
        if src_rank not in self._seen:
            raise UnknownSource(
                f"source {src_rank} has no link here (expected {sorted(self._seen)})"
            )
        limit = self._chunk_limit * self._per_chunk[src_rank]
        if not 0 <= seq < limit:
            raise CompletionOverflow(f"source {src_rank} group {seq} outside [0, {limit})")
        seen = self._seen[src_rank]
        if seq in seen:
            raise DuplicateCompletion(f"source {src_rank} group {seq} counted twice")
        seen.add(seq)
        return self.is_complete

    def record_metadata(self, src_rank: int) -> bool:
        if src_rank != self._metadata_source:
            raise UnknownSource(
                f"metadata from source {src_rank}, expected {self._metadata_source}"
            )
        if not self._metadata_pending:
            raise DuplicateCompletion("metadata completion counted twice (or not expected)")
        self._metadata_pending = False
        return self.is_complete


def links_into(links: tuple[ShardLink, ...], dst_rank: int) -> tuple[ShardLink, ...]:
    """The links of one destination rank, in the order both sides number its groups.

    In the router flow each decoder rank asks for its own pages, so the prefiller numbers
    the groups of each destination rank separately and both sides use these links.
    """
    into = tuple(link for link in links if link.dst_rank == dst_rank)
    if not into:
        raise CountingError(f"no link reaches destination rank {dst_rank}")
    return into


def expectation_for(links: tuple[ShardLink, ...], num_layer_groups: int) -> Expectation:
    """What one destination expects from `links` (all into it): groups per chunk per
    source, and the source that writes its metadata (the one sending its first head)."""
    if not links or len({link.dst_rank for link in links}) != 1:
        raise CountingError("expectation_for takes the links of exactly one destination")
    per_src: dict[int, int] = {}
    for link in links:
        per_src[link.src_rank] = per_src.get(link.src_rank, 0) + num_layer_groups
    first = min(links, key=lambda link: (link.head_lo, link.src_rank))
    return Expectation(tuple(sorted(per_src.items())), first.src_rank)
