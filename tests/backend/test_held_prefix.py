"""A decoder that holds a prompt's prefix in its cache (SGLang's decode radix cache)
receives only the KV after it, over the in-memory transfer engine: the held pages' bytes
are never touched, the rest arrives byte for byte, both sides count the same, and a full
hit moves only the metadata - in both send modes, for any held length."""

from __future__ import annotations

import time

import msgspec
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.states import DecodeState, PrefillState
from sgl_pd.core.wire import ChunkNotice, TransferRequest

from .pd_fakes import LAYOUT, Rig, wait_state

HELD_BYTE = 0xAB  # what the decoder's cache holds in its prefix pages


def _wait(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def _serve(
    rig: Rig, room: int, prompt_pages: int, held: int, chunk: int, layerwise: bool
) -> tuple[list[int], list[int], list[int]]:
    """One request of `prompt_pages` pages (1-token pages) whose first `held` the decoder
    holds: its cached pages are filled with HELD_BYTE first. Returns (prefill pages,
    held decoder pages, new decoder pages)."""
    d = rig.decoders["decode-a"]
    src = list(range(10, 10 + prompt_pages))
    held_pages = list(range(40, 40 + held))
    new_pages = list(range(40 + held, 40 + prompt_pages))[::-1]  # a scattered order
    for page in held_pages:
        d.memory.set_page(page, HELD_BYTE)
    rig.request(d, room, new_pages, slot=room % 8, held_tokens=held * LAYOUT.page_size)
    if layerwise:
        rig.prefill_layerwise(room, src, chunk=chunk, held_pages=held)
    else:
        rig.prefill_all(room, src, chunk=chunk, held_pages=held)
    wait_state(d, room, DecodeState.COMPLETE)
    return src, held_pages, new_pages


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt_pages=st.integers(1, 12),
    held_share=st.floats(0, 1),
    chunk=st.integers(1, 5),
    layerwise=st.booleans(),
)
def test_only_the_pages_after_the_held_prefix_are_written(
    prompt_pages: int, held_share: float, chunk: int, layerwise: bool
) -> None:
    held = min(prompt_pages, round(held_share * prompt_pages))
    rig = Rig(layerwise=layerwise)
    d = rig.add_decoder("decode-a")
    try:
        src, held_pages, new_pages = _serve(rig, 5, prompt_pages, held, chunk, layerwise)
        for page in held_pages:
            assert d.memory.page(page) == bytes([HELD_BYTE]) * len(d.memory.page(page))
        for s, t in zip(src[held:], new_pages, strict=True):
            assert d.memory.page(t) == rig.prefill_memory.page(s)
        # the chunks the last notice counts are those that carried KV, none on a full hit
        (notice,) = [m for _, m in rig.sent if isinstance(m, ChunkNotice) and m.is_last]
        sent_chunks = len({t // chunk for t in range(held, prompt_pages)})
        assert notice.num_chunks == sent_chunks
        _wait(lambda: rig.prefill.state(5) == (PrefillState.DONE, True, None))
        kv_bytes = (prompt_pages - held) * LAYOUT.page_bytes(2) * LAYOUT.num_regions
        room = rig.prefill.rooms.rooms_of([5])[0]
        assert room.bytes_sent - kv_bytes == 16  # and the one metadata row (AUX_ITEM)
    finally:
        rig.prefill.writers.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_full_hit_moves_only_the_metadata_and_completes(layerwise: bool) -> None:
    rig = Rig(layerwise=layerwise, metered=True)
    d = rig.add_decoder("decode-a")
    try:
        _serve(rig, 6, prompt_pages=6, held=6, chunk=4, layerwise=layerwise)
        d.messenger.hand_off(6)
        assert d.messenger.poll(6) == (DecodeState.HANDED_OFF, None)
        _wait(lambda: rig.prefill.state(6) == (PrefillState.DONE, True, None))
        registry = rig.registries["decode"]
        held = registry.get_sample_value("sgl_pd_decode_prefix_tokens_total", {"role": "decode"})
        moved = registry.get_sample_value("sgl_pd_decode_received_tokens_total", {"role": "decode"})
        saved = registry.get_sample_value("sgl_pd_kv_bytes_not_sent_total", {"role": "decode"})
        assert (held, moved) == (6, 0)
        assert saved == 6 * LAYOUT.page_bytes(2) * LAYOUT.num_regions
    finally:
        rig.prefill.writers.close()


def test_decode_ranks_that_disagree_on_the_held_prefix_are_refused() -> None:
    """Every decode rank of a request must hold the same prefix: the prefill plans one
    start for all of them (SGLang keeps its TP ranks' caches identical)."""
    rig = Rig()
    d = rig.add_decoder("decode-a")
    ranks = [
        msgspec.structs.replace(d.registration, scheme=ShardingScheme(2), rank=r) for r in (0, 1)
    ]

    def asked(rank: int, held: int) -> TransferRequest:
        pages = (50, 51, 52)[held:]
        return TransferRequest(
            request_id=9,
            decoder=ranks[rank],
            dst_pages=pages,
            metadata_slot=1,
            completion_slot=1,
            held_tokens=held,
        )

    assert rig.prefill.rooms.add_request(asked(0, 2)) is None
    refused = rig.prefill.rooms.add_request(asked(1, 1))
    assert refused is not None and "prefix they hold" in refused
    rig.prefill.writers.close()


def test_a_held_prefix_that_is_not_whole_pages_is_refused_on_the_wire() -> None:
    from sgl_pd.core.errors import InvalidMessage
    from sgl_pd.core.layout import KvLayout, PageLayout

    rig = Rig()
    d = rig.add_decoder("decode-a")
    paged = KvLayout.gqa(
        num_layers=4, num_kv_heads=2, head_dim=8, page_size=16, elem_bytes=1,
        page_layout=PageLayout.NHD,
    )  # fmt: skip
    registration = msgspec.structs.replace(d.registration, layout=paged)
    with pytest.raises(InvalidMessage, match="whole pages"):
        TransferRequest(
            request_id=1,
            decoder=registration,
            dst_pages=(3,),
            metadata_slot=0,
            completion_slot=0,
            held_tokens=8,
        )
    rig.prefill.writers.close()


def test_memory_helpers_fill_pages() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    d.memory.set_page(3, 7)
    assert set(d.memory.page(3)) == {7}
    assert np.all(np.frombuffer(d.memory.page(4), dtype=np.uint8) == 0)
    rig.prefill.writers.close()


def _asked(rig: Rig, room: int, held: int, pages: int) -> TransferRequest:
    d = rig.decoders["decode-a"]
    return TransferRequest(
        request_id=room,
        decoder=d.registration,
        dst_pages=tuple(range(40 + held, 40 + pages)),
        metadata_slot=1,
        completion_slot=1,
        held_tokens=held,
    )


def test_the_held_prefix_cannot_change_once_sglang_read_it() -> None:
    """SGLang fixes where its sends start when it reads the held prefix: a decode rank
    that asks again for the request with another prefix (a retried room) is refused,
    or its pages would be named from one token and written from another."""
    rig = Rig(layerwise=True)
    rig.add_decoder("decode-a")
    rooms = rig.prefill.rooms
    assert rooms.add_request(_asked(rig, 9, held=2, pages=6)) is None
    assert rooms.held_tokens(9) == 2
    refused = rooms.add_request(_asked(rig, 9, held=1, pages=6))
    assert refused is not None and "held prefix" in refused
    assert rooms.rooms_of([9])[0].tokens_planned == 2
    # before SGLang read it, a new ask may still move it either way
    assert rooms.add_request(_asked(rig, 10, held=3, pages=6)) is None
    assert rooms.add_request(_asked(rig, 10, held=1, pages=6)) is None
    assert rooms.held_tokens(10) == 1 and rooms.rooms_of([10])[0].tokens_planned == 1
    rig.prefill.writers.close()


def test_a_held_prefix_past_the_prompt_fails_the_request_at_once() -> None:
    """A decoder that claims to hold more tokens than the prefill computes (a peer
    without the pinned patch, or a broken one): SGLang would never make its last send,
    and both sides would wait for their timeouts. It fails at once, and the decoder
    hears why."""
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.request(d, 11, [], slot=1, held_tokens=5)
    rig.prefill.track(11)
    assert rig.prefill.rooms.held_tokens(11) == 5
    rig.prefill.prompt_known(11, 4)
    state, _, error = rig.prefill.state(11)
    assert state is PrefillState.FAILED and error is not None and "holds 5" in error
    wait_state(d, 11, DecodeState.FAILED)
    rig.prefill.writers.close()
