"""--pd-kv-checksum across every way KV travels: mismatched TP both ways (including heads
replicated on either side), MLA, page sizes 1 and 4, chunks that start mid-page, a held
prefix, layer-wise and after-forward, draft layers, gather and receive staging and
fragmented source pages: each decode rank verifies correct KV (no false mismatch), and
a corruption - even sign bits alone, which cancel in a plain 64-bit sum - is caught."""

from __future__ import annotations

import numpy as np
import pytest

from sgl_pd.core.layout import KvLayout, PageLayout

from .sharded_rig import Cluster

GQA4 = dict(num_layers=3, num_kv_heads=4, head_dim=8, elem_bytes=1, page_layout=PageLayout.NHD)


@pytest.mark.parametrize(
    "ptp,dtp", [(1, 2), (2, 1), (4, 2), (2, 4), (1, 8), (8, 1), (8, 2), (2, 8)]
)
@pytest.mark.parametrize("page_size", [1, 4])
@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("held", [0, 1])
@pytest.mark.parametrize("staging", [False, True])
def test_gqa_no_false_mismatch(ptp, dtp, page_size, layerwise, held, staging):
    layout = KvLayout.gqa(page_size=page_size, **GQA4)
    c = Cluster(
        layout,
        ptp,
        dtp,
        layerwise=layerwise,
        gather=1 << 16 if staging else 0,
        recv=1 << 16 if staging else 0,
    )
    res = c.run(
        room=11,
        tokens=10 * page_size + 3 if page_size > 1 else 13,
        chunk_tokens=3 * page_size + 1 if page_size > 1 else 4,
        held_pages=held,
    )
    assert all(ok for ok, _ in res), res


@pytest.mark.parametrize("ptp,dtp", [(1, 2), (2, 1), (4, 2), (2, 4)])
@pytest.mark.parametrize("layerwise", [False, True])
def test_mla_no_false_mismatch(ptp, dtp, layerwise):
    layout = KvLayout.mla(
        num_layers=3,
        kv_lora_rank=8,
        rope_dim=8,
        page_size=2,
        elem_bytes=1,
        page_layout=PageLayout.NHD,
    )
    c = Cluster(layout, ptp, dtp, layerwise=layerwise)
    res = c.run(room=12, tokens=15, chunk_tokens=5)
    assert all(ok for ok, _ in res), res


@pytest.mark.parametrize("layerwise", [False, True])
def test_draft_layers(layerwise):
    layout = KvLayout.gqa(page_size=2, **GQA4)
    c = Cluster(layout, 2, 1, layerwise=layerwise, draft=1)
    res = c.run(room=13, tokens=15, chunk_tokens=5)
    assert all(ok for ok, _ in res), res


@pytest.mark.parametrize("ptp,dtp", [(2, 1), (1, 2)])
def test_fragmented_source(ptp, dtp):
    layout = KvLayout.gqa(page_size=1, **GQA4)
    c = Cluster(layout, ptp, dtp, gather=1 << 16)
    src = [3, 9, 1, 14, 6, 11, 20, 17, 30, 5, 40, 22, 33]
    res = c.run(room=14, tokens=13, chunk_tokens=13, src_order=src)
    assert all(ok for ok, _ in res), res


def test_sanity_corruption_detected_multi_rank(monkeypatch):
    layout = KvLayout.gqa(page_size=2, **GQA4)
    c = Cluster(layout, 2, 1)
    d = c.decoders[0]
    orig = d.hand_off

    def corrupt_then(room):
        kv, _ = c.keep[2]
        kv[1][20 * 2 * 4 * 8 + 3] ^= 1  # decode page 20, first token, layer 0 V
        return orig(room)

    monkeypatch.setattr(d, "hand_off", corrupt_then)
    res = c.run(room=15, tokens=13, chunk_tokens=5)
    assert res[0][0] is False and "mismatch" in res[0][1]


def test_two_sign_bit_flips_are_caught_for_any_key() -> None:
    """Two flips of a word's top bit cancel in a plain 64-bit weighted sum, for every key;
    summed in 32-bit pieces they do not."""
    from sgl_pd.core.kv_checksum import checksum_key, head_weights, region_sum, token_weights

    rows = np.random.default_rng(0).integers(0, 256, (12, 4, 16), dtype=np.uint8)
    bad = rows.copy()
    bad[2, 1, 7] ^= 0x80
    bad[9, 3, 15] ^= 0x80
    for secret in (b"a", b"b", b"any secret at all"):
        key = checksum_key(secret)
        t, h = token_weights(key, 5, 0, 0, 12), head_weights(key, 5, 0, 0, 4, 16)
        assert region_sum(bad, t, h) != region_sum(rows, t, h)


def test_a_decoder_refuses_kv_with_two_sign_bits_flipped(monkeypatch) -> None:
    layout = KvLayout.gqa(page_size=2, **GQA4)
    c = Cluster(layout, 2, 1)
    d = c.decoders[0]
    orig = d.hand_off

    def corrupt_then(room):
        kv, _ = c.keep[2]  # the decode rank's regions
        row = 4 * 8  # 4 heads x 8 bytes per token slot
        kv[0][20 * 2 * row + 7] ^= 0x80  # page 20 slot 0, head 0: bit 63
        kv[0][21 * 2 * row + 1 * 8 + 7] ^= 0x80  # page 21 slot 0, head 1: bit 63
        return orig(room)

    monkeypatch.setattr(d, "hand_off", corrupt_then)
    ((ok, err),) = c.run(room=15, tokens=13, chunk_tokens=5)
    assert not ok and "mismatch" in (err or "")
