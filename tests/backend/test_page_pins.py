"""Pinned pages on SGLang 0.5.23's real KV allocators (CPU): a page a write still reads
is held back from the free list whatever frees it (a free, a free group, a cache
flush), comes back exactly once after the write ended, only on the scheduler's thread,
and SGLang's idle leak check counts it as held, not leaked. Every hook sgl_pd registers
names something SGLang has."""

from __future__ import annotations

import importlib
import threading
from typing import Any

import pytest
import torch
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator

from sgl_pd.backend.prefill.page_pins import around_check_all_pools, protect_allocator
from sgl_pd.core.pins import PagePins

from .sglang_pools import hybrid_swa_allocator

PAGES = 12


def _allocator(page_size: int, need_sort: bool = False) -> object:
    if page_size == 1:
        return TokenToKVPoolAllocator(PAGES, torch.float16, "cpu", None, need_sort)
    return PagedTokenToKVPoolAllocator(
        PAGES * page_size, page_size, torch.float16, "cpu", None, need_sort
    )


def _free_pages(allocator: Any) -> list[int]:
    """Every page the allocator would hand out (free, staged or released)."""
    parts = [allocator.free_pages, *getattr(allocator, "staged_pages", [])]
    if getattr(allocator, "release_pages", None) is not None:
        parts.append(allocator.release_pages)
    return sorted(int(p) for p in torch.cat(parts))


def _tokens(pages: list[int], page_size: int) -> torch.Tensor:
    return torch.tensor([p * page_size + i for p in pages for i in range(page_size)])


@pytest.mark.parametrize(
    ("page_size", "need_sort"), [(1, False), (1, True), (16, False), (16, True)]
)
def test_a_pinned_page_freed_by_sglang_comes_back_once_after_its_write(
    page_size: int, need_sort: bool
) -> None:
    a = _allocator(page_size, need_sort)
    pins = PagePins()
    assert protect_allocator(a, pins)
    capacity = a.available_size()  # type: ignore[attr-defined]
    taken = a.alloc(4 * page_size)  # type: ignore[attr-defined]
    pages = sorted({int(t) // page_size for t in taken})
    pins.pin(7, pages[:2])  # a layer job names two of them
    a.free(taken)  # type: ignore[attr-defined] # the radix cache drops the duplicate prefix
    assert not set(pages[:2]) & set(_free_pages(a))
    assert set(pages[2:]) <= set(_free_pages(a))
    assert a.available_size() == capacity - 2 * page_size  # type: ignore[attr-defined]
    pins.unpin(7)  # the write ended
    assert a.available_size() == capacity  # type: ignore[attr-defined]
    assert a.available_size() == capacity  # type: ignore[attr-defined] # once, not twice
    assert _free_pages(a) == sorted(set(_free_pages(a)))


@pytest.mark.parametrize("page_size", [1, 16])
def test_frees_inside_a_free_group_are_held_back_too(page_size: int) -> None:
    a = _allocator(page_size)
    pins = PagePins()
    protect_allocator(a, pins)
    taken = a.alloc(2 * page_size)  # type: ignore[attr-defined]
    page = int(taken[0]) // page_size
    pins.pin(1, [page])
    a.free_group_begin()  # type: ignore[attr-defined]
    a.free(taken)  # type: ignore[attr-defined]
    a.free_group_end()  # type: ignore[attr-defined]
    assert page not in _free_pages(a)
    pins.unpin(1)
    a.available_size()  # type: ignore[attr-defined]
    assert page in _free_pages(a)


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_cache_flush_keeps_pinned_pages_out_and_frees_nothing_twice(page_size: int) -> None:
    a = _allocator(page_size)
    pins = PagePins()
    protect_allocator(a, pins)
    capacity = a.available_size()  # type: ignore[attr-defined]
    taken = a.alloc(3 * page_size)  # type: ignore[attr-defined]
    pages = sorted({int(t) // page_size for t in taken})
    pins.pin(1, pages[:1])  # still written; SGLang holds it
    pins.pin(2, pages[1:2])
    a.free(_tokens(pages[1:2], page_size))  # type: ignore[attr-defined] # freed, held back
    pins.unpin(2)  # its write ended: waits to go back
    a.clear()  # type: ignore[attr-defined] # SGLang's flush_cache
    assert pages[0] not in _free_pages(a)
    assert pages[1] in _free_pages(a)  # back with the clear, and not again below
    pins.unpin(1)
    assert a.available_size() == capacity  # type: ignore[attr-defined]
    assert len(_free_pages(a)) == len(set(_free_pages(a)))


def test_pages_go_back_only_on_the_schedulers_thread() -> None:
    a = _allocator(1)
    pins = PagePins()
    protect_allocator(a, pins)
    capacity = a.available_size()  # type: ignore[attr-defined]
    taken = a.alloc(2)  # type: ignore[attr-defined]
    pins.pin(1, [int(taken[0])])
    a.free(taken)  # type: ignore[attr-defined]
    pins.unpin(1)
    seen: list[int] = []
    watchdog = threading.Thread(target=lambda: seen.append(a.available_size()))  # type: ignore[attr-defined]
    watchdog.start()
    watchdog.join()
    assert seen == [capacity - 1]  # SGLang's watchdog reads; it does not release
    assert a.available_size() == capacity  # type: ignore[attr-defined]


def test_the_idle_leak_check_counts_held_pages_as_outside_the_pool() -> None:
    a = _allocator(16)
    pins = PagePins()
    protect_allocator(a, pins)
    taken = a.alloc(32)  # type: ignore[attr-defined]
    pins.pin(1, [int(taken[0]) // 16])
    a.free(taken)  # type: ignore[attr-defined]
    calls: list[int] = []

    def check(checker: object, ps: object, uncached: int = 0) -> tuple[bool, list[str]]:
        calls.append(uncached)
        return False, []

    checker = type("Checker", (), {"token_to_kv_pool_allocator": a})()
    around_check_all_pools(check, checker, object())
    assert calls == [16]  # one page held: 16 tokens


def test_other_allocators_are_left_alone() -> None:
    class Other:
        page_size = 1

    assert not protect_allocator(Other(), PagePins())


def test_every_hook_names_something_sglang_has(monkeypatch: pytest.MonkeyPatch) -> None:
    from sgl_pd.backend import registration

    targets: list[str] = []
    monkeypatch.setattr(
        "sglang.srt.plugins.hook_registry.HookRegistry.register",
        lambda target, *a, **k: targets.append(target),
    )
    registration.register_backend()
    assert any(t.endswith("._check_all_pools") for t in targets)
    for target in targets:
        parts = target.split(".")
        for cut in range(len(parts) - 1, 0, -1):
            try:
                obj = importlib.import_module(".".join(parts[:cut]))
            except ImportError:
                continue
            for name in parts[cut:]:
                obj = getattr(obj, name)
            break
        else:
            pytest.fail(f"{target}: no module")


@pytest.mark.parametrize("page_size", [1, 4])
def test_the_hybrid_swa_allocator_holds_back_its_full_attention_pages(page_size: int) -> None:
    """SGLang's hybrid SWA allocator frees a request's full-attention pages (the ones the
    chunks name) through its full sub-allocator: a pinned one stays out until its write
    ended; the window's pages go back at once (they are guarded by the state batch)."""
    a = hybrid_swa_allocator(PAGES * page_size, page_size)
    pins = PagePins()
    assert protect_allocator(a, pins)
    full = a.full_attn_allocator
    capacity, swa_capacity = full.available_size(), a.swa_available_size()
    # a request's slots in both pools, paired as SGLang pairs them
    taken = full.alloc(4 * page_size)
    a.set_full_to_swa_mapping(taken, a.swa_attn_allocator.alloc(4 * page_size))
    pages = sorted({int(t) // page_size for t in taken})
    pins.pin(3, pages[:1])
    a.free(taken)
    assert full.available_size() == capacity - page_size  # one page held back
    assert a.swa_available_size() == swa_capacity
    pins.unpin(3)
    assert a.available_size() == capacity  # (the full side is the smaller now no more)
    assert full.available_size() == capacity
