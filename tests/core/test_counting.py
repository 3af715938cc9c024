"""Completion counting (D10): numbering, words, and the decoder's counter."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_pd.core.counting import (
    WORD_BYTES,
    CompletionCounter,
    Expectation,
    chunk_groups,
    completion_word,
    expected_groups,
    locate_group,
    metadata_word,
    parse_completion_word,
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
def test_numbering_is_dense_and_invertible(
    tp_p: int, tp_d: int, group_size: int, chunks: int, seed: int
) -> None:
    links = link_shards(LAYOUT, ShardingScheme(tp_p), ShardingScheme(tp_d), seed)
    layer_groups = LAYOUT.layer_groups(group_size)
    groups = [g for c in range(chunks) for g in chunk_groups(links, c, layer_groups)]
    assert sorted(g.index for g in groups) == list(range(len(groups)))
    per_src: dict[int, list[int]] = {}
    for g in groups:
        per_src.setdefault(g.src_rank, []).append(g.seq)
        assert locate_group(g.index, links) == (g.src_rank, g.seq)
        assert g.word_offset == (1 + g.index) * WORD_BYTES
    for seqs in per_src.values():
        assert sorted(seqs) == list(range(len(seqs)))  # dense per source, so overflow is exact
    exp = expected_groups(LAYOUT, ShardingScheme(tp_p), ShardingScheme(tp_d), seed, group_size)
    assert exp.total(chunks) == len(groups)
    assert dict(exp.per_chunk) == {s: len(q) // chunks for s, q in per_src.items()}
    slot_bytes = (1 + len(groups)) * WORD_BYTES  # exactly fits these chunks
    assert exp.max_chunks(slot_bytes) == chunks
    assert max(g.word_offset for g in groups) == slot_bytes - WORD_BYTES


def test_completion_words() -> None:
    rid = (0xABCD << 32) | 0x1234_5678
    word = completion_word(rid, 41)
    assert parse_completion_word(word, rid) == 41
    assert parse_completion_word(word, rid + 1) is None  # stale word of another request
    assert parse_completion_word(0, rid) is None
    assert parse_completion_word(metadata_word(rid), rid) is None
    with pytest.raises(CountingError):
        completion_word(rid, 2**32)


def _counter(max_chunks: int = 3, metadata: bool = True) -> CompletionCounter:
    exp = Expectation(per_chunk=((0, 2), (3, 1)), metadata_source=3)
    return CompletionCounter(exp, max_chunks=max_chunks, expect_metadata=metadata)


def test_counter_out_of_order_and_complete() -> None:
    c = _counter()
    for src, seq in [(0, 3), (3, 1), (0, 0), (0, 2), (3, 0)]:
        assert not c.record(src, seq)
    assert c.received == 5 and c.expected is None
    c.seal(2)
    assert c.expected == 6
    assert not c.record(0, 1)
    assert c.record_metadata(3)
    assert c.is_complete


def test_counter_rejects_duplicates_overflow_and_strangers() -> None:
    c = _counter()
    c.record(0, 5)
    with pytest.raises(DuplicateCompletion):
        c.record(0, 5)
    with pytest.raises(CompletionOverflow):
        c.record(0, 6)  # 3 chunks x 2 groups
    with pytest.raises(CompletionOverflow):
        c.record(3, -1)
    with pytest.raises(UnknownSource):
        c.record(1, 0)
    with pytest.raises(CompletionOverflow):
        c.seal(2)  # group 5 of source 0 already seen, only 4 exist in 2 chunks
    with pytest.raises(CompletionOverflow):
        c.seal(4)  # beyond max_chunks
    c.seal(3)
    with pytest.raises(CountingError):
        c.seal(2)
    with pytest.raises(UnknownSource):
        c.record_metadata(0)
    c.record_metadata(3)
    with pytest.raises(DuplicateCompletion):
        c.record_metadata(3)
    with pytest.raises(CountingError):
        CompletionCounter(Expectation(((0, 1),), 0), max_chunks=0)


def test_counter_without_metadata() -> None:
    c = _counter(max_chunks=1, metadata=False)
    c.seal(1)
    c.record(0, 0)
    c.record(0, 1)
    assert c.record(3, 0)
    with pytest.raises(DuplicateCompletion):
        c.record_metadata(3)
