"""Which source shard sends which KV heads to which destination shard (D12-D14).

Head placement follows SGLang's tensor parallelism: with `tp <= H` KV heads, rank r holds
heads [r*H/tp, (r+1)*H/tp); with `tp > H` every head is replicated R = tp/H times and rank r
holds head r // R. MLA is the H = 1 case: every rank holds the whole latent.

Replica sets (D14): R = max(1, tp // H) disjoint sets of ranks, set k = {r : r % R == k},
each holding every head exactly once. Each destination set is fed by one source set: the
same set index when both sides have the same number of sets (D12: rank i -> rank i, which
keeps rail-aligned NICs paired), otherwise a seeded, balanced random choice - a shuffled
list of source sets dealt round-robin - so every source set sends whenever there are at
least as many destination sets, and different requests (seeds) spread the load otherwise.
Inside a pair of sets, a link joins every (source, destination) rank pair whose head
ranges intersect (D13): several sources fill one destination page, or one source feeds
several destinations.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from sgl_pd.core.errors import ShardingError
from sgl_pd.core.layout import KvLayout


@dataclass(frozen=True)
class ShardingScheme:
    """How one server splits its KV cache: tensor-parallel size of attention."""

    tp_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ShardingError(f"tp_size must be a positive int, got {self.tp_size!r}")


@dataclass(frozen=True)
class ShardLink:
    """One source shard sending heads [head_lo, head_hi) (model-wide numbering) to one
    destination shard; the local offsets place that range inside each side's region."""

    src_rank: int
    dst_rank: int
    head_lo: int
    head_hi: int
    src_head_offset: int  # local index of head_lo in the source shard
    src_local_heads: int  # heads per page in the source shard's region
    dst_head_offset: int
    dst_local_heads: int

    @property
    def num_heads(self) -> int:
        return self.head_hi - self.head_lo


def _num_heads(layout: KvLayout) -> int:
    return layout.num_kv_heads  # MLA layouts carry 1 here


def _check(layout: KvLayout, scheme: ShardingScheme) -> None:
    heads, tp = _num_heads(layout), scheme.tp_size
    if heads % tp and tp % heads:
        raise ShardingError(
            f"{heads} KV heads cannot be sharded over TP {tp}: one must divide the other"
        )


def local_heads(layout: KvLayout, scheme: ShardingScheme) -> int:
    """Heads per page in one shard's regions."""
    _check(layout, scheme)
    return max(1, _num_heads(layout) // scheme.tp_size)


def head_range(layout: KvLayout, scheme: ShardingScheme, rank: int) -> tuple[int, int]:
    """Model-wide heads [lo, hi) held by `rank`."""
    _check(layout, scheme)
    heads, tp = _num_heads(layout), scheme.tp_size
    if not 0 <= rank < tp:
        raise ShardingError(f"rank {rank} outside TP {tp}")
    if tp <= heads:
        per = heads // tp
        return (rank * per, (rank + 1) * per)
    head = rank // (tp // heads)
    return (head, head + 1)


def replica_sets(layout: KvLayout, scheme: ShardingScheme) -> tuple[tuple[int, ...], ...]:
    """Disjoint rank sets, each holding every head once."""
    _check(layout, scheme)
    copies = max(1, scheme.tp_size // _num_heads(layout))
    return tuple(tuple(range(k, scheme.tp_size, copies)) for k in range(copies))


def assign_sets(num_src_sets: int, num_dst_sets: int, seed: int) -> tuple[int, ...]:
    """Source set index for each destination set (see the module docstring)."""
    if num_src_sets == num_dst_sets:
        return tuple(range(num_dst_sets))
    order = list(range(num_src_sets))
    random.Random(seed).shuffle(order)
    return tuple(order[j % num_src_sets] for j in range(num_dst_sets))


def link_shards(
    layout: KvLayout, src: ShardingScheme, dst: ShardingScheme, seed: int
) -> tuple[ShardLink, ...]:
    """All links of one request, sorted by (src_rank, dst_rank).

    `seed` must be the same on both sides (the request's bootstrap room), so the decoder
    derives the same links - and so the same expected completions - as the prefiller.
    """
    src_sets, dst_sets = replica_sets(layout, src), replica_sets(layout, dst)
    src_local, dst_local = local_heads(layout, src), local_heads(layout, dst)
    links: list[ShardLink] = []
    for dst_set, src_set_index in zip(
        dst_sets, assign_sets(len(src_sets), len(dst_sets), seed), strict=True
    ):
        for s in src_sets[src_set_index]:
            s_lo, s_hi = head_range(layout, src, s)
            for d in dst_set:
                d_lo, d_hi = head_range(layout, dst, d)
                lo, hi = max(s_lo, d_lo), min(s_hi, d_hi)
                if lo < hi:
                    links.append(
                        ShardLink(s, d, lo, hi, lo - s_lo, src_local, lo - d_lo, dst_local)
                    )
    return tuple(sorted(links, key=lambda link: (link.src_rank, link.dst_rank)))


def metadata_source(links: tuple[ShardLink, ...]) -> int:
    """The source rank that also writes the request's metadata (D9): the one feeding
    destination rank 0 its first head, so exactly one source writes it."""
    feeding_zero = [link for link in links if link.dst_rank == 0]
    if not feeding_zero:
        raise ShardingError("no link reaches destination rank 0")
    return min(feeding_zero, key=lambda link: link.head_lo).src_rank
