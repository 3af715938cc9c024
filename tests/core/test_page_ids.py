"""Page ids that arrive later: fetched once, on first use; a pin made before they
arrived still holds back the pages SGLang frees (the pins resolve it before judging)."""

from __future__ import annotations

import threading

import numpy as np

from sgl_pd.core.page_ids import PageIds
from sgl_pd.core.pins import PagePins


class _Copy:
    """A device-to-host copy that lands when `landed` is set; counts the waits."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = np.asarray(ids, dtype=np.int32)
        self.landed = threading.Event()
        self.fetches = 0

    def fetch(self) -> np.ndarray:
        self.fetches += 1
        assert self.landed.wait(5)
        return self.ids


def test_ids_are_fetched_once_whoever_asks_first() -> None:
    copy = _Copy([3, 4, 5])
    ids = PageIds.later(copy.fetch)
    assert not ids.resolved
    readers = [threading.Thread(target=ids.array) for _ in range(4)]
    for r in readers:
        r.start()
    copy.landed.set()
    for r in readers:
        r.join(5)
    assert ids.resolved and copy.fetches == 1
    assert ids.array().tolist() == [3, 4, 5] and ids.array().dtype == np.int64
    assert PageIds.ready([1, 2]).array().tolist() == [1, 2]


def test_a_pin_made_before_the_ids_arrived_holds_the_pages_sglang_frees() -> None:
    pins = PagePins()
    copy = _Copy([10, 11])
    pins.pin(7, PageIds.later(copy.fetch))
    assert pins.active and copy.fetches == 0  # pinning never waits for the copy
    copy.landed.set()
    now, held = pins.split(np.array([10, 12]))
    assert now.tolist() == [False, True] and held.tolist() == [True, False]
    pins.unpin(7)
    assert pins.take_releasable() == [10]


def test_an_unpin_before_the_ids_were_needed_never_waits_for_them() -> None:
    pins = PagePins()
    copy = _Copy([10])
    pins.pin(7, PageIds.later(copy.fetch))
    pins.unpin(7)
    assert copy.fetches == 0 and not pins.active


def test_a_cache_flush_resolves_pending_pins_first() -> None:
    pins = PagePins()
    copy = _Copy([4])
    copy.landed.set()
    pins.pin(1, PageIds.later(copy.fetch))
    assert pins.cleared() == [4]
