"""SGLang glue for `core.pins`: a prefill scheduler's KV allocator holds back the pages
sgl_pd's writes still read, and takes them once the request drained (the drain rule,
`drain.Drain.settle`, unpins them).

SGLang 0.5.23's two plain allocators free through one narrow place each, which we wrap
on the instance (every free path, free groups and `free_segment` included, ends there):

- page size 1 (`TokenToKVPoolAllocator`): `free(token_indices)`, outside a free group
  (inside one it only collects, and `free_group_end` calls `free` again);
- page size > 1 (`PagedTokenToKVPoolAllocator`): `_release_page_ids(*page_ids)`, which
  `free`, `free_page_ids` and `free_group_end` all end in.

SGLang's hybrid SWA allocator (`SWATokenToKVPoolAllocator`) holds one of those for the
full-attention pages, whose pages the chunks name, and frees them through it: that one
is wrapped. (Its sliding-window pages are read once, by the state batch after the last
chunk, and guarded otherwise: `backend.state_slots`.) Other allocators (page interleave,
...) are left alone, with a warning.

`clear` (SGLang's cache flush, when idle) rebuilds the free list from scratch: every
pinned page is taken out of it again and counts as freed by SGLang, so it goes back
once, when its writes ended.

Held pages go back from `available_size` when the scheduler thread calls it (before it
admits work, and in its idle check): the allocator is only ever changed on that thread,
though SGLang's watchdog also reads `available_size` from its own. Until then they count
as used, which is what they are, and SGLang's idle leak check counts them as held
outside the pool (its `uncached` term), as it does decoders' deferred releases.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import numpy as np

from sgl_pd.core.pins import PagePins

logger = logging.getLogger("sgl_pd.pins")

_INSTALLED = "_sgl_pd_pins"


def pins_of(allocator: Any) -> PagePins | None:
    """The pins that hold back `allocator`'s pages, if sgl_pd protects it."""
    return getattr(allocator, _INSTALLED, None)


def protect_allocator(allocator: Any, pins: PagePins) -> bool:
    """Wraps `allocator` (once), on the scheduler thread that owns it; False when it is
    not one of the allocators whose free path we know."""
    if pins_of(allocator) is not None:
        return True
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    if type(allocator) is SWATokenToKVPoolAllocator:
        # its full-attention frees, clear and available size go through this one
        if not protect_allocator(allocator.full_attn_allocator, pins):
            return False
        setattr(allocator, _INSTALLED, pins)
        return True
    kind = type(allocator)
    if kind is TokenToKVPoolAllocator:
        release = allocator.free

        def free(free_index: torch.Tensor) -> None:
            if allocator.free_group is not None or not pins.active or free_index.numel() == 0:
                release(free_index)
                return
            now, _held = pins.split(free_index.detach().cpu().numpy())
            release(free_index[torch.from_numpy(now).to(free_index.device)])

        allocator.free = free
    elif kind is PagedTokenToKVPoolAllocator:
        release = allocator._release_page_ids

        def release_page_ids(*page_ids: torch.Tensor) -> None:
            if not pins.active or not page_ids:
                release(*page_ids)
                return
            ids = torch.cat(page_ids) if len(page_ids) > 1 else page_ids[0]
            now, _held = pins.split(ids.detach().cpu().numpy())
            release(ids[torch.from_numpy(now).to(ids.device)])

        allocator._release_page_ids = release_page_ids
    else:
        logger.warning(
            "KV allocator %s is not one sgl_pd knows: pages a lagging write reads are not "
            "held back",
            kind.__name__,
        )
        return False

    scheduler_thread = threading.get_ident()
    available_size = allocator.available_size
    clear = allocator.clear

    def available_size_after_release() -> Any:
        if pins.active and threading.get_ident() == scheduler_thread:
            pages = pins.take_releasable()
            if pages:
                release(torch.tensor(np.asarray(pages, dtype=np.int64), device=allocator.device))
        return available_size()

    def clear_keeping_pinned() -> None:
        clear()
        pinned = pins.cleared()
        if pinned:
            held = torch.tensor(np.asarray(pinned, dtype=np.int64), device=allocator.device)
            allocator.free_pages = allocator.free_pages[~torch.isin(allocator.free_pages, held)]

    allocator.available_size = available_size_after_release
    allocator.clear = clear_keeping_pinned
    setattr(allocator, _INSTALLED, pins)
    logger.info("KV allocator holds back pages in flight (%s)", kind.__name__)
    return True


def before_prefill_bootstrap_add(queue: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of ``PrefillBootstrapQueue.add`` (scheduler thread): the first request
    of an sgl_pd prefill scheduler protects its allocator (no page is pinned before)."""
    manager = getattr(queue, "kv_manager", None)
    prefill = getattr(manager, "prefill", None)
    scheduler = getattr(queue, "scheduler", None)
    if prefill is None or scheduler is None:
        return
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    if allocator is not None:
        protect_allocator(allocator, prefill.rooms.pins)


def around_check_all_pools(
    original: Any, checker: Any, ps: Any, uncached: int = 0, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook of SGLang's idle leak check (``SchedulerInvariantChecker._check_all_pools``):
    pages held back for writes in flight are outside the pool by design, like a
    decoder's deferred releases, not leaked."""
    allocator: Any = getattr(checker, "token_to_kv_pool_allocator", None)
    pins = pins_of(allocator)
    if pins is not None:
        uncached += pins.held * int(allocator.page_size)  # tokens
    return original(checker, ps, uncached, *args, **kwargs)
