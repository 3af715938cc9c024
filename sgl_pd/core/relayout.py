"""Re-layout of head slices that are strided in memory (NHD pools under mismatched TP).

In an NHD region a token slot holds all of the shard's heads side by side, so a link that
carries only some of a side's heads finds its bytes strided on that side: one
`nh * row`-byte piece every `local_heads * row` bytes. Written as they are, that is one
write per token slot. Staging turns the strided side contiguous:

- *gather* (source strided: the decoder holds fewer heads than the prefill rank): the
  prefill rank copies the link's heads of the chunk's pages into a staging block laid out
  as the destination's pages expect, `(chunk pages * page_size, nh, row)`, then writes
  one block per run of destination pages;
- *receive* (destination strided: the decoder holds more heads than one source sends):
  sources write contiguous blocks into the decoder's receive staging,
  `(request pages * page_size, nh, row)` per link and region, and the decoder scatters
  them into its pool once the request is complete, before SGLang schedules it.

A block's pages are in the order of their destination page ids (`block_positions`): then
a run of consecutive destination pages is a run of consecutive block pages, whatever the
order the request holds them in, and a staged link never needs more writes than the
same pages would under identical TP.

Where a side's slice is contiguous (identical TP, MLA replicas, HND) nothing is staged,
unless the decoder's pages are *fragmented*: a decoder whose prefix cache evicts and
reuses pages hands a request short runs of page ids, and since a write covers one run
on both sides, one write per page and region would go out. Such a decoder stages every
link of the request (`Relayout.receive_all`, `fragmented`), and its blocks hold the
pages in the request's own (logical) order instead: a chunk's tokens are one run of
block slots, so its writes follow the source's runs (a strided source is gathered, in
the same order), at the cost of the decoder's scatter.

A prefill's pages fragment the same way once its own prefix cache has evicted and
reused them: then the writes follow the source's short runs, whatever the decoder does.
A source rank with a gather area gathers such a chunk (`Relayout.gather_all`, decided
per chunk from its source pages), into blocks in the order the destination reads them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from sgl_pd.core.errors import PlanError
from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.regions import Region, RegionTable
from sgl_pd.core.sharding import ShardLink

I64 = npt.NDArray[np.int64]


def strided_on_source(layout: KvLayout, link: ShardLink) -> bool:
    """The link's heads are a strided slice of the source's NHD token slots."""
    return layout.page_layout is PageLayout.NHD and link.num_heads < link.src_local_heads


def strided_on_destination(layout: KvLayout, link: ShardLink) -> bool:
    """The link's heads are a strided slice of the destination's NHD token slots."""
    return layout.page_layout is PageLayout.NHD and link.num_heads < link.dst_local_heads


@dataclass(frozen=True)
class Relayout:
    """What staging one request's plan may use (each side decides what it offers)."""

    gather: bool  # the source rank stages strided source slices
    receive: bool  # the destination granted receive staging for this request
    # the destination's pages are fragmented: every link is received (and gathered
    # where the source can), not only the strided ones
    receive_all: bool = False
    # the source's pages of the chunk are fragmented: every link is gathered (where the
    # source rank can), so its writes follow the destination's runs, not the source's
    gather_all: bool = False


NO_RELAYOUT = Relayout(gather=False, receive=False)

# A request whose destination pages fall in more runs of consecutive ids than this is
# staged whole: a write per run and region (tens of thousands for a long prompt on a
# 60-layer model) costs more than copying the request's KV twice in device memory,
# which staged, a chunk's writes shrink to one per region.
MAX_UNSTAGED_RUNS = 4


def page_runs(pages: I64) -> int:
    """Runs of consecutive ascending page ids in `pages` (logical order): how many
    writes per region a chunk covering them needs at least, whatever the source does."""
    if pages.shape[0] == 0:
        return 0
    return 1 + int(np.count_nonzero(np.diff(pages) != 1))


def fragmented(pages: I64, max_runs: int = MAX_UNSTAGED_RUNS) -> bool:
    """The destination pages of a request fall in so many runs that it should be staged
    whole (a fresh pool hands out one or two)."""
    return page_runs(pages) > max_runs


@dataclass(frozen=True)
class StagedLink:
    """How one link's writes are laid out under a `Relayout`."""

    gathers: bool  # sources read from a gather block, not the pool
    receives: bool  # writes land in the decoder's receive staging, not its pool

    @property
    def staged(self) -> bool:
        return self.gathers or self.receives


UNSTAGED = StagedLink(gathers=False, receives=False)


def staged_link(layout: KvLayout, link: ShardLink, relayout: Relayout) -> StagedLink:
    """Staging for `link`. A destination-strided link receives whenever the destination
    granted receive staging, whatever the source can do (the decoder scatters every such
    link's blocks): a strided source that cannot gather then writes its token slots one
    by one into the blocks. Without a grant the link keeps per-slot writes into the pool
    (gathering alone would not make its writes contiguous)."""
    src, dst = strided_on_source(layout, link), strided_on_destination(layout, link)
    nhd = layout.page_layout is PageLayout.NHD  # HND pages hold a rank's slice whole
    gathers = (src or (relayout.gather_all and nhd)) and relayout.gather
    if relayout.receive and relayout.receive_all:
        if layout.page_layout is not PageLayout.NHD:
            raise PlanError("only NHD pages are staged whole (blocks are token slots)")
        # a source whose slice is contiguous writes its page runs straight into the
        # blocks unless they are fragmented too (`gather_all`)
        return StagedLink(gathers=gathers, receives=True)
    if dst and not relayout.receive:
        return UNSTAGED
    return StagedLink(gathers=gathers, receives=dst)


def block_bytes(layout: KvLayout, link: ShardLink, num_pages: int) -> int:
    """Bytes of one staged block: `num_pages` pages of the link's heads, one region."""
    return num_pages * layout.page_size * link.num_heads * layout.row_bytes


def block_table(
    layout: KvLayout, base: int, first_region: int, block: int, num_blocks: int
) -> RegionTable:
    """A region table whose regions `first_region ...` are consecutive staged blocks from
    `base` (the planner's addressing takes a table; earlier regions are unused)."""
    regions = [Region(0, 0)] * layout.num_regions
    for i in range(num_blocks):
        regions[first_region + i] = Region(base + i * block, block)
    return RegionTable(tuple(regions))


@dataclass(frozen=True)
class ReceivePlacement:
    """Where one request's receive staging puts each link's blocks on a decode rank:
    link after link (links in counting order), each link's regions back to back."""

    offsets: dict[int, int]  # link index (into the links given) -> byte offset of block 0
    block: dict[int, int]  # link index -> bytes per block
    total: int  # bytes of the request's receive staging
    # blocks hold the request's pages in its order (staged whole), else in ascending
    # destination page id (`block_positions`)
    logical: bool = False

    def table(self, layout: KvLayout, link_index: int, base: int) -> RegionTable:
        """The staged blocks of one link when the request's staging starts at `base`."""
        return block_table(
            layout,
            base + self.offsets[link_index],
            0,
            self.block[link_index],
            layout.num_regions,
        )


def receive_placement(
    layout: KvLayout, links: tuple[ShardLink, ...], num_pages: int, all_links: bool = False
) -> ReceivePlacement:
    """Receive staging of a request of `num_pages` pages for the links into one decode
    rank: the blocks of every link strided on the destination (of every link, with
    `all_links`: fragmented pages). Both sides compute it from the same links, so only
    the base address travels."""
    if all_links and layout.page_layout is not PageLayout.NHD:
        raise PlanError("only NHD pages are staged whole (blocks are token slots)")
    offsets: dict[int, int] = {}
    blocks: dict[int, int] = {}
    total = 0
    for i, link in enumerate(links):
        if all_links or strided_on_destination(layout, link):
            offsets[i], blocks[i] = total, block_bytes(layout, link, num_pages)
            total += blocks[i] * layout.num_regions
    return ReceivePlacement(offsets, blocks, total, logical=all_links)


def block_positions(dst_pages: I64) -> I64:
    """(n,) the block page each of `dst_pages` sits at: their rank in ascending order."""
    positions = np.empty(dst_pages.shape[0], dtype=np.int64)
    positions[np.argsort(dst_pages, kind="stable")] = np.arange(dst_pages.shape[0])
    return positions


def page_slots(pages: I64, page_size: int) -> I64:
    """(len(pages) * page_size,) every token slot of `pages`, page after page: the rows a
    gather reads from (or a scatter writes to) for a block of those pages."""
    if pages.ndim != 1:
        raise PlanError(f"page ids must be one-dimensional, got shape {pages.shape}")
    slots = np.arange(page_size, dtype=np.int64)
    return (pages.astype(np.int64)[:, None] * page_size + slots[None, :]).ravel()
