"""State besides the KV between a prefill server and a decoder of different TP sizes, every
rank a messenger: each decode rank's slots end up holding its own share of the
prefill's state (GDN-shaped Mamba slots with a [q | k | v] conv axis and a replicated
region, NHD window pages of a sliding-window pool), gathered from several prefill ranks
or cut from one, with the KV beside it verified by its sums; a pair whose state cannot
be split fails the request with the reason."""

from __future__ import annotations

import dataclasses
import logging
import re
import time

import pytest

from sgl_pd.backend.prefill.messenger import TIMING_LINE_PREFIX
from sgl_pd.core.layout import KvLayout, PageLayout

from .sharded_rig import STATE_SLOTS, Cluster, StateModel, StateRegion

GQA8 = dict(num_layers=3, num_kv_heads=8, head_dim=8, elem_bytes=1, page_layout=PageLayout.NHD)
# two KV heads: at TP 4 and 8 they are replicated over the ranks, so some prefill ranks
# send a decode rank state and no KV
GQA2 = dict(GQA8, num_kv_heads=2)
PAGE = 2


def _gdn() -> StateModel:
    """A gated-DeltaNet layer's state, per layer: conv [q | k | v] (8, 8, 16 channels of
    3 bytes: kernel - 1 steps), recurrent (8 heads of 16 bytes), and a replicated
    12-byte region."""
    conv = StateRegion(groups=(8, 8, 16), unit=3, grouped=True)
    recurrent = StateRegion(groups=(8,), unit=16)
    replicated = StateRegion(groups=(), unit=12)
    return StateModel((("mamba", (conv, recurrent, replicated, conv, recurrent)),))


def _window() -> StateModel:
    """A sliding-window pool's K and V pages (two sliding layers), NHD: a page's 2 token
    rows of 8 heads, 8 bytes each."""
    page = StateRegion(groups=(8,), unit=8, outer=PAGE)
    return StateModel((("swa", (page,) * 4),), window=4)


def _check_state(c: Cluster, model: StateModel, pairs: list[tuple[tuple[int, ...], ...]]) -> None:
    """Each decode rank's named slots hold its share of the prefill's, others stay zero."""
    src, dst = pairs
    dtp = len(c.decoders)
    for rank, buffers in enumerate(c.state_memory["decode"]):
        for comp, (_, regions) in enumerate(model.components):
            for reg, region in enumerate(regions):
                item = region.item(dtp)
                buf = buffers[comp][reg]
                moved = dict(zip(dst[comp], src[comp], strict=True))
                for slot in range(STATE_SLOTS):
                    got = buf[slot * item : (slot + 1) * item].tobytes()
                    if slot in moved:
                        want = model.expected(comp, reg, moved[slot], rank, dtp)
                        assert got == want, (rank, comp, reg, slot)
                    else:
                        assert not any(got), (rank, comp, reg, slot)


def _moved(
    model: StateModel,
    heads: dict,  # the KV layout's arguments
    ptp: int,
    dtp: int,
    layerwise: bool,
    slots: tuple[tuple[tuple[int, ...], ...], ...],
    **run: int,
) -> None:
    """Runs one request naming `slots` (the prefill's, the decoder's) through a cluster
    of `model`: every decode rank completes (its KV verified) and holds its share."""
    c = Cluster(KvLayout.gqa(page_size=PAGE, **heads), ptp, dtp, layerwise=layerwise, state=model)
    results = c.run(state_slots=slots, **run)
    assert all(ok for ok, _ in results), results
    _check_state(c, model, list(slots))


SPLITS = [(1, 2), (2, 1), (4, 2), (2, 4), (2, 2), (1, 8), (8, 1)]


@pytest.mark.parametrize("ptp,dtp", SPLITS)
@pytest.mark.parametrize("layerwise", [False, True], ids=["after-forward", "layerwise"])
def test_each_decode_rank_gets_its_share_of_a_mamba_slot(
    ptp: int, dtp: int, layerwise: bool
) -> None:
    slots = (((3,),), ((5,),))
    _moved(_gdn(), GQA8, ptp, dtp, layerwise, slots, room=21, tokens=13, chunk_tokens=5)


@pytest.mark.parametrize("ptp,dtp", SPLITS)
@pytest.mark.parametrize("layerwise", [False, True], ids=["after-forward", "layerwise"])
def test_each_decode_rank_gets_its_heads_of_the_window_pages(
    ptp: int, dtp: int, layerwise: bool
) -> None:
    slots = (((6, 2, 4),), ((1, 7, 3),))  # window pages, paired in order
    _moved(_window(), GQA8, ptp, dtp, layerwise, slots, room=22, tokens=13, chunk_tokens=5)


@pytest.mark.parametrize("ptp,dtp", [(4, 2), (4, 1), (8, 2), (2, 4), (8, 8)])
@pytest.mark.parametrize("layerwise", [False, True], ids=["after-forward", "layerwise"])
def test_a_rank_that_sends_only_state_counts_it(ptp: int, dtp: int, layerwise: bool) -> None:
    slots = (((3,),), ((5,),))
    _moved(_gdn(), GQA2, ptp, dtp, layerwise, slots, room=24, tokens=13, chunk_tokens=5)


@pytest.mark.parametrize("ptp,dtp", [(4, 2), (2, 4), (2, 2)])
@pytest.mark.parametrize("layerwise", [False, True], ids=["after-forward", "layerwise"])
def test_a_decoder_holding_every_page_still_gets_the_state(
    ptp: int, dtp: int, layerwise: bool
) -> None:
    """No chunk comes (the decoder's cache holds all 6 pages): each writer's count is
    its state group alone."""
    slots = (((3,),), ((5,),))
    _moved(_gdn(), GQA2, ptp, dtp, layerwise, slots, room=25, tokens=12, chunk_tokens=6,
           held_pages=6)  # fmt: skip


def test_a_state_that_cannot_be_split_fails_the_request_with_the_reason() -> None:
    """Six heads do not split over TP 4: every decode rank hears why."""
    model = StateModel((("swa", (StateRegion(groups=(6,), unit=8, outer=PAGE),)),), window=4)
    layout = KvLayout.gqa(page_size=PAGE, **GQA8)
    c = Cluster(layout, 1, 4, state=model)
    results = c.run(room=23, tokens=9, chunk_tokens=9, state_slots=(((2,),), ((3,),)), check=False)
    for _, error in results:
        assert error is not None and "serve both at one TP size" in error, results


# layer-wise, the state's layers interleave with the KV layers: model layers 0 and 2
# hold state, 1, 3 and 4 are KV layers 0..2 (`core.layer_steps`)
KV_LAYERS = (1, 3, 4)


def _streamed(model: StateModel, layers: tuple[int, ...]) -> StateModel:
    return dataclasses.replace(model, layers=(layers,), kv_layers=KV_LAYERS)


def _landed(c: Cluster, model: StateModel, slots: tuple, regions: set[int]) -> bool:
    """Every decode rank's named slots of `regions` (of component 0) hold their share."""
    src, dst = slots
    dtp = len(c.decoders)
    _, specs = model.components[0]
    for rank, buffers in enumerate(c.state_memory["decode"]):
        for reg in regions:
            item = specs[reg].item(dtp)
            for d, s in zip(dst[0], src[0], strict=True):
                got = buffers[0][reg][d * item : (d + 1) * item].tobytes()
                if got != model.expected(0, reg, s, rank, dtp):
                    return False
    return True


def _wait(ready, timeout_s: float = 10.0) -> bool:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if ready():
            return True
        time.sleep(0.005)
    return ready()


def _state_after(
    caplog: pytest.LogCaptureFixture, field: str = "state_after", ranks: int = 1
) -> list[int]:
    """Each of the `ranks` prefill ranks' state bytes written after the last chunk's
    forward (or `field`, another count of its per-request timing line). A rank logs its
    line once every decode rank acked, which may be after the decoders completed."""

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if TIMING_LINE_PREFIX in r.getMessage()]

    _wait(lambda: len(lines()) >= ranks)
    return [int(re.search(rf"{field}=(\d+)", line).group(1)) for line in lines()]  # type: ignore[union-attr]


@pytest.mark.parametrize("ptp,dtp", [(1, 1), (1, 2), (2, 1), (2, 4)])
@pytest.mark.parametrize(
    "model,layers,slots",
    [
        (_gdn(), (0, 0, 0, 2, 2), (((3,),), ((5,),))),
        (_window(), (0, 2, 0, 2), (((6, 2, 4),), ((1, 7, 3),))),
    ],
    ids=["mamba", "window"],
)
def test_layerwise_the_state_of_each_layer_lands_before_the_last_send(
    ptp: int,
    dtp: int,
    model: StateModel,
    layers: tuple[int, ...],
    slots: tuple,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The slots read before the last chunk's forward carry each state layer's share
    as the forward reports it: every rank's share has landed before the last prefill
    rank's last send (the metadata job, the after-forward path, waits for a rank's
    last send), and no rank wrote state after its forward; the request completes."""
    caplog.set_level(logging.INFO, logger="sgl_pd.prefill")
    streamed = _streamed(model, layers)
    c = Cluster(KvLayout.gqa(page_size=PAGE, **GQA8), ptp, dtp, layerwise=True, state=streamed)
    every = set(range(len(layers)))
    seen: list[bool] = []

    def look(rank: int) -> None:
        if rank == ptp - 1:
            seen.append(_wait(lambda: _landed(c, streamed, slots, every)))

    results = c.run(room=31, tokens=13, chunk_tokens=5, state_slots=slots, before_last_send=look)
    assert seen == [True]
    assert all(ok for ok, _ in results), results
    _check_state(c, streamed, list(slots))
    assert _state_after(caplog, ranks=ptp) == [0] * ptp


def test_layerwise_a_region_in_a_layer_no_step_reports_goes_after_the_forward(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Region 4 sits in a layer without a step (its output projection was not found):
    it is not written during the forward, and still lands with the metadata."""
    caplog.set_level(logging.INFO, logger="sgl_pd.prefill")
    streamed = _streamed(_gdn(), (0, 0, 0, 2, -1))
    slots = (((3,),), ((5,),))
    c = Cluster(KvLayout.gqa(page_size=PAGE, **GQA8), 1, 2, layerwise=True, state=streamed)
    before: list[tuple[bool, bool]] = []

    def look(_rank: int) -> None:
        _wait(lambda: _landed(c, streamed, slots, {0, 1, 2, 3}))
        before.append((_landed(c, streamed, slots, {0, 1, 2, 3}), _landed(c, streamed, slots, {4})))

    results = c.run(room=32, tokens=13, chunk_tokens=5, state_slots=slots, before_last_send=look)
    assert before == [(True, False)]
    assert all(ok for ok, _ in results), results
    _check_state(c, streamed, list(slots))
    recurrent = 8 * 16  # region 4's slot: 8 heads of 16 bytes, half on each decode rank
    assert _state_after(caplog) == [recurrent]


@pytest.mark.parametrize(
    "model,layers,slots,named",
    [
        (_gdn(), (0, 0, 0, 2, 2), (((3,),), ((5,),)), ((4,),)),
        (_window(), (0, 2, 0, 2), (((6, 2, 4),), ((1, 7, 3),)), ((6, 7, 4),)),
    ],
    ids=["mamba", "window"],
)
def test_layerwise_slots_named_after_the_forward_unlike_those_read_before_are_written_again(
    model: StateModel, layers: tuple[int, ...], slots: tuple, named: tuple
) -> None:
    """SGLang's last send names other slots than were read before the forward (its
    prefix cache swapped a window page for the tree's, of the same KV): every region
    goes again from the named slots, after the forward, and the decoder ends up with
    those."""
    streamed = _streamed(model, layers)
    c = Cluster(KvLayout.gqa(page_size=PAGE, **GQA8), 1, 2, layerwise=True, state=streamed)
    results = c.run(room=33, tokens=13, chunk_tokens=5, state_slots=slots, named_state=named)
    assert all(ok for ok, _ in results), results
    _check_state(c, streamed, [named, slots[1]])


# after the forward, the window's pages final after the first and the second send of
# 13 tokens in chunks of 5 (pages of 2: the sends end at tokens 4 and 10)
WINDOW_SLOTS = (((6, 2, 4),), ((1, 7, 3),))
SO_FAR = [((6,),), ((6, 2),)]


def _pair_landed(c: Cluster, model: StateModel, src: int, dst: int) -> bool:
    """Every decode rank's slot `dst` holds its share of the prefill's slot `src`, in
    every region of component 0."""
    return _landed(c, model, (((src,),), ((dst,),)), set(range(len(model.components[0][1]))))


@pytest.mark.parametrize("ptp,dtp", [(1, 1), (1, 2), (2, 1), (2, 4)])
def test_after_the_forward_the_window_pages_of_earlier_chunks_go_with_their_kv(
    ptp: int, dtp: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Each send before the last names the window pages its forwards completed: they
    land with its KV, before the last send, and only the last chunk's page is written
    after the last forward; every rank's share of each page is written once."""
    caplog.set_level(logging.INFO, logger="sgl_pd.prefill")
    model = _window()
    c = Cluster(KvLayout.gqa(page_size=PAGE, **GQA8), ptp, dtp, state=model)
    seen: list[tuple[bool, bool]] = []

    def look(rank: int) -> None:
        if rank == ptp - 1:
            early = _wait(lambda: _pair_landed(c, model, 6, 1) and _pair_landed(c, model, 2, 7))
            seen.append((early, _pair_landed(c, model, 4, 3)))

    results = c.run(room=34, tokens=13, chunk_tokens=5, state_slots=WINDOW_SLOTS,
                    state_so_far=SO_FAR, before_last_send=look)  # fmt: skip
    assert seen == [(True, False)]
    assert all(ok for ok, _ in results), results
    _check_state(c, model, list(WINDOW_SLOTS))
    early, after = _state_after(caplog, "state_early", ptp), _state_after(caplog, ranks=ptp)
    assert len(early) == ptp, early
    assert all(a > 0 and e == 2 * a for e, a in zip(early, after, strict=True)), (early, after)


@pytest.mark.parametrize(
    "so_far,named",
    [
        # a later send names another first page, and the last send extends that list:
        # the first page went early from the slot named first
        ([((6,),), ((5, 2),)], ((5, 2, 4),)),
        (SO_FAR, ((6, 5, 4),)),  # the last send names another second page
    ],
    ids=["between-sends", "at-the-last-send"],
)
def test_after_the_forward_window_pages_named_anew_later_are_written_again(
    so_far: list, named: tuple, caplog: pytest.LogCaptureFixture
) -> None:
    """SGLang's prefix cache swapped a window page for the tree's between two sends:
    every page goes again from the last send's slots, after the forward, and the decoder
    ends up with those."""
    caplog.set_level(logging.INFO, logger="sgl_pd.prefill")
    model = _window()
    c = Cluster(KvLayout.gqa(page_size=PAGE, **GQA8), 1, 2, state=model)
    results = c.run(room=35, tokens=13, chunk_tokens=5, state_slots=WINDOW_SLOTS,
                    state_so_far=so_far, named_state=named)  # fmt: skip
    assert all(ok for ok, _ in results), results
    _check_state(c, model, [named, WINDOW_SLOTS[1]])
    early, after = _state_after(caplog, "state_early"), _state_after(caplog)
    assert "state_renamed=1" in caplog.text
    assert after == [e // 2 * 3 for e in early], (early, after)  # 2 pages early, then all 3


def test_after_the_forward_more_final_window_pages_than_the_decoder_named_fail() -> None:
    model = _window()
    c = Cluster(KvLayout.gqa(page_size=PAGE, **GQA8), 1, 1, state=model)
    results = c.run(room=36, tokens=13, chunk_tokens=5, state_slots=WINDOW_SLOTS,
                    state_so_far=[((6,),), ((6, 2, 4, 8),)], check=False)  # fmt: skip
    for _, error in results:
        assert error is not None and "named 4 swa state slots and the decoder 3" in error, results
