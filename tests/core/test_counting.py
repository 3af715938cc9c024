"""Completion counting (D10): groups, per-source count words, and the decoder's counter."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_pd.core.counting import (
    MAX_SOURCE_RANKS,
    METADATA_WORD,
    SLOT_WORDS,
    WORD_BYTES,
    CompletionCounter,
    Expectation,
    chunk_groups,
    count_word,
    expectation_for,
    expected_groups,
    links_into,
    metadata_word,
    parse_count_word,
    source_word_index,
    source_word_offset,
)
from sgl_pd.core.errors import (
    CompletionOverflow,
    CountingError,
    DuplicateCompletion,
    UnknownSource,
)
from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.sharding import ShardingScheme, link_shards

LAYOUT = KvLayout.gqa(
    num_layers=7,
    num_kv_heads=8,
    head_dim=4,
    page_size=4,
    elem_bytes=2,
    page_layout=PageLayout.HND,
)


@settings(max_examples=100, deadline=None)
@given(
    tp_p=st.sampled_from([1, 2, 4, 8]),
    tp_d=st.sampled_from([1, 2, 4, 8]),
    group_size=st.integers(1, 7),
    chunks=st.integers(1, 4),
    seed=st.integers(0, 2**32),
)
def test_groups_match_the_expectations(
    tp_p: int, tp_d: int, group_size: int, chunks: int, seed: int
) -> None:
    links = link_shards(LAYOUT, ShardingScheme(tp_p), ShardingScheme(tp_d), seed)
    layer_groups = LAYOUT.layer_groups(group_size)
    groups = [g for c in range(chunks) for g in chunk_groups(links, c, layer_groups)]
    assert len(groups) == chunks * len(layer_groups) * len(links)
    for g in groups:
        link = links[g.link_index]
        assert (g.src_rank, g.dst_rank) == (link.src_rank, link.dst_rank)
        assert g.layers == layer_groups[g.layer_group]
    per_src: dict[int, int] = {}
    for g in groups:
        per_src[g.src_rank] = per_src.get(g.src_rank, 0) + 1
    exp = expected_groups(LAYOUT, ShardingScheme(tp_p), ShardingScheme(tp_d), seed, group_size)
    assert exp.total(chunks) == len(groups)
    assert dict(exp.per_chunk) == {s: n // chunks for s, n in per_src.items()}
    # per destination: what each source counts into it, and the sum over destinations
    total = 0
    for dst in range(tp_d):
        into = links_into(links, dst)
        mine = expectation_for(into, len(layer_groups))
        want = {
            s: sum(1 for g in groups if (g.src_rank, g.dst_rank) == (s, dst)) // chunks
            for s in {link.src_rank for link in into}
        }
        assert dict(mine.per_chunk) == want
        total += mine.total(chunks)
    assert total == len(groups)


def test_chunk_groups_rejects_negative_chunks() -> None:
    links = link_shards(LAYOUT, ShardingScheme(2), ShardingScheme(2), 0)
    with pytest.raises(CountingError):
        chunk_groups(links, -1, LAYOUT.layer_groups(2))


def test_slot_layout() -> None:
    assert SLOT_WORDS * WORD_BYTES == 2048
    assert METADATA_WORD == 0
    assert source_word_index(0) == 1
    assert source_word_index(MAX_SOURCE_RANKS - 1) == SLOT_WORDS - 1
    assert source_word_offset(3) == 4 * WORD_BYTES
    for bad in (-1, MAX_SOURCE_RANKS):
        with pytest.raises(CountingError):
            source_word_index(bad)
        with pytest.raises(CountingError):
            source_word_offset(bad)
    with pytest.raises(CountingError):  # a slot cannot count this source
        CompletionCounter(Expectation(((MAX_SOURCE_RANKS, 1),), MAX_SOURCE_RANKS))


def test_count_words() -> None:
    rid = (0xABCD << 32) | 0x1234_5678
    word = count_word(rid, 41)
    assert word == (0x1234_5678 << 32) | 41
    assert parse_count_word(word, rid) == 41
    assert parse_count_word(word, rid + 1) is None  # stale word of another request
    assert parse_count_word(0, rid) is None
    assert parse_count_word(metadata_word(rid), rid) is None
    assert parse_count_word(rid & 0xFFFF_FFFF_0000_0000, rid) is None  # tag, count 0
    assert parse_count_word(count_word(rid, 2**32 - 2), rid) == 2**32 - 2
    for bad in (0, -1, 2**32 - 1, 2**32):
        with pytest.raises(CountingError):
            count_word(rid, bad)


@given(
    rid=st.integers(0, 2**64 - 1),
    other=st.integers(0, 2**64 - 1),
    count=st.integers(1, 2**32 - 2),
)
def test_another_requests_word_parses_as_none(rid: int, other: int, count: int) -> None:
    word = count_word(other, count)
    if (other ^ rid) & 0xFFFF_FFFF:  # different tags
        assert parse_count_word(word, rid) is None
        assert parse_count_word(metadata_word(other), rid) is None
    else:
        assert parse_count_word(word, rid) == count


EXP = Expectation(per_chunk=((0, 2), (3, 1)), metadata_source=3)


def test_counter_counts_and_completes() -> None:
    c = CompletionCounter(EXP)
    assert not c.observe(0, 3)
    assert not c.observe(3, 1)
    assert not c.observe(0, 3)  # the same count read again
    assert c.received == 4 and c.expected is None
    c.seal(2)
    assert c.expected == 6
    assert not c.observe(0, 4)
    assert not c.is_complete  # source 3 still owes one group, and the metadata
    assert not c.observe(3, 2)
    assert c.record_metadata(3)
    assert c.is_complete and c.received == 6


def test_a_full_prefix_hit_counts_no_chunk_and_completes_on_the_metadata() -> None:
    """A decoder that holds every token the prefiller computes named no page: zero
    chunks are announced, and only the metadata word completes the request."""
    held_all = CompletionCounter(EXP, expect_kv=False)
    held_all.seal(0)
    assert held_all.expected == 0 and not held_all.is_complete
    assert held_all.record_metadata(3)
    with pytest.raises(CountingError, match="holds every token"):
        CompletionCounter(EXP, expect_kv=False).seal(1)
    with pytest.raises(CountingError, match="has a chunk"):
        CompletionCounter(EXP).seal(0)


def test_state_groups_count_once_per_writer_after_the_chunks() -> None:
    """Sources 0 and 3 send KV; 3 and 5 write some of the state (5 none of the KV):
    each state writer's count ends one group past its chunks' - also with no chunk."""
    exp = Expectation(((0, 2), (3, 1)), metadata_source=3, state_writers=(3, 5))
    assert exp.sources == (0, 3, 5)
    assert (exp.owed(0, 2), exp.owed(3, 2), exp.owed(5, 2)) == (4, 3, 1)
    c = CompletionCounter(exp)
    c.seal(2)
    assert c.expected == 8
    c.observe(0, 4)
    c.observe(3, 2)  # its chunks, not its state
    assert c.record_metadata(3) is False and not c.source_done(3)
    assert not c.observe(5, 1) and c.source_done(5)
    assert c.observe(3, 3) and c.source_done(3)
    with pytest.raises(CompletionOverflow):
        c.observe(5, 2)
    held_all = CompletionCounter(exp, expect_kv=False)
    held_all.seal(0)
    held_all.record_metadata(3)
    held_all.observe(3, 1)
    assert not held_all.is_complete and held_all.observe(5, 1)


def test_counter_is_complete_only_once_sealed() -> None:
    c = CompletionCounter(EXP, expect_metadata=False)
    c.observe(0, 2)
    assert not c.observe(3, 1)  # one chunk's worth, but the last chunk is not known yet
    c.seal(1)
    assert c.is_complete
    c.seal(1)  # sealing again with the same count is harmless
    assert c.is_complete


def test_counter_rejects_lower_counts_overflow_and_strangers() -> None:
    c = CompletionCounter(EXP)
    c.observe(0, 5)
    with pytest.raises(CountingError):
        c.observe(0, 4)
    with pytest.raises(CountingError):
        c.observe(3, -1)
    with pytest.raises(UnknownSource):
        c.observe(1, 1)
    with pytest.raises(CompletionOverflow):
        c.seal(2)  # source 0 counted 5, only 4 exist in 2 chunks
    c.seal(3)
    with pytest.raises(CompletionOverflow):
        c.observe(0, 7)  # 3 chunks x 2 groups
    with pytest.raises(CompletionOverflow):
        c.observe(3, 4)
    with pytest.raises(CountingError):
        c.seal(2)
    with pytest.raises(CountingError):
        c.seal(4)
    with pytest.raises(UnknownSource):
        c.record_metadata(0)
    c.record_metadata(3)
    with pytest.raises(DuplicateCompletion):
        c.record_metadata(3)
    with pytest.raises(CountingError):
        CompletionCounter(EXP).seal(0)


def test_counter_without_metadata() -> None:
    c = CompletionCounter(EXP, expect_metadata=False)
    c.seal(1)
    c.observe(0, 2)
    assert c.observe(3, 1)
    with pytest.raises(DuplicateCompletion):
        c.record_metadata(3)


def test_long_prompts_fit() -> None:
    """No limit on chunks: 10k chunks x 80 layer groups still count in one slot."""
    exp = Expectation(per_chunk=((0, 80), (1, 80)), metadata_source=0)
    c = CompletionCounter(exp)
    c.seal(10_000)
    c.observe(0, 800_000)
    c.observe(1, 800_000)
    assert c.record_metadata(0)


@st.composite
def interleavings(
    draw: st.DrawFn,
) -> tuple[Expectation, int, list[tuple[int, int]], int, int]:
    """An expectation, a chunk count, and the counts a decoder reads in one interleaving of
    each source's growing sequence (values skipped or read twice, some sources unfinished);
    plus the step at which the seal and the metadata word are seen."""
    ranks = draw(
        st.lists(st.integers(0, MAX_SOURCE_RANKS - 1), min_size=1, max_size=5, unique=True)
    )
    per_chunk = tuple(sorted((r, draw(st.integers(1, 4))) for r in ranks))
    num_chunks = draw(st.integers(1, 4))
    sequences: dict[int, list[int]] = {}
    for r, n in per_chunk:
        total = n * num_chunks
        stop = total if draw(st.booleans()) else draw(st.integers(0, total))
        values = sorted(draw(st.lists(st.integers(1, total), max_size=6)) + [stop] * (stop > 0))
        sequences[r] = values
    reads: list[tuple[int, int]] = []
    while any(sequences.values()):
        r = draw(st.sampled_from(sorted(r for r, v in sequences.items() if v)))
        reads.append((r, sequences[r].pop(0)))
    seal_at = draw(st.integers(0, len(reads)))
    metadata_at = draw(st.integers(-1, len(reads)))  # -1: the metadata word never comes
    exp = Expectation(per_chunk, draw(st.sampled_from(ranks)))
    return exp, num_chunks, reads, seal_at, metadata_at


@settings(max_examples=300, deadline=None)
@given(interleavings())
def test_counter_completes_exactly_when_every_source_is_done(
    case: tuple[Expectation, int, list[tuple[int, int]], int, int],
) -> None:
    exp, num_chunks, reads, seal_at, metadata_at = case
    c = CompletionCounter(exp)
    latest = dict.fromkeys(dict(exp.per_chunk), 0)
    sealed = has_metadata = False
    for step in range(len(reads) + 1):
        if step == seal_at:
            c.seal(num_chunks)
            sealed = True
        if step == metadata_at:
            c.record_metadata(exp.metadata_source)
            has_metadata = True
        if step < len(reads):
            src, count = reads[step]
            c.observe(src, count)
            latest[src] = count
        done = all(latest[s] == n * num_chunks for s, n in exp.per_chunk)
        assert c.is_complete == (sealed and has_metadata and done)
        assert c.received == sum(latest.values())
    assert c.expected == exp.total(num_chunks)
