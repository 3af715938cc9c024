"""State besides the KV between a prefill server and a decoder of different TP sizes, every
rank a messenger: each decode rank's slots end up holding its own share of the
prefill's state (GDN-shaped Mamba slots with a [q | k | v] conv axis and a replicated
region, NHD window pages of a sliding-window pool), gathered from several prefill ranks
or cut from one, with the KV beside it verified by its sums; a pair whose state cannot
be split fails the request with the reason."""

from __future__ import annotations

import pytest

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
