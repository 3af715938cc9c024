"""Re-layout copies on a CUDA pool: byte views of raw device addresses, the gather of a
link's heads into a staging block and the scatter of a receive block, on the copies' own
stream, give what the same copies give on the CPU. Skipped without a CUDA device."""

from __future__ import annotations

import numpy as np
import torch
from gpu_marks import GPU_ONLY

from sgl_pd.backend.device_memory import byte_tensor
from sgl_pd.backend.pool import PoolDescription
from sgl_pd.backend.relayout_copies import PoolCopies
from sgl_pd.core.counting import links_into
from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.regions import RegionTable
from sgl_pd.core.relayout import receive_placement
from sgl_pd.core.sharding import ShardingScheme, link_shards

pytestmark = GPU_ONLY

LAYOUT = KvLayout.gqa(
    num_layers=3, num_kv_heads=8, head_dim=256, page_size=64, elem_bytes=1,
    page_layout=PageLayout.NHD,
)  # fmt: skip
PAGES = 32


def _pool(device: str, heads: int, fill: torch.Tensor) -> tuple[PoolDescription, torch.Tensor]:
    arena = fill.to(device).clone()
    table = RegionTable.packed(LAYOUT, PAGES, heads, int(arena.data_ptr()))
    return PoolDescription(LAYOUT, heads, table, 0, PAGES, (), (), 1), arena


def test_a_byte_view_aliases_device_memory() -> None:
    buffer = torch.arange(256, dtype=torch.uint8, device="cuda")
    view = byte_tensor(int(buffer.data_ptr()) + 16, 32, buffer.device)
    assert view.device == buffer.device and torch.equal(view, buffer[16:48])
    view.fill_(7)
    assert int(buffer[16:48].sum()) == 7 * 32


def test_gather_and_scatter_on_cuda_match_the_cpu() -> None:
    generator = torch.Generator().manual_seed(3)
    heads = 4  # TP2 of 8 heads
    nbytes = LAYOUT.region_bytes(PAGES, heads) * LAYOUT.num_regions
    fill = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    pages = np.random.default_rng(1).permutation(PAGES)[:20]
    links = link_shards(LAYOUT, ShardingScheme(2), ShardingScheme(4), 5)
    link = links_into(links, 1)[0]  # 2 of the source's 4 heads: strided there
    block = 20 * LAYOUT.page_size * link.num_heads * LAYOUT.row_bytes
    outs = []
    for device in ("cpu", "cuda"):
        pool, _arena = _pool(device, heads, fill)
        out = torch.zeros(block * LAYOUT.num_regions, dtype=torch.uint8, device=device)
        PoolCopies(pool, device).gather(out, range(LAYOUT.num_regions), link, pages)
        outs.append(out.cpu())
    assert torch.equal(outs[0], outs[1])

    # the reverse: TP4 -> TP2, both sources' blocks scattered into a TP2 rank's pool
    into = links_into(link_shards(LAYOUT, ShardingScheme(4), ShardingScheme(2), 5), 0)
    placement = receive_placement(LAYOUT, into, 20)
    staged = torch.randint(0, 256, (placement.total,), dtype=torch.uint8, generator=generator)
    pools = []
    for device in ("cpu", "cuda"):
        pool, arena = _pool(device, heads, fill)
        PoolCopies(pool, device).scatter(staged.to(device), placement, into, pages)
        pools.append(arena.cpu())
    assert torch.equal(pools[0], pools[1]) and not torch.equal(pools[0], fill)
