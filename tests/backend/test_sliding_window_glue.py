"""A decoder's window pages, from its request's token slots: the positions of its own
KV (c tokens), translated to the window pool's slots as SGLang translates them."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from sgl_pd.backend import sliding_window_glue
from sgl_pd.backend.sliding_window_glue import NoWindowPage, window_pages


@pytest.fixture(autouse=True)
def _window() -> Iterator[None]:
    saved = sliding_window_glue._Process.window
    sliding_window_glue._Process.window = 6
    yield
    sliding_window_glue._Process.window = saved


def _translate(slots: np.ndarray) -> np.ndarray:
    """A window pool whose page for main page p is page 100 - p (slots kept in page)."""
    page, offset = np.divmod(slots, 2)
    return (100 - page) * 2 + offset


def test_the_pages_of_the_window_in_order() -> None:
    row = np.arange(40, 60)  # the request's main-pool slots: pages 20..29 of two slots
    # c = 11 tokens, window 6: positions 5..10, from 4 (a page boundary): pages 2..5
    pages = window_pages(row, _translate, held=0, kv_tokens=11, page_size=2)
    assert list(pages) == [100 - 22, 100 - 23, 100 - 24, 100 - 25]
    assert list(window_pages(row, _translate, held=8, kv_tokens=11, page_size=2)) == [76, 75]
    assert len(window_pages(row, _translate, held=10, kv_tokens=10, page_size=2)) == 0


def test_a_position_without_a_window_page_refuses_the_request() -> None:
    """Slot 0 is SGLang's padding: writing there would write another request's page."""
    row = np.arange(40, 60)

    def unmapped(slots: np.ndarray) -> np.ndarray:
        out = _translate(slots)
        out[-1] = 0
        return out

    with pytest.raises(NoWindowPage, match="without a page"):
        window_pages(row, unmapped, held=0, kv_tokens=11, page_size=2)
