"""Describes SGLang's KV pool and metadata buffers (from ``KVArgs``) in the core's terms.

SGLang hands a transfer backend flat lists: ``kv_data_ptrs`` holds every layer's K
buffer, then every layer's V buffer (MHA/GQA), or one latent buffer per layer (MLA);
each buffer is NHD, page after page (``kv_item_lens`` bytes per page). The core wants one
region per (layer, part), layer-major, which is only a reordering of the same buffers.

With speculative decoding, the draft model's pool follows in the same shape (its last
``num_draft_entries`` buffers). Its pages are the target's pages (the two pools share
SGLang's req_to_token table), so its layers are simply layers after the target's: a
NEXTN/MTP layer's KV travels like any other layer, under the same plan and counting.

State besides the KV pages comes in SGLang's ``state_*`` lists, one component per state
type. sgl_pd moves the Mamba / linear-attention component (``StateType.MAMBA``: each
layer's conv and recurrent state, one slot per request) and the hybrid SWA pool's
(``StateType.SWA``: the sliding-window layers' K and V buffers, in pages of their own;
the main pool then holds the full-attention layers only); the start-up check refuses
models with any other (`server_options`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.regions import Region, RegionTable
from sgl_pd.core.wire import WINDOW_KINDS, StateSlicing, StateSlots
from sgl_pd.errors import ConfigError


@dataclass(frozen=True)
class PoolDescription:
    layout: KvLayout
    local_heads: int  # KV heads this rank holds (1 for MLA)
    kv: RegionTable  # this rank's KV regions, indexed by KvLayout.region_index
    draft_layers: int  # the last layers of `layout` are the draft model's (0: none)
    num_pages: int  # pages every region can hold
    aux: tuple[Region, ...]  # metadata buffers (D9), one row per request slot
    aux_item_bytes: tuple[int, ...]  # bytes of one row of each metadata buffer
    aux_rows: int  # request slots in the metadata buffers
    # per-request state besides the KV pages, a component per SGLang state type (Mamba
    # slots, sliding-window pages, ...)
    state: tuple[StateSlots, ...] = ()
    # the model layer id of each region of each state component (`state_region_layers`);
    # () for a component whose layers are unknown: its state goes after the forward
    state_layers: tuple[tuple[int, ...], ...] = ()


def describe_pool(
    kv_args: Any,
    is_mla: bool,
    heads: tuple[int, int] | None = None,
    window: int | None = None,
    tp_size: int = 1,
    sliding_layers: frozenset[int] = frozenset(),
) -> PoolDescription:
    """Reads SGLang's ``KVArgs`` (duck-typed: it is SGLang's class, not ours).

    ``heads`` = (heads on this rank, heads in the model), for roles whose ``KVArgs``
    does not carry them (SGLang's decoder fills them in only for its staging mode).
    ``window``: the model's sliding window in tokens, where SGLang's hybrid SWA pool
    keeps the sliding layers (`sliding_window_glue.window`). ``tp_size``: the attention
    TP size this rank is one of. ``sliding_layers``: the model layers SGLang keeps in
    that pool (`sliding_window_glue.sliding_layers_of`).
    """
    ptrs: list[int] = list(kv_args.kv_data_ptrs)
    lens: list[int] = list(kv_args.kv_data_lens)
    item_lens: list[int] = list(kv_args.kv_item_lens)
    num_draft = int(getattr(kv_args, "num_draft_entries", 0) or 0)
    if not 0 <= num_draft < len(ptrs):
        raise ConfigError(f"{num_draft} draft KV buffers out of {len(ptrs)} in all")
    page_size = int(kv_args.page_size)
    target = _region_order(len(ptrs) - num_draft, is_mla)
    draft = _region_order(num_draft, is_mla)
    # the draft's buffers follow the target's in SGLang's list
    order = [*target, *(len(target) + i for i in draft)]
    num_layers = len(order) // (1 if is_mla else 2)
    draft_layers = len(draft) // (1 if is_mla else 2)
    if is_mla:
        local_heads, total_heads = 1, 1
    elif heads is None:
        local_heads, total_heads = int(kv_args.kv_head_num), int(kv_args.total_kv_head_num)
    else:
        local_heads, total_heads = heads
    page_bytes = item_lens[0]
    if any(n != page_bytes for n in item_lens):
        raise ConfigError(
            "KV buffers with different page sizes are not supported"
            + (" (the draft model's KV rows differ from the target's)" if num_draft else "")
        )
    row_bytes = page_bytes // (page_size * local_heads)  # bytes per (token, head)
    # The planner works in bytes: the layout records one-byte elements, so a head's row
    # is `row_bytes` elements and both roles hash exactly the geometry they share.
    if is_mla:
        layout = KvLayout.mla(
            num_layers=num_layers,
            kv_lora_rank=row_bytes,
            rope_dim=0,
            page_size=page_size,
            elem_bytes=1,
            page_layout=PageLayout.NHD,
        )
    else:
        layout = KvLayout.gqa(
            num_layers=num_layers,
            num_kv_heads=total_heads,
            head_dim=row_bytes,
            page_size=page_size,
            elem_bytes=1,
            page_layout=PageLayout.NHD,
        )
    num_pages = min(lens) // page_bytes
    kv = RegionTable.for_layout(layout, tuple(Region(ptrs[i], lens[i]) for i in order))

    # a window page splits as the KV heads do, when TP splits them (not replicated); an
    # MLA page is the same on every rank
    split = not is_mla and local_heads * tp_size == total_heads
    window_pages = WindowPages(page_size, row_bytes, local_heads if split else 0, is_mla)
    state = state_slots(kv_args, window, window_pages)
    for component in state:
        if component.window and component.window < page_size:
            # (the decoder frees its slots before the window, `sliding_window_glue`: with
            # a window inside the last page, a cached prompt's last page would hold none)
            raise ConfigError(
                f"the sliding window ({component.window} tokens) is shorter than a page"
                f" ({page_size} tokens): serve the model with --page-size"
                f" {component.window} or less"
            )
    aux_ptrs = list(kv_args.aux_data_ptrs)
    aux_lens = list(kv_args.aux_data_lens)
    aux_items = tuple(int(n) for n in kv_args.aux_item_lens)
    aux_rows = min(length // item for length, item in zip(aux_lens, aux_items, strict=True))
    return PoolDescription(
        layout=layout,
        local_heads=local_heads,
        kv=kv,
        draft_layers=draft_layers,
        num_pages=num_pages,
        aux=tuple(Region(p, n) for p, n in zip(aux_ptrs, aux_lens, strict=True)),
        aux_item_bytes=aux_items,
        aux_rows=aux_rows,
        state=state,
        state_layers=state_region_layers(kv_args, state, sliding_layers, is_mla),
    )


def state_kinds(kv_args: Any) -> list[str]:
    """The kinds of SGLang's state components, in its order: its ``StateType`` names,
    lower-case ("mamba", "swa", ...)."""
    return [str(getattr(t, "name", t)).lower() for t in getattr(kv_args, "state_types", ())]


@dataclass(frozen=True)
class WindowPages:
    """The main pool's page geometry, which SGLang's hybrid SWA pool shares."""

    page_size: int  # tokens
    row_bytes: int  # one token's K (or V) of one head
    split_heads: int  # KV heads on this rank where TP splits them; 0: not split
    same_on_every_rank: bool = False  # MLA: a page holds the whole latent on every rank


def state_slots(
    kv_args: Any, window: int | None = None, pages: WindowPages | None = None
) -> tuple[StateSlots, ...]:
    """SGLang's state lists as components, in its order: a Mamba pool (each layer's conv
    and recurrent state tensors, ``[slots, ...]`` each, a slot per request), a hybrid
    SWA pool (each sliding layer's K and V buffers, a slot per page; `window` tokens of
    them per request), ... (`core.state_components` plans each kind; the start-up check
    refuses those sgl_pd does not move). How TP splits each slot (`StateSlicing`) comes
    from SGLang's lists for a Mamba pool, and from `pages` for window pages."""
    components = []
    for i, kind in enumerate(state_kinds(kv_args)):
        if kind in WINDOW_KINDS and not window:
            raise ConfigError(f"SGLang's {kind} state is on, but its sliding window is unknown")
        ptrs = [int(p) for p in kv_args.state_data_ptrs[i]]
        lens = [int(n) for n in kv_args.state_data_lens[i]]
        items = [int(n) for n in kv_args.state_item_lens[i]]
        if not ptrs or not len(ptrs) == len(lens) == len(items):
            raise ConfigError(f"the {kind} state lists {len(ptrs)} buffers and {len(items)} sizes")
        components.append(
            StateSlots(
                kind=kind,
                regions=tuple(Region(p, n) for p, n in zip(ptrs, lens, strict=True)),
                slot_bytes=tuple(items),
                slots=min(n // item for n, item in zip(lens, items, strict=True)),
                window=int(window or 0) if kind in WINDOW_KINDS else 0,
                slicing=_slicing(kv_args, i, kind, items, pages),
            )
        )
    return tuple(components)


def state_region_layers(
    kv_args: Any, state: tuple[StateSlots, ...], sliding_layers: frozenset[int], is_mla: bool
) -> tuple[tuple[int, ...], ...]:
    """The model layer each region of each state component holds, for layer-wise
    streaming (`core.layer_steps`): a Mamba pool lists its regions tensor by tensor, each
    over its layers, and says which (``state_layer_ids``); a hybrid SWA pool lists every
    sliding layer's K, then every one's V (an MLA one: a buffer per layer), the layers in
    model order (its ``layers_mapping``). () for a component where that does not add up."""
    layers: list[tuple[int, ...]] = []
    sliding = sorted(sliding_layers)
    for i, component in enumerate(state):
        count = len(component.regions)
        ids: list[int] = []
        if component.kind == "mamba":
            ids = [int(n) for n in _listed(kv_args, "state_layer_ids", i)]
        elif component.kind in WINDOW_KINDS and count == len(sliding) * (1 if is_mla else 2):
            ids = [sliding[r % len(sliding)] for r in range(count)]
        layers.append(tuple(ids) if len(ids) == count else ())
    return tuple(layers)


def _slicing(
    kv_args: Any, i: int, kind: str, items: list[int], pages: WindowPages | None
) -> tuple[StateSlicing, ...]:
    """How TP splits each region's slot of component `i`, or () where unknown (its
    state then moves only between ranks of one TP size)."""
    if kind == "mamba":
        # SGLang's own lists (`setup_state_kv_args`): each tensor's sliced axis on this
        # rank (0: replicated), rows before it, and GDN conv's [q | k | v] sub-blocks
        dims = _listed(kv_args, "state_dim_per_tensor", i)
        rows = _listed(kv_args, "state_slice_outer_counts", i) or [1] * len(dims)
        groups = _listed(kv_args, "state_conv_shard_groups", i) or [None] * len(dims)
        if len(dims) != len(items) or len(rows) != len(items) or len(groups) != len(items):
            return ()
        if not any(groups):
            # SGLang names the conv axis's sub-blocks only where it knows them (GDN's
            # [q | k | v], KDA's): a Mamba2 conv is [x | B | C] split block by block
            # all the same, so without them the axis cannot be cut right
            return ()
        return tuple(
            StateSlicing(units=int(d), outer=int(o), groups=tuple(int(g) for g in gs or ()))
            for d, o, gs in zip(dims, rows, groups, strict=True)
        )
    if kind in WINDOW_KINDS and pages is not None and pages.same_on_every_rank:
        return tuple(StateSlicing(units=0) for _ in items)  # moved whole, from one rank
    if kind in WINDOW_KINDS and pages is not None and pages.split_heads:
        # a page of one sliding layer's K or V: (page_size, heads, row) in NHD order,
        # (heads, page_size, row) in HND
        nhd = str(getattr(kv_args, "swa_kv_cache_layout", None) or "nhd").lower() == "nhd"
        page = pages.page_size * pages.split_heads * pages.row_bytes  # bytes
        if any(n != page for n in items):
            return ()  # not the main pool's heads: how they split is unknown
        outer = pages.page_size if nhd else 1
        return tuple(StateSlicing(units=pages.split_heads, outer=outer) for _ in items)
    return ()


def _listed(kv_args: Any, name: str, i: int) -> list[Any]:
    lists = getattr(kv_args, name, None) or []
    return list(lists[i] or []) if i < len(lists) else []


def _region_order(num_buffers: int, is_mla: bool) -> list[int]:
    """Indices into one pool's buffer list in the core's region order: (layer, K),
    (layer, V), ... for K/V pools (SGLang lists all K then all V); as listed for MLA."""
    if is_mla:
        return list(range(num_buffers))
    if num_buffers % 2:
        raise ConfigError(f"expected K and V buffers per layer, got {num_buffers} buffers")
    layers = num_buffers // 2
    return [i for layer in range(layers) for i in (layer, layers + layer)]
