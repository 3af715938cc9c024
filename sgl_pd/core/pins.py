"""Source pages a prefill rank's queued or running writes will read: SGLang must not
reuse them until those writes ended.

Why SGLang frees such pages at all: a write job holds the page ids SGLang gave it
(before the forward, layer by layer; or at its send, after it), and the writer runs
behind the scheduler. Meanwhile SGLang's radix cache may free the request's copy of a
prefix another request inserted first (`cache_unfinished_req` points the request's
`req_to_token` row at the other copy and frees its own), and it frees every page of a
request it aborts or drops itself. The next forward can reuse such a page, and a
lagging writer would ship another request's KV under this one's name: wrong tokens with
HTTP 200.

So each request pins the pages its chunks name, from the moment a chunk is planned until
the request is final *and* drained (no write in flight, none can start). SGLang's frees
pass through `split`: a pinned page is held back, and handed back to SGLang's allocator
(`take_releasable`, on the scheduler thread) once its last pin is gone. The allocator
thus never sees a page that a write may still read; a page is freed once, late.

Page ids are the allocator's page units (token index // page size). A chunk's ids may
still be on their way to host memory when it is pinned (`core.page_ids`): such a pin is
pending, and resolved before any page is judged (`split`, `cleared`), by which time the
copy has landed. Thread-safe: pins come from the scheduler thread, unpins from writer and
liveness threads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np

from sgl_pd.core.page_ids import PageIds


class PagePins:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._count: dict[int, int] = {}  # page -> requests pinning it
        self._by_owner: dict[int, set[int]] = {}  # request -> pages it pins
        self._held: set[int] = set()  # pinned pages SGLang has freed
        self._releasable: list[int] = []  # held pages whose last pin is gone
        self._pending: dict[int, list[PageIds]] = {}  # request -> ids not on the host yet

    def sizes(self) -> dict[str, int]:
        """Entries of each of its tables (a soak watches them return to 0)."""
        with self._lock:
            return {
                "pinned_pages": len(self._count),
                "pin_owners": len(self._by_owner),
                "held_pages": len(self._held),
                "pins_pending": len(self._pending),
            }

    @property
    def active(self) -> bool:
        """Some page is pinned or waits to go back (cheap: read without the lock)."""
        return bool(self._count) or bool(self._releasable) or bool(self._pending)

    def pin(self, owner: int, pages: Iterable[int] | PageIds) -> None:
        with self._lock:
            if isinstance(pages, PageIds):
                if not pages.resolved:
                    self._pending.setdefault(owner, []).append(pages)
                    return
                pages = pages.array()
            self._pin(owner, pages)

    def _pin(self, owner: int, pages: Iterable[int]) -> None:
        mine = self._by_owner.setdefault(owner, set())
        for page in pages:
            p = int(page)
            if p not in mine:
                mine.add(p)
                self._count[p] = self._count.get(p, 0) + 1

    def _resolve_pending(self) -> None:
        """Pins whose ids were still being copied count from now (lock held)."""
        pending, self._pending = self._pending, {}
        for owner, ids in pending.items():
            for one in ids:
                self._pin(owner, one.array())

    def unpin(self, owner: int) -> None:
        """`owner` is final and drained: none of its writes reads a page any more."""
        with self._lock:
            self._pending.pop(owner, None)  # never counted, never judged: nothing to undo
            for page in self._by_owner.pop(owner, ()):
                left = self._count[page] - 1
                if left:
                    self._count[page] = left
                    continue
                del self._count[page]
                if page in self._held:
                    self._held.discard(page)
                    self._releasable.append(page)

    def split(self, pages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """SGLang frees `pages`: (free now, held back) as boolean masks over `pages`."""
        with self._lock:
            self._resolve_pending()
            held = np.fromiter((int(p) in self._count for p in pages), dtype=bool, count=len(pages))
            self._held.update(int(p) for p in pages[held])
            return ~held, held

    def cleared(self) -> list[int]:
        """SGLang rebuilt its free list from scratch, with every page in it: pages
        waiting to go back are back already, and every pinned page now counts as freed
        by SGLang. Returns the pinned pages, which the caller takes out of the free list
        again (they go back once, when their writes ended)."""
        with self._lock:
            self._resolve_pending()
            self._releasable = []
            self._held = set(self._count)
            return sorted(self._held)

    def take_releasable(self) -> list[int]:
        """Held pages no write reads any more: the caller gives them to the allocator."""
        with self._lock:
            out, self._releasable = self._releasable, []
            return out

    @property
    def held(self) -> int:
        """Pages SGLang freed that wait for writes to end."""
        with self._lock:
            return len(self._held)

    @property
    def owners(self) -> int:
        with self._lock:
            return len(self._by_owner.keys() | self._pending.keys())
