"""Sharded transfers for real: prefill-shard and decoder-shard processes, each owning its KV
pool, move one request's pages over Mooncake TCP on loopback; each decoder shard's memory is
compared byte for byte with an independent numpy reference of what it must hold.

The reference knows only the layout definition and SGLang's head placement: it never calls
the planner, the sharding links or the region tables, so a bug there cannot hide in it.
"""

from __future__ import annotations

import itertools
import multiprocessing as mp
import queue
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import pytest

pytest.importorskip("mooncake.engine")

import shard_worker as sw

from sgl_pd.core.counting import SLOT_WORDS, WORD_BYTES, count_word, metadata_word
from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.plan import TokenRange
from sgl_pd.core.sharding import ShardingScheme

U8 = npt.NDArray[np.uint8]
I64 = npt.NDArray[np.int64]
T = TypeVar("T")

ELEM_BYTES = 2  # bytes per element (bf16)
HEAD_DIM = 16  # elements per (token, head); MLA: kv_lora_rank 12 + rope_dim 4
POOL_PAGES = 32  # pages of every shard's pool
REQUEST_PAGES = 10  # pages the request spans; its last page is partly filled
ARENA_BYTES = 1 << 20  # bytes each worker registers; the pool sits at a random offset
Q_TIMEOUT_S = 30.0  # seconds any queue read may wait
DECODE_TIMEOUT_S = 20.0  # seconds a decoder shard waits for its completion words
STOP_WAIT_S = 10.0  # seconds a worker gets to exit after Stop


@dataclass(frozen=True)
class Case:
    mla: bool
    heads: int  # model-wide KV heads; 1 for MLA
    tp_p: int
    tp_d: int
    page_layout: PageLayout
    page_size: int  # tokens per page
    num_layers: int
    layer_group_size: int

    @property
    def id(self) -> str:
        model = "mla" if self.mla else f"gqa{self.heads}"
        return f"{model}-{self.page_layout.value}-tp{self.tp_p}to{self.tp_d}"

    @property
    def parts(self) -> int:
        return 1 if self.mla else 2  # latent, or K and V

    @property
    def row(self) -> int:
        return HEAD_DIM * ELEM_BYTES  # bytes of one (token, head) vector

    def layout(self) -> KvLayout:
        if self.mla:
            return KvLayout.mla(
                num_layers=self.num_layers,
                kv_lora_rank=12,
                rope_dim=4,
                page_size=self.page_size,
                elem_bytes=ELEM_BYTES,
                page_layout=self.page_layout,
            )
        return KvLayout.gqa(
            num_layers=self.num_layers,
            num_kv_heads=self.heads,
            head_dim=HEAD_DIM,
            page_size=self.page_size,
            elem_bytes=ELEM_BYTES,
            page_layout=self.page_layout,
        )


NHD, HND = PageLayout.NHD, PageLayout.HND


def _gqa(heads: int, tp_p: int, tp_d: int, page_layout: PageLayout) -> Case:
    return Case(
        False, heads, tp_p, tp_d, page_layout, page_size=4, num_layers=3, layer_group_size=2
    )


def _mla(tp_p: int, tp_d: int) -> Case:
    return Case(True, 1, tp_p, tp_d, NHD, page_size=8, num_layers=2, layer_group_size=1)


CASES = [
    # 8 KV heads: identical sharding, more prefill shards, more decoder shards, TP 8
    _gqa(8, 1, 1, NHD),
    _gqa(8, 2, 2, HND),
    _gqa(8, 4, 2, NHD),
    _gqa(8, 4, 2, HND),
    _gqa(8, 2, 4, NHD),
    _gqa(8, 2, 4, HND),
    _gqa(8, 1, 4, NHD),
    _gqa(8, 1, 4, HND),
    _gqa(8, 4, 1, NHD),
    _gqa(8, 4, 1, HND),
    _gqa(8, 8, 2, HND),
    _gqa(8, 2, 8, NHD),
    # 2 KV heads: replicated heads on the TP 4 / TP 8 side
    _gqa(2, 4, 2, NHD),
    _gqa(2, 2, 4, HND),
    _gqa(2, 4, 4, NHD),
    _gqa(2, 4, 1, HND),
    _gqa(2, 8, 2, NHD),
    # MLA: the latent replicated on every rank
    _mla(2, 2),
    _mla(4, 2),
    _mla(2, 4),
    _mla(8, 2),
]


# -- the independent reference -------------------------------------------------------------


def held_heads(case: Case, tp: int, rank: int) -> tuple[int, int]:
    """Heads [lo, hi) TP rank `rank` holds: contiguous blocks, or one replicated head."""
    if case.mla:
        return (0, 1)
    if tp <= case.heads:
        per = case.heads // tp
        return (rank * per, rank * per + per)
    head = rank * case.heads // tp
    return (head, head + 1)


def pool_image(case: Case, kv: U8, pages: I64, heads: tuple[int, int], fill: U8) -> U8:
    """A shard's pool, regions back to back, with token t of `kv` (regions, tokens, heads,
    row) in slot t % page_size of page pages[t // page_size]; other bytes from `fill`."""
    lo, hi = heads
    size = case.page_size
    # (regions, pages, page_size, local heads, row): NHD order
    img = fill.reshape(kv.shape[0], POOL_PAGES, size, hi - lo, case.row).copy()
    t = np.arange(kv.shape[1])
    img[:, pages[t // size], t % size] = kv[:, :, lo:hi]
    if case.page_layout is HND:
        img = img.transpose(0, 1, 3, 2, 4)  # (regions, pages, local heads, page_size, row)
    return np.ascontiguousarray(img).reshape(-1)


def pool_bytes(case: Case, tp: int) -> int:
    local = max(1, case.heads // tp)
    return case.num_layers * case.parts * POOL_PAGES * case.page_size * local * case.row


def links_into_rank(case: Case, dst_rank: int) -> int:
    """Source ranks one decoder rank hears from: one per distinct source head block it
    overlaps (replicas of a block send once)."""
    d_lo, d_hi = held_heads(case, case.tp_d, dst_rank)
    blocks = {held_heads(case, case.tp_p, s) for s in range(case.tp_p)}
    return sum(1 for lo, hi in blocks if lo < d_hi and d_lo < hi)


def check_sources(case: Case, dst_rank: int, words: npt.NDArray[np.uint64], slot: int) -> list[int]:
    """Ranks whose count word is set in `slot` of a decoder's word area; each must hold a
    head block of its own that overlaps the decoder rank's heads."""
    row = words.reshape(sw.SLOTS, SLOT_WORDS)[slot]
    senders = [int(i) for i in np.flatnonzero(row[1:])]  # word 1 + rank
    d_lo, d_hi = held_heads(case, case.tp_d, dst_rank)
    blocks = [held_heads(case, case.tp_p, s) for s in senders]
    assert len(set(blocks)) == len(blocks), f"replicas {senders} both sent to rank {dst_rank}"
    for s, (lo, hi) in zip(senders, blocks, strict=True):
        assert s < case.tp_p and lo < d_hi and d_lo < hi, f"rank {s} cannot feed {dst_rank}"
    return senders


def describe_mismatch(case: Case, got: U8, want: U8, offset: int) -> str:
    bad = np.flatnonzero(got != want)
    first = int(bad[0])
    region_bytes = pool_bytes(case, case.tp_d) // (case.num_layers * case.parts)
    where = "outside the pool"
    if offset <= first < offset + region_bytes * case.num_layers * case.parts:
        region, inside = divmod(first - offset, region_bytes)
        local = max(1, case.heads // case.tp_d)
        dims = (POOL_PAGES, case.page_size, local)
        if case.page_layout is HND:
            dims = (POOL_PAGES, local, case.page_size)
        names = ("page", "slot", "head") if case.page_layout is NHD else ("page", "head", "slot")
        index = np.unravel_index(inside // case.row, dims)
        where = f"region {region}, " + ", ".join(
            f"{n} {int(i)}" for n, i in zip(names, index, strict=True)
        )
    return (
        f"{bad.shape[0]} bytes differ; first at arena byte {first} ({where}): "
        f"got {int(got[first])}, want {int(want[first])}"
    )


# -- the worker processes ------------------------------------------------------------------


@dataclass
class Worker:
    hello: sw.Hello
    cmd: Any
    out: Any
    proc: Any

    def put(self, msg: object) -> None:
        self.cmd.put(msg)

    def get(self, want: type[T], what: str) -> T:
        try:
            msg = self.out.get(timeout=Q_TIMEOUT_S)
        except queue.Empty:
            raise AssertionError(f"{what}: no answer within {Q_TIMEOUT_S:g} s") from None
        if isinstance(msg, sw.Failed):
            raise AssertionError(f"{what} failed in its process:\n{msg.error}")
        assert isinstance(msg, want), f"{what}: expected {want.__name__}, got {msg!r}"
        return msg

    def stop(self, *, graceful: bool) -> None:
        _end(self.cmd, self.out, self.proc, graceful=graceful)


def _end(cmd: Any, out: Any, proc: Any, *, graceful: bool) -> None:
    """Asks a worker to exit (kills it if it does not), or kills it at once."""
    try:
        if graceful and proc.is_alive():
            cmd.put(sw.Stop())
            proc.join(STOP_WAIT_S)
    finally:
        if proc.is_alive():
            proc.kill()
            proc.join(STOP_WAIT_S)
        for q in (cmd, out):
            q.close()
            q.cancel_join_thread()


class ShardPool:
    """Worker processes shared by the cases; a case takes as many as it has shards."""

    def __init__(self) -> None:
        self._ctx = mp.get_context("spawn")
        self._workers: list[Worker] = []

    def take(self, n: int) -> list[Worker]:
        started = []
        try:
            for _ in range(n - len(self._workers)):  # start together, then wait for all
                cmd, out = self._ctx.Queue(), self._ctx.Queue()
                proc = self._ctx.Process(target=sw.serve, args=(cmd, out, ARENA_BYTES), daemon=True)
                proc.start()
                started.append((cmd, out, proc))
            for cmd, out, proc in started:
                hello = out.get(timeout=Q_TIMEOUT_S)
                assert isinstance(hello, sw.Hello), hello
                self._workers.append(Worker(hello, cmd, out, proc))
        except BaseException:
            for cmd, out, proc in started:
                if all(w.proc is not proc for w in self._workers):
                    _end(cmd, out, proc, graceful=False)
            raise
        return self._workers[:n]

    def discard(self, *, graceful: bool) -> None:
        """Stops every worker; after a failed case, kills them at once (one may still be
        waiting for words that never come, and their queues may hold stale answers)."""
        workers, self._workers = self._workers, []
        if graceful:
            for w in workers:  # all exit together; stop() then only waits
                if w.proc.is_alive():
                    w.cmd.put(sw.Stop())
        for w in workers:
            w.stop(graceful=graceful)


@pytest.fixture(scope="module")
def pool() -> Iterator[ShardPool]:
    p = ShardPool()
    try:
        yield p
    finally:
        p.discard(graceful=True)


# -- one request ---------------------------------------------------------------------------


def _chunks(rng: np.random.Generator, num_tokens: int, page_size: int) -> tuple[TokenRange, ...]:
    """Two to four chunks; the first ends mid-page."""
    first = int(rng.integers(1, num_tokens))
    while first % page_size == 0:
        first = int(rng.integers(1, num_tokens))
    more = rng.choice(np.arange(1, num_tokens), size=int(rng.integers(0, 3)), replace=False)
    cuts = sorted({first, *more.tolist()})
    bounds = [0, *cuts, num_tokens]
    return tuple(TokenRange(a, b) for a, b in itertools.pairwise(bounds))


@dataclass
class Outcome:
    sent: list[sw.Sent]  # per prefill rank
    done: list[sw.Snapshot]  # per decoder rank, taken the moment its words were complete
    after: list[sw.Snapshot]  # per decoder rank, after every prefill shard finished


def _run(
    workers: list[Worker],
    request: sw.Request,
    kv: U8,
    src_pages: I64,
    dst_pages: list[I64],
    offsets: list[int],
    slots: list[int],
    case: Case,
    rng: np.random.Generator,
) -> Outcome:
    prefills, decoders = workers[: case.tp_p], workers[case.tp_p :]
    for d, w in enumerate(decoders):
        w.put(sw.DecodeShard(request, d, offsets[case.tp_p + d], slots[d], DECODE_TIMEOUT_S))
    for p, w in enumerate(prefills):
        n = pool_bytes(case, case.tp_p)
        garbage = rng.integers(0, 256, n, dtype=np.uint8)
        image = pool_image(case, kv, src_pages, held_heads(case, case.tp_p, p), garbage)
        w.put(sw.PrefillShard(request, p, offsets[p], image.tobytes(), int(rng.integers(1 << 31))))
    d_tables = [w.get(sw.Prepared, f"decoder rank {d} setup") for d, w in enumerate(decoders)]
    for p, w in enumerate(prefills):
        w.get(sw.Prepared, f"prefill rank {p} setup")
    targets = tuple(
        sw.Target(
            d,
            w.hello.session,
            d_tables[d].table,
            w.hello.words_base + slots[d] * SLOT_WORDS * WORD_BYTES,
            tuple(dst_pages[d].tolist()),
        )
        for d, w in enumerate(decoders)
    )
    for w in prefills:
        w.put(sw.Send(tuple(src_pages.tolist()), targets))
    sent = [w.get(sw.Sent, f"prefill rank {p} send") for p, w in enumerate(prefills)]
    done = [w.get(sw.Snapshot, f"decoder rank {d} receive") for d, w in enumerate(decoders)]
    for w in decoders:
        w.put(sw.Read())
    after = [w.get(sw.Snapshot, f"decoder rank {d} read") for d, w in enumerate(decoders)]
    return Outcome(sent, done, after)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_request_pages_arrive_exactly(pool: ShardPool, case: Case) -> None:
    rng = np.random.default_rng(zlib.crc32(case.id.encode()))
    size = case.page_size
    num_tokens = (REQUEST_PAGES - 1) * size + int(rng.integers(1, size))  # last page partial
    request = sw.Request(
        layout=case.layout(),
        prefill=ShardingScheme(case.tp_p),
        decode=ShardingScheme(case.tp_d),
        request_id=int(rng.integers(1, 1 << 62)),
        chunks=_chunks(rng, num_tokens, size),
        layer_group_size=case.layer_group_size,
        num_pages=POOL_PAGES,
    )
    regions = case.num_layers * case.parts
    # the logical KV of the request: (regions, tokens, model-wide heads, row bytes)
    kv = rng.integers(0, 256, (regions, num_tokens, case.heads, case.row), dtype=np.uint8)
    src_pages = rng.permutation(POOL_PAGES)[:REQUEST_PAGES]
    dst_pages = [rng.permutation(POOL_PAGES)[:REQUEST_PAGES] for _ in range(case.tp_d)]
    sizes = [pool_bytes(case, case.tp_p)] * case.tp_p + [pool_bytes(case, case.tp_d)] * case.tp_d
    offsets = [int(rng.integers(0, (ARENA_BYTES - n) // 64 + 1)) * 64 for n in sizes]
    slots = [int(rng.integers(sw.SLOTS)) for _ in range(case.tp_d)]

    workers = pool.take(case.tp_p + case.tp_d)
    workers = [workers[i] for i in rng.permutation(len(workers))]  # roles move between cases
    try:
        out = _run(workers, request, kv, src_pages, dst_pages, offsets, slots, case, rng)
    except BaseException:
        pool.discard(graceful=False)
        raise

    layer_groups = len(range(0, case.num_layers, case.layer_group_size))
    groups_per_link = len(request.chunks) * layer_groups
    # the workers send even chunks one layer group per batch, odd chunks in one batch
    batches_per_link = sum(1 if c % 2 else layer_groups for c in range(len(request.chunks)))
    want_bytes = want_groups = want_batches = 0
    for d in range(case.tp_d):
        lo, hi = held_heads(case, case.tp_d, d)
        want_bytes += regions * num_tokens * (hi - lo) * case.row
        n_sources = links_into_rank(case, d)
        want_groups += n_sources * groups_per_link
        want_batches += n_sources * batches_per_link
        offset = offsets[case.tp_p + d]
        zeros = np.zeros(pool_bytes(case, case.tp_d), dtype=np.uint8)
        want = np.zeros(ARENA_BYTES, dtype=np.uint8)
        want[offset : offset + zeros.shape[0]] = pool_image(case, kv, dst_pages[d], (lo, hi), zeros)
        # which replica of a head block sends is the seed's choice: the reference accepts
        # any set of sources holding distinct blocks that overlap this rank's heads
        words = np.zeros((sw.SLOTS, SLOT_WORDS), dtype=np.uint64)
        words[slots[d], 0] = metadata_word(request.request_id)
        final = count_word(request.request_id, groups_per_link)
        senders = check_sources(case, d, np.frombuffer(out.after[d].words, dtype="<u8"), slots[d])
        assert len(senders) == n_sources, f"decoder rank {d}: count words of {senders}"
        words[slots[d], [1 + s for s in senders]] = final
        for when, snap in (("when complete", out.done[d]), ("at the end", out.after[d])):
            got = np.frombuffer(snap.arena, dtype=np.uint8)
            if not np.array_equal(got, want):
                pytest.fail(
                    f"decoder rank {d} {when}: " + describe_mismatch(case, got, want, offset)
                )
            got_words = np.frombuffer(snap.words, dtype="<u8").reshape(words.shape)
            np.testing.assert_array_equal(got_words, words, f"decoder rank {d} words, {when}")
    # every destination byte written once: no replica set sent twice
    assert sum(s.nbytes for s in out.sent) == want_bytes
    assert sum(s.groups for s in out.sent) == want_groups
    assert sum(s.batches for s in out.sent) == want_batches
