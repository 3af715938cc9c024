"""SGLang's own KV pools and allocators on the CPU, small, for tests of the glue that
wraps or reads them."""

from __future__ import annotations

from typing import Any


def hybrid_swa_allocator(size: int, page_size: int) -> Any:
    """SGLang's hybrid sliding-window allocator over its `SWAKVPool` (one sliding layer,
    one full layer, a head of 4 elements), `size` tokens in each part."""
    import torch
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    pool = SWAKVPool(
        size=size, size_swa=size, page_size=page_size, dtype=torch.float16, head_num=1,
        head_dim=4, swa_attention_layer_ids=[0], full_attention_layer_ids=[1],
        device="cpu", enable_memory_saver=False,
    )  # fmt: skip
    return SWATokenToKVPoolAllocator(size, size, page_size, torch.float16, "cpu", pool, False)


def token_allocator(size: int, page_size: int) -> Any:
    """SGLang's token-to-KV allocator of `size` tokens: paged where pages are over one."""
    import torch
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

    if page_size == 1:
        return TokenToKVPoolAllocator(size, torch.float16, "cpu", None, False)
    return PagedTokenToKVPoolAllocator(size, page_size, torch.float16, "cpu", None, False)


def radix_cache(
    allocator: Any, page_size: int, *, disable: bool = False, eagle: bool = False
) -> Any:
    """SGLang's RadixCache over `allocator` (no request pool: nothing under test frees
    a request's slots); `eagle`: keyed by token pairs, as where EAGLE drafts."""
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.radix_cache import RadixCache

    return RadixCache(
        CacheInitParams(
            disable=disable,
            req_to_token_pool=None,  # type: ignore[arg-type]
            token_to_kv_pool_allocator=allocator,
            page_size=page_size,
            is_eagle=eagle,
        )
    )
