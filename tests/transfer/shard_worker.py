"""A KV shard process for the sharded Mooncake tests: one engine, one registered arena that
holds the shard's KV pool, and a registered completion-word area. Started with the
multiprocessing spawn context; it plays a prefill or a decoder shard per request, as the
parent's typed messages say, and answers each on its own queue.

Prefill side, as `PrefillMessenger` does it: per destination rank, `links_into` the request's
links, plan each chunk, send the groups of its own links in data batches and, after each
batch, its count of groups done so far into its own count word of the destination's slot;
then the metadata word if it feeds the destination's first head. Decoder side, as
`DecodeMessenger` does it: read its slot's count words into a `CompletionCounter` until the
request is complete, then snapshot its memory at once.
"""

from __future__ import annotations

import queue
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np

from sgl_pd.core.counting import (
    METADATA_WORD,
    SLOT_WORDS,
    WORD_BYTES,
    CompletionCounter,
    WriteGroup,
    count_word,
    expectation_for,
    links_into,
    metadata_word,
    parse_count_word,
    source_word_index,
    source_word_offset,
)
from sgl_pd.core.layout import KvLayout
from sgl_pd.core.plan import TokenRange, TransferPlan, plan_transfer
from sgl_pd.core.regions import RegionTable
from sgl_pd.core.sharding import ShardingScheme, link_shards, local_heads
from sgl_pd.transfer.completion import CompletionWordWriter
from sgl_pd.transfer.config import TransportConfig
from sgl_pd.transfer.engine import Writes
from sgl_pd.transfer.mooncake import MooncakeTransferEngine

IDLE_EXIT_S = 120.0  # seconds without a command before a worker exits on its own
COMMAND_WAIT_S = 0.5  # seconds per wait for a command, between idle checks
POLL_S = 0.0005  # seconds between scans of the completion slot
SLOTS = 4  # completion slots in a decoder's word area, SLOT_WORDS words each


# -- messages: parent -> worker -----------------------------------------------------------


@dataclass(frozen=True)
class Request:
    """What every shard of one request knows."""

    layout: KvLayout
    prefill: ShardingScheme
    decode: ShardingScheme
    request_id: int  # also the link seed (the bootstrap room)
    chunks: tuple[TokenRange, ...]  # consecutive, from token 0
    layer_group_size: int
    num_pages: int  # pages of every shard's pool


@dataclass(frozen=True)
class PrefillShard:
    request: Request
    rank: int
    pool_offset: int  # bytes from the arena start
    pool: bytes  # the pool's initial bytes, regions back to back
    garbage_seed: int  # the rest of the arena is random bytes from this seed


@dataclass(frozen=True)
class DecodeShard:
    request: Request
    rank: int
    pool_offset: int  # bytes from the arena start; the whole arena starts zeroed
    slot: int  # completion slot of the request
    timeout_s: float  # seconds to wait for the request's completion words


@dataclass(frozen=True)
class Target:
    """One decoder rank as a prefill shard addresses it."""

    rank: int
    session: str
    table: RegionTable
    slot_addr: int  # address of the request's completion slot
    dst_pages: tuple[int, ...]


@dataclass(frozen=True)
class Send:
    src_pages: tuple[int, ...]
    targets: tuple[Target, ...]


@dataclass(frozen=True)
class Read:
    """Snapshot the arena and word area again (after every prefill shard finished)."""


@dataclass(frozen=True)
class Stop:
    pass


# -- messages: worker -> parent -----------------------------------------------------------


@dataclass(frozen=True)
class Hello:
    session: str
    arena_base: int  # address of the registered arena
    words_base: int  # address of the registered completion-word area


@dataclass(frozen=True)
class Prepared:
    table: RegionTable


@dataclass(frozen=True)
class Sent:
    nbytes: int  # data bytes written, words not included
    groups: int
    batches: int  # data batches, each followed by a count word


@dataclass(frozen=True)
class Snapshot:
    arena: bytes
    words: bytes  # the whole word area, (SLOTS, SLOT_WORDS) little-endian uint64


@dataclass(frozen=True)
class Failed:
    error: str


class _Shard:
    """The worker's engine and memory, reused by every request it serves."""

    def __init__(self, arena_bytes: int) -> None:
        self.engine = MooncakeTransferEngine(TransportConfig(protocol="tcp", hostname="127.0.0.1"))
        self.arena = np.zeros(arena_bytes, dtype=np.uint8)  # (arena_bytes,) KV pool inside
        self.words = np.zeros((SLOTS, SLOT_WORDS), dtype=np.uint64)
        self.arena_base = int(self.arena.ctypes.data)
        self.words_base = int(self.words.ctypes.data)
        self.engine.register(self.arena_base, self.arena.nbytes)
        self.engine.register(self.words_base, self.words.nbytes)
        self.writer = CompletionWordWriter(self.engine, slots=8)
        self.prefill: PrefillShard | None = None
        self.table: RegionTable | None = None

    def close(self) -> None:
        self.writer.close()
        self.engine.close()

    def snapshot(self) -> Snapshot:
        return Snapshot(self.arena.tobytes(), self.words.tobytes())

    def _table(self, request: Request, scheme: ShardingScheme, offset: int) -> RegionTable:
        lay = request.layout
        table = RegionTable.packed(
            lay, request.num_pages, local_heads(lay, scheme), base=self.arena_base + offset
        )
        end = int(table.bases[-1] + table.lengths[-1]) - self.arena_base
        if end > self.arena.nbytes:
            raise ValueError(f"pool ends at byte {end}, past the {self.arena.nbytes}-byte arena")
        return table

    def prepare_prefill(self, job: PrefillShard) -> Prepared:
        self.table = self._table(job.request, job.request.prefill, job.pool_offset)
        rng = np.random.default_rng(job.garbage_seed)
        self.arena[:] = rng.integers(0, 256, self.arena.nbytes, dtype=np.uint8)
        pool = np.frombuffer(job.pool, dtype=np.uint8)
        self.arena[job.pool_offset : job.pool_offset + pool.shape[0]] = pool
        self.prefill = job
        return Prepared(self.table)

    def send(self, cmd: Send) -> Sent:
        job, table = self.prefill, self.table
        if job is None or table is None:
            raise RuntimeError("Send before PrefillShard")
        req = job.request
        lay = req.layout
        num_groups = len(lay.layer_groups(req.layer_group_size))
        all_links = link_shards(lay, req.prefill, req.decode, seed=req.request_id)
        nbytes = groups = batches = 0
        for target in sorted(cmd.targets, key=lambda t: t.rank):
            links = links_into(all_links, target.rank)
            mine = {i for i, link in enumerate(links) if link.src_rank == job.rank}
            if not mine:
                continue
            word_addr = target.slot_addr + source_word_offset(job.rank)
            done = 0  # groups of this request finished into this destination rank
            for c, tokens in enumerate(req.chunks):
                plan = plan_transfer(lay, links, cmd.src_pages, target.dst_pages, tokens)
                todo = [g for g in plan.groups(c, req.layer_group_size) if g.link_index in mine]
                # even chunks: one batch per group; odd chunks: one batch for all, so the
                # decoder also sees counts that jump
                step = len(todo) if c % 2 else 1
                for i in range(0, len(todo), step):
                    part = todo[i : i + step]
                    writes = Writes.concat([self._writes(plan, g, table, target) for g in part])
                    done += len(part)
                    self.writer.send(
                        target.session, writes, word_addr, count_word(req.request_id, done)
                    )
                    nbytes += writes.total_bytes
                    groups += len(part)
                    batches += 1
            # the metadata word, after this source's last chunk (D9)
            if expectation_for(links, num_groups).metadata_source == job.rank:
                self.writer.send(
                    target.session,
                    Writes.empty(),
                    target.slot_addr + METADATA_WORD * WORD_BYTES,
                    metadata_word(req.request_id),
                )
        return Sent(nbytes, groups, batches)

    def _writes(
        self, plan: TransferPlan, group: WriteGroup, table: RegionTable, target: Target
    ) -> Writes:
        batch = plan.batch(group.link_index, group.layers, table, target.table)
        if (batch.src_rank, batch.dst_rank) != (group.src_rank, target.rank):
            raise RuntimeError(f"batch {batch.src_rank}->{batch.dst_rank} misrouted")
        return Writes.of(batch.src_addrs, batch.dst_addrs, batch.lengths)

    def receive(self, job: DecodeShard, out_q: Any) -> Snapshot:
        """Replies `Prepared`, then reads the slot's words until the request completes."""
        req = job.request
        lay = req.layout
        self.arena[:] = 0
        self.words[:] = 0
        table = self._table(req, req.decode, job.pool_offset)
        out_q.put(Prepared(table))
        links = links_into(link_shards(lay, req.prefill, req.decode, req.request_id), job.rank)
        expectation = expectation_for(links, len(lay.layer_groups(req.layer_group_size)))
        counter = CompletionCounter(expectation)
        counter.seal(len(req.chunks))
        sources = {source_word_index(src): src for src, _ in expectation.per_chunk}
        row = self.words[job.slot]  # (SLOT_WORDS,) view the peers write into
        counts: list[tuple[int, int]] = []  # (source, count) as first read, for the report
        has_metadata = False
        deadline = time.monotonic() + job.timeout_s
        while True:
            # a copy first: each word is read once per scan, and np.flatnonzero on memory
            # that peers are writing raises when the count of non-zero words changes
            words = row.copy()
            for w in np.flatnonzero(words).tolist():
                word = int(words[w])
                if w == METADATA_WORD:
                    if word != metadata_word(req.request_id):
                        raise RuntimeError(f"metadata word {word:#x} is not this request's")
                    if not has_metadata:
                        counter.record_metadata(expectation.metadata_source)
                        has_metadata = True
                    continue
                if w not in sources:
                    raise RuntimeError(f"word {w} holds {word:#x}, but no source writes it")
                count = parse_count_word(word, req.request_id)
                if count is None:
                    raise RuntimeError(f"word {w} holds {word:#x}, not a count of this request")
                counter.observe(sources[w], count)  # raises if a count went down
                if (sources[w], count) not in counts:
                    counts.append((sources[w], count))
            if counter.is_complete:
                # at once: what a decoder would read right after counting the last word
                return self.snapshot()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"decoder rank {job.rank}: {counter.received} of {counter.expected} groups"
                    f" (metadata {'in' if has_metadata else 'missing'}) after"
                    f" {job.timeout_s:g} s; (source, count) read: {counts}"
                )
            time.sleep(POLL_S)


def serve(cmd_q: Any, out_q: Any, arena_bytes: int) -> None:
    shard = _Shard(arena_bytes)
    out_q.put(Hello(shard.engine.session_id, shard.arena_base, shard.words_base))
    last = time.monotonic()
    try:
        while time.monotonic() - last < IDLE_EXIT_S:
            try:
                cmd = cmd_q.get(timeout=COMMAND_WAIT_S)
            except queue.Empty:
                continue
            last = time.monotonic()
            if isinstance(cmd, Stop):
                break
            try:
                if isinstance(cmd, PrefillShard):
                    out_q.put(shard.prepare_prefill(cmd))
                elif isinstance(cmd, Send):
                    out_q.put(shard.send(cmd))
                elif isinstance(cmd, DecodeShard):
                    out_q.put(shard.receive(cmd, out_q))
                elif isinstance(cmd, Read):
                    out_q.put(shard.snapshot())
                else:
                    raise TypeError(f"unknown command {cmd!r}")
            except Exception:
                out_q.put(Failed(traceback.format_exc()))
            last = time.monotonic()
    finally:
        shard.close()
