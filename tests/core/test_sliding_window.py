"""The sliding window's positions and pages a request's decoder receives."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_pd.core.sliding_window import window_pages, window_tokens


def test_the_window_is_the_last_tokens_from_a_page_boundary() -> None:
    assert window_tokens(0, 100, 16, 1) == range(84, 100)
    assert window_tokens(0, 100, 16, 8) == range(80, 100)  # 84 rounded down to a page
    assert window_tokens(0, 10, 16, 8) == range(0, 10)  # a prompt shorter than the window
    assert window_tokens(88, 100, 16, 8) == range(88, 100)  # the decoder holds 88 already
    assert window_tokens(96, 96, 16, 8) == range(96, 96)  # it holds them all
    assert window_pages(0, 100, 16, 8) == range(10, 13)
    assert window_pages(96, 96, 16, 8) == range(0)


@given(
    page_size=st.sampled_from([1, 2, 16, 64]),
    window=st.integers(1, 600),
    kv_tokens=st.integers(0, 3000),
    held_pages=st.integers(0, 200),
)
def test_the_window_covers_what_the_next_token_attends_and_nothing_held(
    page_size: int, window: int, kv_tokens: int, held_pages: int
) -> None:
    held = min(held_pages * page_size, kv_tokens - kv_tokens % page_size)
    tokens = window_tokens(held, kv_tokens, window, page_size)
    # every position the token at kv_tokens attends to and the decoder lacks
    assert set(range(max(held, kv_tokens - window), kv_tokens)) <= set(tokens)
    assert tokens.start >= held and tokens.stop == kv_tokens
    assert tokens.start % page_size == 0 and tokens.start > kv_tokens - window - page_size
    pages = window_pages(held, kv_tokens, window, page_size)
    assert len(pages) == -(-len(tokens) // page_size)


def test_nonsense_is_refused() -> None:
    with pytest.raises(ValueError):
        window_tokens(-1, 10, 4, 1)
    with pytest.raises(ValueError):
        window_tokens(0, 10, 4, 0)
