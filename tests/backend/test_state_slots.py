"""A request's state besides the KV pages (a Mamba / linear-attention model's slot, a
sliding-window model's window pages), moved by the messengers over the in-memory engine:
the prefill's slots land in the decoder's, byte for byte and in order, with the metadata
and under its count word, in both send modes; pairs that cannot move it refuse the
request with the reason."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from sgl_pd.backend.state_slots import mamba_dtypes, named_slots, slot_mismatch
from sgl_pd.core.errors import InvalidMessage
from sgl_pd.core.regions import Region
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.state_components import Geometry, Request, named
from sgl_pd.core.states import DecodeState
from sgl_pd.core.wire import StateSlots, TransferRequest

from .pd_fakes import STATE_SLOTS, SWA_WINDOW, Decoder, Rig, StateShape, wait_state

_made: list[Rig] = []


def _rig(**options: Any) -> Rig:
    """A rig whose writer threads stop after the test (`_close_rigs`)."""
    rig = Rig(**options)
    _made.append(rig)
    return rig


@pytest.fixture(autouse=True)
def _close_rigs() -> Iterator[None]:
    yield
    while _made:
        _made.pop().prefill.writers.close()


PAGES = [5, 6, 7, 8, 9, 10]
DST = [20, 21, 22, 23, 24, 25]


@pytest.mark.parametrize("layerwise", [False, True], ids=["after-forward", "layerwise"])
def test_the_prefills_slot_lands_in_the_decoders_slot(layerwise: bool) -> None:
    rig = _rig(layerwise=layerwise, state=True)
    decoder = rig.add_decoder("decode-0")
    src_slot, dst_slot = 3, 5
    rig.request(decoder, 41, DST, slot=1, state_slots=((dst_slot,),))
    if layerwise:
        rig.prefill_layerwise(41, PAGES, state_slots=((src_slot,),))
    else:
        rig.prefill_all(41, PAGES, state_slots=((src_slot,),))
    wait_state(decoder, 41, DecodeState.COMPLETE)
    assert decoder.memory.slot(dst_slot) == rig.prefill_memory.slot(src_slot)
    # nothing else of the decoder's state changed, and the KV came as ever
    untouched = [s for s in range(STATE_SLOTS) if s != dst_slot]
    assert all(not any(decoder.memory.slot(s)) for s in untouched)
    assert [decoder.memory.page(p) for p in DST] == [rig.prefill_memory.page(p) for p in PAGES]


def _state_held(room: int, dst_slot: int, src_slot: int) -> tuple[Rig, Decoder]:
    """A request whose every KV batch landed while the batch writing its state is held
    at the prefill's engine (only batches into the decoder's state regions are)."""
    rig = _rig(state=True)
    decoder = rig.add_decoder("decode-0")
    rig.request(decoder, room, DST, slot=2, state_slots=((dst_slot,),))
    (state,) = decoder.registration.state
    rig.prefill_engine.hold_into = [range(r.base, r.base + r.length) for r in state.regions]
    rig.prefill_engine.gate.clear()
    rig.prefill_all(room, PAGES, state_slots=((src_slot,),))
    assert rig.prefill_engine.waiting.wait(5)
    return rig, decoder


def test_the_request_is_not_complete_while_its_state_is_in_flight() -> None:
    """Every KV batch landed and the state's is held: the decoder's count stays short of
    complete, and the slot is still empty; once it lands, the request completes."""
    rig, decoder = _state_held(42, dst_slot=4, src_slot=6)
    assert [decoder.memory.page(p) for p in DST] == [rig.prefill_memory.page(p) for p in PAGES]
    assert decoder.messenger.poll(42)[0] is not DecodeState.COMPLETE
    assert not any(decoder.memory.slot(4))
    rig.prefill_engine.gate.set()
    wait_state(decoder, 42, DecodeState.COMPLETE)
    assert decoder.memory.slot(4) == rig.prefill_memory.slot(6)


def test_a_request_that_fails_while_its_state_is_written_never_completes() -> None:
    """SGLang may reuse the slot of a failed request while the write still reads it: no
    count and no last notice follow such a write - also when the decoder has not heard
    of the failure yet (the error's first copy lost)."""
    rig, decoder = _state_held(45, dst_slot=1, src_slot=2)
    rig.lose_errors = True
    rig.prefill.abort(45, "aborted by the prefill scheduler")
    rig.prefill_engine.gate.set()
    deadline = time.monotonic() + 5
    while not (seen := rig.prefill.state(45)) or not seen[1]:  # until drained
        assert time.monotonic() < deadline, seen
        time.sleep(0.01)
    assert decoder.messenger.poll(45)[0] is not DecodeState.COMPLETE


def test_a_decoder_without_the_state_is_refused_with_the_reason() -> None:
    rig = _rig(state=True)
    decoder = rig.add_decoder("decode-0", state=False)
    rig.request(decoder, 43, DST, slot=1)
    state, error = decoder.messenger.poll(43)
    assert state is DecodeState.FAILED, (state, error)
    assert error is not None and "serve one model on both" in error, error


def test_a_last_send_that_names_no_slot_fails_the_request() -> None:
    rig = _rig(state=True)
    decoder = rig.add_decoder("decode-0")
    rig.request(decoder, 44, DST, slot=1, state_slots=((2,),))
    rig.prefill_all(44, PAGES)  # SGLang named no state slot
    wait_state(decoder, 44, DecodeState.FAILED)
    assert "named no state slots" in (decoder.messenger.poll(44)[1] or "")
    assert not any(decoder.memory.slot(2))


def _slots(
    slot_bytes: tuple[int, ...] = (8, 16),
    slots: int = 4,
    dtypes: str = "conv=bfloat16",
    kind: str = "mamba",
    window: int = 16,
) -> StateSlots:
    regions = tuple(Region(0x1000 * (i + 1), slots * n) for i, n in enumerate(slot_bytes))
    return StateSlots(
        kind=kind, regions=regions, slot_bytes=slot_bytes, slots=slots, dtypes=dtypes,
        window=window if kind == "swa" else 0,
    )  # fmt: skip


def test_sglang_names_one_mamba_slot_per_request() -> None:
    mine = (_slots(),)
    assert named_slots(mine, [[np.array([2])]]) == (((2,),), None)
    assert named_slots((), None) == ((), None)
    assert named_slots((), [None]) == ((), None)
    for wrong in ([], [np.array([1, 2])], [np.array([9])], [None]):
        slots, why = named_slots(mine, wrong)
        assert slots == () and why, wrong
    slots, why = named_slots((), [np.array([1])])
    assert slots == () and why is not None and "does not transfer" in why


def test_a_window_names_its_pages_in_order() -> None:
    window = (_slots(kind="swa", slots=8),)
    assert named_slots(window, [np.array([6, 2, 5])]) == (((6, 2, 5),), None)
    assert named_slots(window, [np.array([], dtype=np.int64)]) == (((),), None)  # all held
    for wrong in ([np.array([1, 1])], [np.array([8])], [np.arange(9)], [np.array([3, 0])]):
        slots, why = named_slots(window, wrong)
        assert slots == () and why, wrong


def test_pairs_that_cannot_move_the_state_say_why() -> None:
    one, two = ShardingScheme(1), ShardingScheme(2)
    assert slot_mismatch((), one, (), two) is None  # no state: TP is free
    assert slot_mismatch((_slots(),), one, (_slots(),), one) is None
    why = slot_mismatch((_slots(),), one, (_slots(),), two)
    assert why is not None and "one TP size" in why
    why = slot_mismatch((_slots(),), one, (_slots((8, 32)),), one)
    assert why is not None and "another shape" in why
    why = slot_mismatch((), one, (_slots(),), one)
    assert why is not None and "keeps mamba state" in why
    # element types of one size that differ (SGLang reads them from the environment)
    why = slot_mismatch((_slots(dtypes="conv=float16"),), one, (_slots(),), one)
    assert why is not None and "conv=bfloat16" in why and "SGLANG_MAMBA_CONV_DTYPE" in why


def test_a_servers_state_types_come_from_sglangs_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("SGLANG_MAMBA_CONV_DTYPE", raising=False)
    monkeypatch.delenv("SGLANG_MAMBA_SSM_DTYPE", raising=False)
    assert mamba_dtypes() == "conv=bfloat16,ssm=float32"  # SGLang's defaults
    monkeypatch.setenv("SGLANG_MAMBA_CONV_DTYPE", "float16")
    monkeypatch.setenv("SGLANG_MAMBA_SSM_DTYPE", "bfloat16")
    assert mamba_dtypes() == "conv=float16,ssm=bfloat16"


def test_a_transfer_request_names_slots_exactly_when_its_decoder_has_slots() -> None:
    rig = _rig(state=True)
    decoder = rig.add_decoder("decode-0")
    base = dict(request_id=1, dst_pages=(1,), metadata_slot=0, completion_slot=0)
    TransferRequest(decoder=decoder.registration, state_slots=((1,),), **base)  # type: ignore[arg-type]
    # a Mamba request names one slot; one list per component
    for slots in ((), ((),), ((STATE_SLOTS,),), ((1, 2),), ((1,), (2,))):
        with pytest.raises(InvalidMessage):
            TransferRequest(decoder=decoder.registration, state_slots=slots, **base)  # type: ignore[arg-type]
    plain = rig.add_decoder("decode-1", state=False)
    with pytest.raises(InvalidMessage):
        TransferRequest(decoder=plain.registration, state_slots=((0,),), **base)  # type: ignore[arg-type]
    window = rig.add_decoder("decode-2", state="swa")
    for slots in ((), (3,), (1, 2, 7)):
        TransferRequest(decoder=window.registration, state_slots=(slots,), **base)  # type: ignore[arg-type]
    for slots in ((1, 1), (STATE_SLOTS,), (0, 1)):
        with pytest.raises(InvalidMessage):
            TransferRequest(decoder=window.registration, state_slots=(slots,), **base)  # type: ignore[arg-type]


def test_state_slots_fit_their_regions() -> None:
    with pytest.raises(InvalidMessage):
        StateSlots(kind="mamba", regions=(Region(0, 10),), slot_bytes=(8,), slots=2)
    with pytest.raises(InvalidMessage):
        StateSlots(kind="mamba", regions=(Region(0, 16),), slot_bytes=(8, 8), slots=2)
    with pytest.raises(InvalidMessage):  # a window goes with "swa", and only there
        StateSlots(kind="swa", regions=(Region(0, 16),), slot_bytes=(8,), slots=2)
    with pytest.raises(InvalidMessage):
        StateSlots(kind="mamba", regions=(Region(0, 16),), slot_bytes=(8,), slots=2, window=4)


@pytest.mark.parametrize("layerwise", [False, True], ids=["after-forward", "layerwise"])
def test_the_prefills_window_pages_land_in_the_decoders_in_order(layerwise: bool) -> None:
    """A sliding-window request: each of the prefill's window pages lands in the decoder's
    page of the same position (the lists pair up in order), nothing else is written."""
    rig = _rig(layerwise=layerwise, state="swa")
    decoder = rig.add_decoder("decode-0")
    src, dst = (6, 1, 4), (2, 7, 3)
    rig.request(decoder, 51, DST, slot=1, state_slots=(dst,))
    if layerwise:
        rig.prefill_layerwise(51, PAGES, state_slots=(src,))
    else:
        rig.prefill_all(51, PAGES, state_slots=(src,))
    wait_state(decoder, 51, DecodeState.COMPLETE)
    assert [decoder.memory.slot(d) for d in dst] == [rig.prefill_memory.slot(s) for s in src]
    untouched = [s for s in range(STATE_SLOTS) if s not in dst]
    assert all(not any(decoder.memory.slot(s)) for s in untouched)
    assert [decoder.memory.page(p) for p in DST] == [rig.prefill_memory.page(p) for p in PAGES]


def test_a_window_the_decoder_holds_whole_moves_nothing_but_completes() -> None:
    rig = _rig(state="swa")
    decoder = rig.add_decoder("decode-0")
    rig.request(decoder, 52, DST, slot=1, state_slots=((),))
    rig.prefill_all(52, PAGES, state_slots=((),))
    wait_state(decoder, 52, DecodeState.COMPLETE)
    assert all(not any(decoder.memory.slot(s)) for s in range(STATE_SLOTS))


def test_window_lists_of_different_lengths_fail_the_request() -> None:
    """The two sides computed different windows (they never should: same formula, same
    numbers): pairing them would put K/V at the wrong positions, so the request fails."""
    rig = _rig(state="swa")
    decoder = rig.add_decoder("decode-0")
    rig.request(decoder, 53, DST, slot=1, state_slots=((1, 2),))
    rig.prefill_all(53, PAGES, state_slots=((3, 4, 5),))
    wait_state(decoder, 53, DecodeState.FAILED)
    error = decoder.messenger.poll(53)[1] or ""
    assert "named 3 swa state slots and the decoder 2" in error, error
    assert all(not any(decoder.memory.slot(s)) for s in range(STATE_SLOTS))


def test_windows_of_different_sizes_are_refused_with_both() -> None:
    one = ShardingScheme(1)
    why = slot_mismatch((_slots(kind="swa"),), one, (_slots(kind="swa", window=32),), one)
    assert why is not None and "32 tokens" in why and "16" in why, why
    assert slot_mismatch((_slots(kind="swa"),), one, (_slots(kind="swa"),), one) is None
    assert SWA_WINDOW > 0


# -- components planned, not served: DeepSeek-V4's and DSA's, over pools shaped like theirs


V4_RING, V4_WINDOW, V4_RATIO, V4_STATE_RING = 16, 12, 4, 8  # rows, tokens (scaled down)
V4 = (
    StateShape("swa_ring", slot_bytes=(48, 48), slots=STATE_SLOTS * V4_RING),
    StateShape(
        "dsv4_request_state", slot_bytes=(32, 32, 32), slots=STATE_SLOTS * V4_STATE_RING // V4_RATIO
    ),
    StateShape("request_row", slot_bytes=(16,), slots=STATE_SLOTS),
)
V4_GEOMETRY = (
    Geometry(window=V4_WINDOW, ring=V4_RING),
    Geometry(ratio=V4_RATIO, ring=V4_STATE_RING),
    Geometry(),
)


@pytest.mark.parametrize("kv_tokens", [3, 8, 13, 24])
def test_deepseek_v4s_components_land_row_for_row(kv_tokens: int) -> None:
    """V4's SWA ring rows, its C128 pending block and its request row, named on each role
    from its own request row as `core.state_components` plans them: each lands in the
    decoder's slot of the same position, nothing else of the decoder's state changes."""
    rig = _rig(state=V4)
    decoder = rig.add_decoder("decode-0")
    room = 60 + kv_tokens
    prefill_side, decode_side = Request(0, kv_tokens, row=3), Request(0, kv_tokens, row=5)
    src = tuple(tuple(named(s.kind, prefill_side, g)) for s, g in zip(V4, V4_GEOMETRY, strict=True))
    dst = tuple(tuple(named(s.kind, decode_side, g)) for s, g in zip(V4, V4_GEOMETRY, strict=True))
    rig.request(decoder, room, DST, slot=1, state_slots=dst)
    rig.prefill_all(room, PAGES, state_slots=src)
    wait_state(decoder, room, DecodeState.COMPLETE)
    for component, (shape, s_slots, d_slots) in enumerate(zip(V4, src, dst, strict=True)):
        assert [decoder.memory.slot(d, component) for d in d_slots] == [
            rig.prefill_memory.slot(s, component) for s in s_slots
        ], shape.kind
        untouched = set(range(shape.slots)) - set(d_slots)
        assert all(not any(decoder.memory.slot(u, component)) for u in untouched), shape.kind
    assert len(dst[0]) == min(kv_tokens, V4_WINDOW)  # the window's ring rows
    assert len(dst[1]) == (0 if kv_tokens % V4_RATIO == 0 else 1)  # a pending block or none


def test_dsa_indexer_pages_after_the_held_prefix_land_in_the_decoders_pages() -> None:
    """DSA's indexer keeps a page of its own per KV page: the pages after the prefix the
    decoder holds, each role's own page for each logical page, pair up in order."""
    shape = StateShape("dsa", slot_bytes=(40,), slots=64)
    rig = _rig(state=(shape,))
    decoder = rig.add_decoder("decode-0")
    held_pages = 2
    request = Request(held=held_pages, kv_tokens=len(PAGES), row=0)  # a token per page
    logical = named("dsa", request, Geometry(page_size=1))
    src = tuple(PAGES[p] for p in logical)  # the prefill's pages of those positions
    dst = tuple(DST[p - held_pages] for p in logical)  # the decoder's, past its held ones
    rig.request(decoder, 70, DST[: len(PAGES) - held_pages], slot=1, held_tokens=held_pages,
                state_slots=(dst,))  # fmt: skip
    rig.prefill_all(70, PAGES, held_pages=held_pages, state_slots=(src,))
    wait_state(decoder, 70, DecodeState.COMPLETE)
    assert [decoder.memory.slot(d) for d in dst] == [rig.prefill_memory.slot(s) for s in src]
    assert all(not any(decoder.memory.slot(p)) for p in set(range(64)) - set(dst))


def test_state_of_a_kind_not_planned_or_named_in_ranges_is_refused() -> None:
    """Every kind on the wire is one `core.state_components` plans; DSA's compressed tail
    names ranges of a row (``[row, start, n, 0, m, size]``), which are no slots."""
    with pytest.raises(InvalidMessage, match="unknown kind"):
        StateSlots(kind="bogus", regions=(Region(0, 16),), slot_bytes=(8,), slots=2)
    tail = (_slots(kind="dsa_tail", slots=128),)
    slots, why = named_slots(tail, [np.array([3, 70, 10, 0, 5, 80])])
    assert slots == () and why is not None and "ranges" in why, why
