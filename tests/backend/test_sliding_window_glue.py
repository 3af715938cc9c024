"""A decoder's window pages, from its request's token slots: the positions of its own
KV (c tokens), translated to the window pool's slots as SGLang translates them."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import numpy as np
import pytest

from sgl_pd.backend import sliding_window_glue
from sgl_pd.backend.prefill.sender import SglPdKVSender
from sgl_pd.backend.sliding_window_glue import (
    NoWindowPage,
    around_send_kv_metadata,
    before_send_kv_chunk,
    window_pages,
)
from sgl_pd.core.regions import Region
from sgl_pd.core.wire import StateSlots

from .sglang_pools import hybrid_swa_allocator


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


def _decoder(page_size: int = 1, window: int = 6) -> SimpleNamespace:
    """SGLang's own hybrid SWA pool, allocator and token rows on the CPU, in the shape of
    its decode prealloc queue (the attributes the hook reads)."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    allocator = hybrid_swa_allocator(64, page_size)
    rows = ReqToTokenPool(size=4, max_context_len=64, device="cpu", enable_memory_saver=False)
    sliding_window_glue._Process.window = window
    return SimpleNamespace(
        kv_manager=SimpleNamespace(kv_args=SimpleNamespace(state_types=["SWA"])),
        token_to_kv_pool_allocator=allocator,
        req_to_token_pool=rows,
    )


def _request(queue: SimpleNamespace, prompt: int, held: int = 0) -> SimpleNamespace:
    """A decode request of `prompt` tokens whose first token this decoder samples (c =
    prompt - 1), its row allocated in both pools as SGLang's prealloc does (page 1)."""
    from sglang.srt.managers.schedule_batch import ReqKvInfo

    from sgl_pd.backend.first_token import MARK

    allocator = queue.token_to_kv_pool_allocator
    c = prompt - 1
    kv = ReqKvInfo(req_pool_idx=1, cache_protected_len=held, kv_allocated_len=c)
    queue.req_to_token_pool.req_to_token[1, :c] = allocator.alloc(c)
    req = SimpleNamespace(
        kv=kv, origin_input_ids=list(range(prompt)), output_ids=[], **{MARK: True}
    )
    refused: list[str] = []
    receiver = SimpleNamespace(refuse=refused.append, refused=refused)
    return SimpleNamespace(req=req, kv_receiver=receiver)


def _sent(queue: SimpleNamespace, decode_req: SimpleNamespace, **kw: object) -> list[object]:
    """The state_indices the hook hands SGLang's `_send_kv_metadata`."""
    seen: list[object] = []

    def original(q: object, d: object, kv: object, ps: int, state: object, **k: object) -> None:
        seen.append(state)

    around_send_kv_metadata(original, queue, decode_req, [], 1, ["sglang's"], **kw)
    return seen


def test_the_decoder_names_the_window_of_the_kv_it_receives() -> None:
    """SGLang's own entry (from the whole prompt, n tokens) is replaced by the pages of
    positions [c - window, c), c = n - 1; the positions before hold no window slot any
    more (freed, marked evicted), so its cache never serves them as a window."""
    from sglang.srt.mem_cache.unified_cache.component_type import ComponentType

    queue = _decoder()
    decode_req = _request(queue, prompt=20)
    row = queue.req_to_token_pool.req_to_token[1]
    allocator = queue.token_to_kv_pool_allocator
    expected = allocator.translate_swa_indices_for_transfer(row[13:19]).tolist()
    swa_free = allocator.swa_available_size()
    (state,) = _sent(queue, decode_req, decode_prefix_len=0)
    assert state[0].tolist() == expected and decode_req.kv_receiver.refused == []
    assert decode_req.req.kv.get_evicted_seqlen(ComponentType.SWA) == 13
    assert allocator.swa_available_size() == swa_free + 13
    assert (allocator.translate_swa_indices_for_transfer(row[:13]) == 0).all()


def test_a_held_prefix_inside_the_window_is_not_named_or_freed() -> None:
    queue = _decoder()
    decode_req = _request(queue, prompt=20, held=16)
    allocator = queue.token_to_kv_pool_allocator
    swa_free = allocator.swa_available_size()
    (state,) = _sent(queue, decode_req, decode_prefix_len=16)
    row = queue.req_to_token_pool.req_to_token[1]
    assert state[0].tolist() == allocator.translate_swa_indices_for_transfer(row[16:19]).tolist()
    assert allocator.swa_available_size() == swa_free


def test_a_request_needing_more_kv_than_allocated_is_refused_not_sent_stale_slots() -> None:
    queue = _decoder()
    decode_req = _request(queue, prompt=20)
    decode_req.req.kv.kv_allocated_len = 10
    (state,) = _sent(queue, decode_req, decode_prefix_len=0)
    assert state == [None]
    assert "allocated 10" in decode_req.kv_receiver.refused[0]


def test_a_host_destination_and_a_pool_without_a_window_are_left_alone() -> None:
    queue = _decoder()
    decode_req = _request(queue, prompt=20)
    assert _sent(queue, decode_req, decode_prefix_len=0, destination="host") == [["sglang's"]]
    queue.kv_manager.kv_args.state_types = ["MAMBA"]
    assert _sent(queue, decode_req, decode_prefix_len=0) == [["sglang's"]]


# -- the prefill: window pages final before the last send ---------------------------------


def _prefill(layerwise: bool = False) -> tuple[SimpleNamespace, SglPdKVSender, list[object]]:
    """SGLang's own hybrid SWA allocator and token rows (pages of 2, a window of 6) in the
    shape of its prefill scheduler, and a sender of one request whose sends are
    recorded: the `state_so_far` each hands the messenger."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    sliding_window_glue._Process.window = 6
    window = StateSlots(
        kind="swa", regions=(Region(4096, 64 * 16),), slot_bytes=(16,), slots=64, window=6
    )
    carried: list[object] = []
    messenger = SimpleNamespace(
        track=lambda room: None,
        layerwise=layerwise,
        submit_chunk=lambda *a, state_so_far=None, **k: carried.append(state_so_far),
    )
    pool = SimpleNamespace(state=(window,))
    manager = SimpleNamespace(pool=pool, prefill=messenger, layout=SimpleNamespace(page_size=2))
    scheduler = SimpleNamespace(
        token_to_kv_pool_allocator=hybrid_swa_allocator(64, page_size=2),
        req_to_token_pool=ReqToTokenPool(
            size=4, max_context_len=64, device="cpu", enable_memory_saver=False
        ),
    )
    return scheduler, SglPdKVSender(manager, "127.0.0.1:1", 7), carried


def _prefill_request(scheduler: SimpleNamespace, sender: SglPdKVSender) -> SimpleNamespace:
    """A request of c = 11 computed tokens (window positions 4..10: pages 2..5), its first
    chunk's forward done up to token 9 (SGLang sends whole pages: up to 8); its main-pool
    pages 1..6 map to window-pool pages 30..25."""
    import torch

    full = torch.arange(2, 14)
    swa = torch.cat([torch.arange(60 - 2 * p, 62 - 2 * p) for p in range(6)])
    scheduler.token_to_kv_pool_allocator.set_full_to_swa_mapping(full, swa)
    scheduler.req_to_token_pool.req_to_token[1, :11] = full[:11]
    return SimpleNamespace(
        disagg_kv_sender=sender,
        origin_input_ids=list(range(11)),
        extend_end=9,
        kv=SimpleNamespace(req_pool_idx=1),
        disagg_decode_prefix_len=0,
        rid="r",
    )


def _window_pages(scheduler: SimpleNamespace, stop: int) -> tuple[int, ...]:
    row = scheduler.req_to_token_pool.req_to_token[1]
    slots = scheduler.token_to_kv_pool_allocator.translate_swa_indices_for_transfer(row[4:stop])
    return tuple(int(s) for s in slots[::2] // 2)


def test_a_send_before_the_last_carries_the_window_pages_its_chunks_completed() -> None:
    """Whole pages from the window's start to where SGLang ends the send, in the order of
    the list its last send names; nothing where no window page is complete yet."""
    scheduler, sender, carried = _prefill()
    req = _prefill_request(scheduler, sender)
    for end_idx in (None, 8, 9, 4, 5):
        before_send_kv_chunk(scheduler, req, last_chunk=False, end_idx=end_idx)
        sender.send(np.zeros(1, np.int32))
    pages = _window_pages(scheduler, 8)
    assert pages == (28, 27)
    assert carried == [(pages,), (pages,), (pages,), None, None]


def test_the_last_send_a_layerwise_server_and_a_skipped_send_carry_nothing_early() -> None:
    scheduler, sender, carried = _prefill()
    req = _prefill_request(scheduler, sender)
    before_send_kv_chunk(scheduler, req, last_chunk=False)  # SGLang then sends nothing,
    before_send_kv_chunk(scheduler, req, last_chunk=True)  # and then its last send
    sender.send(np.zeros(1, np.int32))
    scheduler, sender, layerwise_carried = _prefill(layerwise=True)
    before_send_kv_chunk(scheduler, _prefill_request(scheduler, sender), last_chunk=False)
    sender.send(np.zeros(1, np.int32))
    assert carried == [None] and layerwise_carried == [None]


def test_window_pages_this_rank_cannot_take_do_not_go_early() -> None:
    """A slot past the pool's end is not written early; the last send's list, checked,
    names them all."""
    _scheduler, sender, carried = _prefill()
    sender.state_final_so_far(((3, 99),))
    sender.send(np.zeros(1, np.int32))
    assert carried == [None]
