"""Completion by counting (D10): write groups, per-source count words, the decoder's counter.

Mooncake has no receiver-side counter, so the unit counted is a *write group*: all data
writes of one (source shard, destination shard, chunk, layer group). The decoder cannot
count data writes themselves (coalescing depends on the *source* page ids, which it never
sees), but groups depend only on what it knows - the prefiller's scheme, its own, the
request seed, the layer grouping and the chunk count:

    groups per chunk from one source = its links into this destination * num_layer_groups

and, for a model with state besides the KV pages (a Mamba slot, a sliding window's
pages), one *state group* from each source that writes some of the destination's state
(`core.state_slices.writers_into`), after the request's last chunk: its count word then
ends at chunks * groups per chunk + 1. A source may write state into a destination it
sends no KV (TP splits state and KV heads apart): it then counts the state group alone.

Count words. Each decoder rank keeps one slot of SLOT_WORDS 8-byte words per request in
registered memory. Word METADATA_WORD holds the metadata word (D9), written once by the
source `expectation_for` names. Word 1 + src_rank holds that source's *count*: how many of
the request's groups it has finished into this destination rank so far. A source sends the
groups of one (request, destination rank) serially from one thread and writes its count
after each finished data batch, so the value it writes only grows; the decoder needs just
the latest value it reads, never every write.

Ordering argument. A count c is written only after the data batches of its first c groups
have completed (`batch_transfer_sync_write` returned), and that word write is itself
waited for before the next batch starts. So a visible count c implies those groups' data
has landed, and an older (lower) count cannot land after a newer one. On fabrics where a
completion does not prove GPU visibility (EFA) the edge must add a fence/flush first.

A word holds (tag << 32) | count, tag = low 32 bits of the request id, so a late word from
an earlier request that used the slot is recognised and ignored (the counter keeps the
highest count it saw). The slot size depends only on the number of source ranks, never on
chunks or layers: a prompt of any length fits.
"""

from __future__ import annotations

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
MAX_SOURCE_RANKS = 255  # prefill TP ranks a slot can count
SLOT_WORDS = 1 + MAX_SOURCE_RANKS  # words per request slot on the decoder (2 KiB)
_TAG_MASK = 0xFFFF_FFFF  # low 32 bits: the count; also the metadata word's low half


@dataclass(frozen=True)
class WriteGroup:
    """One unit of counting: the writes of one link for one chunk and one layer group."""

    src_rank: int
    dst_rank: int
    chunk_index: int
    layer_group: int
    layers: range
    link_index: int  # index of the link in the tuple the groups were made from


def chunk_groups(
    links: tuple[ShardLink, ...], chunk_index: int, layer_groups: tuple[range, ...]
) -> tuple[WriteGroup, ...]:
    """Every group of one chunk, in issue order (layer group, then link)."""
    if chunk_index < 0:
        raise CountingError(f"chunk index must be >= 0, got {chunk_index}")
    return tuple(
        WriteGroup(link.src_rank, link.dst_rank, chunk_index, g, layers, li)
        for g, layers in enumerate(layer_groups)
        for li, link in enumerate(links)
    )


def source_word_index(src_rank: int) -> int:
    """Index of source `src_rank`'s count word inside a request slot."""
    if not 0 <= src_rank < MAX_SOURCE_RANKS:
        raise CountingError(
            f"source rank {src_rank} outside [0, {MAX_SOURCE_RANKS}): a slot counts at most"
            f" {MAX_SOURCE_RANKS} prefill ranks"
        )
    return 1 + src_rank


def source_word_offset(src_rank: int) -> int:
    """Byte offset of source `src_rank`'s count word inside a request slot."""
    return source_word_index(src_rank) * WORD_BYTES


def count_word(request_id: int, count: int) -> int:
    """The 64-bit word a source writes once `count` groups of `request_id` have completed."""
    if not 1 <= count < _TAG_MASK:
        raise CountingError(f"count {count} does not fit a count word: need 1 <= count < 2**32-1")
    return ((request_id & _TAG_MASK) << 32) | count


def metadata_word(request_id: int) -> int:
    return ((request_id & _TAG_MASK) << 32) | _TAG_MASK


def parse_count_word(word: int, request_id: int) -> int | None:
    """Count carried by `word`, or None if it is empty, the metadata value, or another
    request's (a late word from an earlier user of the slot)."""
    if word == 0 or (word >> 32) != (request_id & _TAG_MASK):
        return None
    low = word & _TAG_MASK
    return None if low in (0, _TAG_MASK) else low


@dataclass(frozen=True)
class Expectation:
    """What a decoder expects for one request, before it knows the number of chunks."""

    per_chunk: tuple[tuple[int, int], ...]  # (source rank, groups per chunk), sorted
    metadata_source: int  # the source that writes the metadata word
    state_writers: tuple[int, ...] = ()  # sources that count one state group, sorted

    @property
    def groups_per_chunk(self) -> int:
        return sum(n for _, n in self.per_chunk)

    @property
    def sources(self) -> tuple[int, ...]:
        """Every source whose count word the destination reads, ascending."""
        return tuple(sorted({src for src, _ in self.per_chunk} | set(self.state_writers)))

    def total(self, num_chunks: int) -> int:
        """Groups of the whole request (the metadata word not included)."""
        return num_chunks * self.groups_per_chunk + len(self.state_writers)

    def owed(self, src_rank: int, num_chunks: int) -> int:
        """Groups `src_rank` counts in all for a request of `num_chunks` chunks."""
        per_chunk = dict(self.per_chunk).get(src_rank, 0)
        return num_chunks * per_chunk + (src_rank in self.state_writers)


def expected_groups(
    layout: KvLayout,
    prefill: ShardingScheme,
    decode: ShardingScheme,
    seed: int,
    layer_group_size: int,
) -> Expectation:
    """Groups each prefill shard sends per chunk, over every destination rank together."""
    links = link_shards(layout, prefill, decode, seed)
    num_groups = len(layout.layer_groups(layer_group_size))
    per_src: dict[int, int] = {}
    for link in links:
        per_src[link.src_rank] = per_src.get(link.src_rank, 0) + num_groups
    return Expectation(tuple(sorted(per_src.items())), metadata_source(links))


class CompletionCounter:
    """One request's progress on one decoder rank: the latest count of every source.

    Counts may be observed in any interleaving across sources, and any count may be missed
    (only the latest matters), but one source's counts never go down. Before the chunk
    count is known (`seal`) any count is accepted; sealing checks none exceeds its total.
    """

    def __init__(
        self, expectation: Expectation, *, expect_metadata: bool = True, expect_kv: bool = True
    ) -> None:
        """`expect_kv`: the request has KV to receive; False when the destination holds
        every token the prefiller computes (its prefix cache): then exactly zero chunks
        come, and only the metadata (or nothing)."""
        for src in expectation.sources:
            source_word_index(src)  # raises for a rank a slot cannot count
        self._expectation = expectation
        self._counts: dict[int, int] = dict.fromkeys(expectation.sources, 0)
        self._metadata_source = expectation.metadata_source
        self._num_chunks: int | None = None  # set by `seal`
        # source -> the groups it counts in all, once sealed (read at every observed count)
        self._owed: dict[int, int] = {}
        self._metadata_pending = expect_metadata
        self._expect_kv = expect_kv

    @property
    def received(self) -> int:
        """Groups counted so far, over every source."""
        return sum(self._counts.values())

    @property
    def expected(self) -> int | None:
        """Total groups once sealed, else None."""
        if self._num_chunks is None:
            return None
        return self._expectation.total(self._num_chunks)

    @property
    def is_complete(self) -> bool:
        return not self._metadata_pending and self.received == self.expected

    def seal(self, num_chunks: int) -> None:
        """The request has exactly `num_chunks` chunks (from the last chunk notice)."""
        if self._expect_kv and num_chunks < 1:
            raise CountingError(f"a request with KV to receive has a chunk, got {num_chunks}")
        if not self._expect_kv and num_chunks != 0:
            raise CountingError(
                f"the destination holds every token, yet {num_chunks} chunk(s) were announced"
            )
        if self._num_chunks is not None and num_chunks != self._num_chunks:
            raise CountingError(f"sealed twice: {self._num_chunks} then {num_chunks} chunks")
        owed = {src: self._expectation.owed(src, num_chunks) for src in self._counts}
        for src, count in self._counts.items():
            if count > owed[src]:
                raise CompletionOverflow(
                    f"source {src} counted {count} groups but {num_chunks} chunks hold {owed[src]}"
                )
        self._num_chunks, self._owed = num_chunks, owed

    def observe(self, src_rank: int, count: int) -> bool:
        """Takes the latest count read from `src_rank`'s word; returns `is_complete`."""
        last = self._counts.get(src_rank)
        if last is None:
            raise UnknownSource(
                f"source {src_rank} has no link here (expected {sorted(self._counts)})"
            )
        if count < last:
            raise CountingError(f"source {src_rank} count went down from {last} to {count}")
        if self._num_chunks is not None and count > self._owed[src_rank]:
            raise CompletionOverflow(
                f"source {src_rank} counted {count} groups, only {self._owed[src_rank]} exist"
            )
        self._counts[src_rank] = count
        return self.is_complete

    def source_done(self, src_rank: int) -> bool:
        """`src_rank` has nothing more to write here: it has no link to this rank, or
        every group it owes (and the metadata, if it writes it) was counted."""
        if src_rank == self._metadata_source and self._metadata_pending:
            return False
        if src_rank not in self._counts:
            return True
        return self._num_chunks is not None and self._counts[src_rank] == self._owed[src_rank]

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
    """The links of one destination rank: what its prefill sources send it, and so which
    count words it watches.

    In the router flow each decoder rank asks for its own pages, so a source counts the
    groups of each destination rank separately and both sides use these links.
    """
    into = tuple(link for link in links if link.dst_rank == dst_rank)
    if not into:
        raise CountingError(f"no link reaches destination rank {dst_rank}")
    return into


def expectation_for(
    links: tuple[ShardLink, ...], num_layer_groups: int, state_writers: tuple[int, ...] = ()
) -> Expectation:
    """What one destination expects from `links` (all into it): groups per chunk per
    source, the source that writes its metadata (the one sending its first head), and
    the sources that write some of its state (`state_writers`, one group each)."""
    if not links or len({link.dst_rank for link in links}) != 1:
        raise CountingError("expectation_for takes the links of exactly one destination")
    per_src: dict[int, int] = {}
    for link in links:
        per_src[link.src_rank] = per_src.get(link.src_rank, 0) + num_layer_groups
    first = min(links, key=lambda link: (link.head_lo, link.src_rank))
    return Expectation(tuple(sorted(per_src.items())), first.src_rank, tuple(sorted(state_writers)))
