"""The plans of SGLang's state components besides the KV pages: each role names the
same positions in the same order, and every write lands inside its buffers - over
pools shaped like DeepSeek-V4's (SWA ring, C128 state, request rows) and DSA's (indexer
pages, compressed tail)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from sgl_pd.core.state_components import (
    PLANS,
    Geometry,
    Named,
    Request,
    named,
    tail_ranges,
    writes,
)

ROWS = 8  # request rows of each role's pools


@st.composite
def pairs(draw: st.DrawFn, page_size: int = 1) -> tuple[Request, Request]:
    """One request as both roles see it: the same held prefix and KV tokens, each role
    its own row."""
    c = draw(st.integers(0, 700))
    held = draw(st.integers(0, c // page_size)) * page_size
    rows = draw(st.lists(st.integers(0, ROWS - 1), min_size=2, max_size=2))
    return Request(held, c, rows[0]), Request(held, c, rows[1])


def _buffers(count: int, items: int, item_bytes: int, base: int) -> tuple[list[int], int]:
    """`count` buffers of `items` items each, laid out one after another from `base`:
    (their bases, their length in bytes)."""
    length = items * item_bytes
    return [base + i * (length + 4096) for i in range(count)], length


def _inside(addr: int, n: int, bases: list[int], length: int) -> bool:
    return any(b <= addr and addr + n <= b + length for b in bases)


@given(pairs())
def test_deepseek_v4_components_pair_up_and_stay_in_their_buffers(
    pair: tuple[Request, Request],
) -> None:
    """V4's unified SWA ring (a 128-token window in a 256-row ring per request), its
    C128 pending block (a ring of 256 tokens: two block pages per request, or the
    request's row online) and its request rows: both roles name as many indices, and
    every write is inside the source's and the destination's buffers."""
    prefill, decode = pair
    shapes = {
        "swa_ring": (Geometry(window=128, ring=256), ROWS * 256, 576),
        "dsv4_request_state": (Geometry(ratio=128, ring=256), ROWS * 2, 1024),
        "request_row": (Geometry(), ROWS, 64),
    }
    for kind, (geometry, items, item_bytes) in shapes.items():
        src_bases, length = _buffers(3, items, item_bytes, 1 << 20)
        dst_bases, _ = _buffers(3, items, item_bytes, 1 << 30)
        src, dst = named(kind, prefill, geometry), named(kind, decode, geometry)
        done = writes(src_bases, dst_bases, [item_bytes] * 3, src, dst)
        assert len(done) == 3 * len(src)
        for s, d, n in done:
            assert _inside(s, n, src_bases, length) and _inside(d, n, dst_bases, length)
    online = named("dsv4_request_state", decode, Geometry(ratio=128, ring=256, online=True))
    assert online == ([] if decode.kv_tokens % 128 == 0 else [decode.row])


@given(pairs(page_size=64), st.integers(1, 4096))
def test_paged_components_name_logical_pages_after_the_held_prefix(
    pair: tuple[Request, Request], window: int
) -> None:
    """DSA's indexer pages (and MXFP8 block scales) name the pages after the prefix
    the decoder holds - never a held page, which its cache shares - and a window
    component the window's pages: the same logical pages on both roles."""
    prefill, decode = pair
    geometry = Geometry(page_size=64, window=window)
    for kind in ("dsa", "block_scale", "swa", "block_scale_swa"):
        pages = named(kind, prefill, geometry)
        assert pages == named(kind, decode, geometry)
        assert all(p * 64 >= decode.held and p * 64 < decode.kv_tokens for p in pages)
    suffix = named("dsa", decode, geometry)
    assert len(suffix) == -(-decode.kv_tokens // 64) - decode.held // 64


@given(pairs(), st.sampled_from([(64, 64), (64, 80), (128, 200)]))
def test_the_compressed_tail_stays_in_the_ring(
    pair: tuple[Request, Request], sizes: tuple[int, int]
) -> None:
    pool_size, tail_size = sizes
    _prefill, decode = pair
    ranges = tail_ranges(decode, pool_size, tail_size)
    assert sum(n for _, n in ranges) == decode.kv_tokens % pool_size
    assert all(start >= 0 and start + n <= tail_size and n > 0 for start, n in ranges)


def test_every_plan_is_moved_or_refused_with_a_reason() -> None:
    moved = sorted(k for k, p in PLANS.items() if p.refused is None)
    assert moved == ["mamba", "swa"]
    assert all(p.refused and p.models for p in PLANS.values() if p.kind not in moved)
    assert {p.named for p in PLANS.values()} == set(Named)


def test_lists_of_different_lengths_are_not_paired() -> None:
    import pytest

    with pytest.raises(ValueError, match="named 2 and 1"):
        writes([0], [100], [4], [1, 2], [3])
