"""--pd-kv-checksum across every way KV travels: mismatched TP both ways (including heads
replicated on either side), MLA, page sizes 1 and 4, chunks that start mid-page, a held
prefix, layer-wise and after-forward, draft layers, gather and receive staging and
fragmented source pages: each decode rank verifies correct KV (no false mismatch), and
a corruption - even sign bits alone, which cancel in a plain 64-bit sum - is caught."""

from __future__ import annotations

import time

import numpy as np
import pytest

from sgl_pd.backend.decode.messenger import DecodeMessenger
from sgl_pd.backend.kv_sums import KvSums
from sgl_pd.backend.metrics import TransferMetrics
from sgl_pd.backend.pool import PoolDescription
from sgl_pd.backend.prefill.messenger import PrefillMessenger
from sgl_pd.backend.relayout_copies import PoolCopies
from sgl_pd.backend.staging_area import Staging, StagingArea
from sgl_pd.core.clock import ManualClock
from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.page_ids import PageIds
from sgl_pd.core.regions import Region, RegionTable
from sgl_pd.core.sharding import ShardingScheme, local_heads
from sgl_pd.core.states import DecodeState
from sgl_pd.core.wire import (
    Abort,
    AbortAck,
    ChunkNotice,
    ErrorMsg,
    MetadataBuffers,
    Role,
    ShardRegistration,
    TransferRequest,
)
from sgl_pd.transfer.fake import FakeFabric, FakeTransferEngine

NUM_PAGES, AUX_ROWS, AUX_ITEM, KEY = 64, 8, 16, 0x1234


def _pool(layout, lh, engine, fill, draft=0):
    rng = np.random.default_rng(fill)
    size = NUM_PAGES * layout.page_size * lh * layout.row_bytes
    kv = [
        rng.integers(0, 255, size, dtype=np.uint8) if fill is not None else np.zeros(size, np.uint8)
        for _ in range(layout.num_regions)
    ]
    aux = np.zeros(AUX_ROWS * AUX_ITEM, np.uint8)
    for b in (*kv, aux):
        engine.register(int(b.ctypes.data), b.nbytes)
    regions = tuple(Region(int(b.ctypes.data), b.nbytes) for b in kv)
    pool = PoolDescription(
        layout=layout,
        local_heads=lh,
        kv=RegionTable.for_layout(layout, regions),
        draft_layers=draft,
        num_pages=NUM_PAGES,
        aux=(Region(int(aux.ctypes.data), aux.nbytes),),
        aux_item_bytes=(AUX_ITEM,),
        aux_rows=AUX_ROWS,
    )
    return pool, (kv, aux)


class Cluster:
    def __init__(self, layout, ptp, dtp, layerwise=False, gather=0, recv=0, draft=0):
        self.layout, self.fabric, self.clock = layout, FakeFabric(), ManualClock()
        self.keep = []
        self.prefills, self.pregs, self.decoders, self.dregs = [], [], [], []
        ps = ShardingScheme(ptp)
        for r in range(ptp):
            eng = FakeTransferEngine(self.fabric)
            pool, mem = _pool(layout, local_heads(layout, ps), eng, fill=100 + r, draft=draft)
            self.keep.append(mem)
            staging = None
            if gather:
                staging = Staging(StagingArea(gather, "cpu", eng), PoolCopies(pool, "cpu"))
            m = PrefillMessenger(
                rank=r,
                instance=100 + r,
                scheme=ps,
                pool=pool,
                engine=eng,
                sums=KvSums(pool, "cpu", KEY),
                layerwise=layerwise,
                send_to_decoder=self._to_decoder,
                metrics=TransferMetrics(False, "prefill"),
                timeout_s=30.0,
                clock=self.clock,
                staging=staging,
            )
            self.prefills.append(m)
            self.pregs.append(
                ShardRegistration(
                    role=Role.PREFILL,
                    rank=r,
                    scheme=ps,
                    session=eng.session_id,
                    inbox=f"prefill-{r}",
                    instance=100 + r,
                    layout=layout,
                    num_pages=NUM_PAGES,
                    kv_regions=pool.kv.regions,
                    layer_group_size=m.layer_group_size,
                    metadata=MetadataBuffers(
                        regions=pool.aux, row_bytes=(AUX_ITEM,), rows=AUX_ROWS
                    ),
                )
            )
        ds = ShardingScheme(dtp)
        for r in range(dtp):
            eng = FakeTransferEngine(self.fabric)
            pool, mem = _pool(layout, local_heads(layout, ds), eng, fill=None, draft=draft)
            self.keep.append(mem)
            staging, sreg = None, None
            if recv:
                area = StagingArea(recv, "cpu", eng)
                staging = Staging(area, PoolCopies(pool, "cpu"))
                sreg = Region(area.base, area.capacity)
            m = DecodeMessenger(
                rank=r,
                instance=200 + r,
                scheme=ds,
                pool=pool,
                engine=eng,
                send_to_prefill=self._to_prefill,
                transfer_timeout_s=30.0,
                metrics=TransferMetrics(False, "decode"),
                clock=self.clock,
                sums=KvSums(pool, "cpu", KEY),
                staging=staging,
            )
            self.decoders.append(m)
            self.dregs.append(
                ShardRegistration(
                    role=Role.DECODE,
                    rank=r,
                    scheme=ds,
                    session=eng.session_id,
                    inbox=f"decode-{r}",
                    instance=200 + r,
                    layout=layout,
                    num_pages=NUM_PAGES,
                    kv_regions=pool.kv.regions,
                    layer_group_size=1,
                    metadata=MetadataBuffers(
                        regions=pool.aux, row_bytes=(AUX_ITEM,), rows=AUX_ROWS
                    ),
                    completion=m.completion_area,
                    staging=sreg,
                )
            )

    def _to_decoder(self, inbox, message):
        d = self.decoders[int(inbox.split("-")[1])]
        if isinstance(message, ChunkNotice):
            d.on_chunk_notice(message)
        elif isinstance(message, AbortAck):
            d.on_abort_ack(message)
        elif isinstance(message, ErrorMsg):
            d.on_error(message)
        return True

    def _to_prefill(self, inbox, message):
        p = self.prefills[int(inbox.split("-")[1])]
        if isinstance(message, TransferRequest):
            p.on_transfer_request(message)
        elif isinstance(message, Abort):
            p.on_abort(message)
        return True

    def run(self, room, tokens, chunk_tokens, held_pages=0, src_order=None, dst_order=None):
        L = self.layout
        ps = L.page_size
        npages = -(-tokens // ps)
        for r, d in enumerate(self.decoders):
            dst = (
                np.arange(20, 20 + npages)[held_pages:]
                if dst_order is None
                else np.asarray(dst_order)[held_pages:]
            )
            d.request(
                room,
                self.pregs,
                self.dregs[r],
                np.asarray(dst, np.int64),
                room % AUX_ROWS,
                held_tokens=held_pages * ps,
            )
        src_all = list(range(1, 1 + npages)) if src_order is None else list(src_order)
        for p in self.prefills:
            p.track(room)
            p.expect(room, npages - held_pages, aux_index=room % AUX_ROWS)
            if p.layerwise:
                target = range(L.num_layers - p.draft_layers)
                sent_pages = held_pages
                for start in range(0, tokens, chunk_tokens):
                    end = min(start + chunk_tokens, tokens)
                    last = end == tokens
                    endp = -(-end // ps)
                    c = p.notice_chunk(room, PageIds.ready(src_all[:endp]), end, last)
                    chunks = [] if c is None else [c]
                    p.write_layers(chunks, target)
                    p.forward_done(chunks)
                    # SGLang sends whole pages except at the end
                    upto = endp if last else end // ps
                    upto = max(upto, held_pages)
                    part = np.asarray(src_all[sent_pages:upto], np.int64)
                    sent_pages = max(sent_pages, upto)
                    if len(part) or last:
                        p.submit_chunk(room, part, len(part))
            else:
                sent_tok = held_pages * ps
                for start in range(0, tokens, chunk_tokens):
                    end = min(start + chunk_tokens, tokens)
                    last = end == tokens
                    upto_tok = end if last else (end // ps) * ps
                    if upto_tok <= sent_tok and not last:
                        continue
                    first_p, last_p = sent_tok // ps, -(-upto_tok // ps)
                    part = np.asarray(src_all[first_p:last_p], np.int64)
                    n = max(0, upto_tok - sent_tok)
                    sent_tok = max(sent_tok, upto_tok)
                    p.submit_chunk(room, part, n)
        results = []
        for d in self.decoders:
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                st, err = d.poll(room)
                if st is DecodeState.COMPLETE or err is not None:
                    break
                time.sleep(0.005)
            st, err = d.poll(room)
            assert st is DecodeState.COMPLETE, (d.rank, st, err)
            ok = d.hand_off(room)
            results.append((ok, d.poll(room)[1]))
        for p in self.prefills:
            p.writers.close()
        return results


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
