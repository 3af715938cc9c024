"""Layout geometry: spans agree with numpy's view of a region, hashes see every field."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_pd.core.errors import LayoutError
from sgl_pd.core.layout import AttnKind, KvLayout, KvPart, PageLayout


def _gqa(**over: object) -> KvLayout:
    base = dict(
        num_layers=4,
        num_kv_heads=8,
        head_dim=4,
        page_size=4,
        elem_bytes=2,
        page_layout=PageLayout.HND,
    )
    base.update(over)
    return KvLayout.gqa(**base)  # type: ignore[arg-type]


@settings(max_examples=150, deadline=None)
@given(
    page_layout=st.sampled_from(PageLayout),
    local=st.integers(1, 4),
    page_size=st.integers(1, 5),
    head_dim=st.integers(1, 3),
    data=st.data(),
)
def test_spans_cover_exactly_the_block(
    page_layout: PageLayout, local: int, page_size: int, head_dim: int, data: st.DataObject
) -> None:
    lay = _gqa(num_kv_heads=8, head_dim=head_dim, page_size=page_size, page_layout=page_layout)
    pages = 3
    page = data.draw(st.integers(0, pages - 1))
    h_lo = data.draw(st.integers(0, local - 1))
    h_hi = data.draw(st.integers(h_lo + 1, local))
    t_lo = data.draw(st.integers(0, page_size - 1))
    t_hi = data.draw(st.integers(t_lo + 1, page_size))
    # Byte index of every element, viewed through numpy in the layout's logical order.
    nbytes = lay.region_bytes(pages, local)
    byte_ids = np.arange(nbytes).reshape(*lay.pool_shape(pages, local), lay.elem_bytes)
    if page_layout is PageLayout.NHD:
        block = byte_ids[page, t_lo:t_hi, h_lo:h_hi]
    else:
        block = byte_ids[page, h_lo:h_hi, t_lo:t_hi]
    want = np.sort(block.ravel())
    spans = lay.spans(page, local, (h_lo, h_hi), (t_lo, t_hi))
    got = np.sort(np.concatenate([np.arange(o, o + n) for o, n in spans]))
    assert np.array_equal(got, want)
    # Spans are maximal: no two are adjacent.
    ends = {o + n for o, n in spans}
    assert not any(o in ends for o, _ in spans)


def test_span_counts_show_hnd_vs_nhd() -> None:
    hnd, nhd = _gqa(page_layout=PageLayout.HND), _gqa(page_layout=PageLayout.NHD)
    assert len(hnd.spans(0, 2, (1, 2))) == 1  # a head slice of a page: one write
    assert len(nhd.spans(0, 2, (1, 2))) == hnd.page_size  # one per token slot
    assert len(nhd.spans(0, 2, (0, 2))) == 1
    assert len(hnd.spans(0, 2, (0, 2), (1, 3))) == 2  # partial page: one per head


def test_sizes_of_the_reference_models() -> None:
    r1 = KvLayout.mla(
        num_layers=61,
        kv_lora_rank=512,
        rope_dim=64,
        page_size=64,
        elem_bytes=2,
        page_layout=PageLayout.NHD,
    )
    qwen = _gqa(num_layers=62, head_dim=128, page_size=64)
    assert r1.bytes_per_token == 70_272 and r1.parts == (KvPart.LATENT,)
    assert qwen.bytes_per_token == 253_952 and qwen.parts == (KvPart.K, KvPart.V)
    assert qwen.region_index(3, KvPart.V) == 7
    with pytest.raises(LayoutError):
        qwen.region_index(3, KvPart.LATENT)
    with pytest.raises(LayoutError):
        r1.region_index(61, KvPart.LATENT)


def test_layer_groups() -> None:
    lay = _gqa(num_layers=5)
    assert lay.layer_groups(2) == (range(0, 2), range(2, 4), range(4, 5))
    with pytest.raises(LayoutError):
        lay.layer_groups(0)


def test_compat_hash_sees_every_field() -> None:
    base = _gqa()
    changed = [
        dataclasses.replace(base, num_layers=5),
        dataclasses.replace(base, num_kv_heads=4),
        dataclasses.replace(base, head_dim=8),
        dataclasses.replace(base, page_size=8),
        dataclasses.replace(base, elem_bytes=1),
        dataclasses.replace(base, page_layout=PageLayout.NHD),
        KvLayout.mla(
            num_layers=4,
            kv_lora_rank=3,
            rope_dim=1,
            page_size=4,
            elem_bytes=2,
            page_layout=PageLayout.HND,
        ),
    ]
    hashes = {base.compat_hash(), *(c.compat_hash() for c in changed)}
    assert len(hashes) == len(changed) + 1
    assert base.compat_hash() == _gqa().compat_hash() < 2**64


@pytest.mark.parametrize(
    "make",
    [
        lambda: _gqa(page_size=0),
        lambda: _gqa(head_dim=-1),
        lambda: KvLayout(AttnKind.MLA, 2, 2, 4, 4, 2, PageLayout.NHD, 3, 1),
        lambda: KvLayout(AttnKind.MLA, 2, 1, 5, 4, 2, PageLayout.NHD, 3, 1),
        lambda: KvLayout(AttnKind.GQA, 2, 2, 4, 4, 2, PageLayout.NHD, 3, 1),
    ],
)
def test_invalid_layouts(make: object) -> None:
    with pytest.raises(LayoutError):
        make()  # type: ignore[operator]
