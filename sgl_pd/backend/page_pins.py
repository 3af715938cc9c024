"""SGLang glue for `core.pins`: a prefill scheduler's KV allocator holds back the pages
sgl_pd's writes still read, and takes them once the writes ended.

SGLang 0.5.23's allocators free through one narrow place each, which we wrap on the
instance (every free path, free groups included, goes through it):

- page size 1 (`TokenToKVPoolAllocator`): `free(token_indices)`, outside a free group
  (inside one it only collects, and `free_group_end` calls `free` again);
- page size > 1 (`PagedTokenToKVPoolAllocator`): `_release_page_ids(*page_ids)`, which
  `free`, `free_page_ids` and `free_group_end` all end in.

Held pages go back from `available_size`, which the scheduler calls before it admits
work and in its idle check, on its own thread: the allocator is never touched from
another thread. Until then they count as used, which is what they are.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from sgl_pd.core.pins import PagePins

logger = logging.getLogger("sgl_pd.pins")

_INSTALLED = "_sgl_pd_pins"


def protect_allocator(allocator: Any, pins: PagePins) -> bool:
    """Wraps `allocator` (once); False when it has neither free path we know."""
    if getattr(allocator, _INSTALLED, None) is not None:
        return True
    import torch

    page_size = int(getattr(allocator, "page_size", 1))
    if page_size == 1 and callable(getattr(allocator, "free", None)):
        release = allocator.free

        def free(free_index: torch.Tensor) -> None:
            if allocator.free_group is not None or not pins.active or free_index.numel() == 0:
                release(free_index)
                return
            now, _held = pins.split(free_index.detach().cpu().numpy())
            release(free_index[torch.from_numpy(now).to(free_index.device)])

        allocator.free = free
    elif page_size > 1 and callable(getattr(allocator, "_release_page_ids", None)):
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
            "KV allocator %s has no free path sgl_pd knows: pages a lagging write reads "
            "are not held back",
            type(allocator).__name__,
        )
        return False
    available_size = allocator.available_size

    def available_size_after_release() -> Any:
        pages = pins.take_releasable() if pins.active else []
        if pages:
            device = getattr(allocator, "device", "cpu")
            release(torch.tensor(np.asarray(pages, dtype=np.int64), device=device))
        return available_size()

    allocator.available_size = available_size_after_release
    setattr(allocator, _INSTALLED, pins)
    logger.info("KV allocator holds back pages in flight (%s)", type(allocator).__name__)
    return True


def before_prefill_bootstrap_add(queue: Any, req: Any, *args: Any, **kwargs: Any) -> None:
    """BEFORE hook of ``PrefillBootstrapQueue.add``: the first request of an sgl_pd
    prefill scheduler protects its allocator (no page is pinned before one)."""
    manager = getattr(queue, "kv_manager", None)
    prefill = getattr(manager, "prefill", None)
    scheduler = getattr(queue, "scheduler", None)
    if prefill is None or scheduler is None:
        return
    allocator = getattr(scheduler, "token_to_kv_pool_allocator", None)
    if allocator is not None:
        protect_allocator(allocator, prefill.rooms.pins)
