"""SGLang's per-request state components besides the KV pages, planned one by one from
SGLang 0.5.23's pool code (``disaggregation/utils.py`` ``setup_state_kv_args``, the
``_*_payload`` rules in ``disaggregation/prefill.py`` and ``decode.py``): what each
names for a request, and whether sgl_pd moves it.

Every component is a list of buffers (one per layer and tensor) of equal-sized items;
an index i addresses ``base + i * item_bytes`` in each buffer, on either role. What
differs is which indices a request names:

- slot components name request rows (a Mamba slot, a request row, a ring row);
- paged components name pages of positions, in a page space of the component's own;
- a positional rule names the same positions on both roles from the same numbers
  (held prefix h, KV tokens c, window w, page size), so the two lists pair up in order.

`PLANS` records each state type with its rule (`named`, over logical positions and the
request's row) and sgl_pd's status: moved (served and tested end to end) or refused at
start-up, with the reason. Where sgl_pd's rule differs from SGLang's, it says why: a
paged component never names a page of the prefix the decoder holds (its cache shares
them), as sgl_pd's KV pages never do - SGLang's block scales, QSA's compressed pages
and MiniMax's dense KV name every page of the prompt (``_full_kv_pages_payload``).

At run time each role passes on the slots SGLang names (``state_indices``); the plans
are what the messengers are tested against. A plan becomes moved only with glue that
makes SGLang's payloads follow it on both roles: SGLang's decoder names positions of
the whole prompt (n tokens) where the KV it receives ends at c = n - 1
(`backend.first_token`), which `backend.sliding_window_glue` corrects for "swa".
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from sgl_pd.core.sliding_window import window_tokens


class Named(Enum):
    """Which indices a request names in a component."""

    ROW = "the request's row"  # one index: the request-pool slot
    WINDOW_PAGES = "the window's pages"  # pages of [max(h, c - w), c), from a page boundary
    SUFFIX_PAGES = "the pages after the held prefix"  # pages of [h, c)
    RING_ROWS = "the window's ring rows"  # row * ring + p % ring, p in [max(0, c - w), c)
    PENDING_BLOCK = "the pending compression block"  # none, the row, or its ring page
    TAIL_RANGES = "ranges of the request's tail ring"  # (row, start, n, 0, m): byte ranges


@dataclass(frozen=True)
class Plan:
    kind: str  # SGLang's StateType name, lower-case
    named: Named
    models: str  # who keeps it
    refused: str | None  # why sgl_pd refuses it at start-up; None: moved


def _unrun(kind: str, named: Named, models: str, engine: str) -> Plan:
    """A plan refused at start-up: SGLang's CPU engine does not run `engine`."""
    why = f"SGLang's CPU engine does not run {engine}: planned, never run through sgl_pd"
    return Plan(kind, named, models, why)


PLANS: dict[str, Plan] = {
    p.kind: p
    for p in (
        Plan("mamba", Named.ROW, "Qwen3-Next, Qwen3.5, Kimi-Linear, Nemotron-H, ...", None),
        Plan("swa", Named.WINDOW_PAGES, "GPT-OSS, Gemma 4, Llama 4, Mellum, ...", None),
        # kind, what a request names, who keeps it, what SGLang's CPU engine cannot run
        *(
            _unrun(*plan)
            for plan in (
                ("dsa", Named.SUFFIX_PAGES, "DeepSeek-V3.2, GLM-5 (the DSA indexer's K)",
                 "DSA sparse attention"),
                ("dsa_tail", Named.TAIL_RANGES, "DSA with a compressed indexer pool",
                 "DSA sparse attention"),
                ("block_scale", Named.SUFFIX_PAGES, "MXFP8 KV (its block scales beside each page)",
                 "MXFP8 KV caches"),
                ("block_scale_swa", Named.WINDOW_PAGES, "MXFP8 KV in a hybrid SWA pool",
                 "MXFP8 KV caches"),
                ("swa_ring", Named.RING_ROWS, "DeepSeek-V4 (its unified SWA ring)", "DeepSeek-V4"),
                ("dsv4_request_state", Named.PENDING_BLOCK,
                 "DeepSeek-V4 (its C128 compression state)", "DeepSeek-V4"),
                ("request_row", Named.ROW, "DeepSeek-V4 (request-scoped rows)", "DeepSeek-V4"),
                ("qsa_pending", Named.ROW, "QSA models", "QSA"),
                ("qsa_compressed", Named.SUFFIX_PAGES, "QSA models", "QSA"),
                ("minimax_index_k", Named.SUFFIX_PAGES, "MiniMax sparse layers",
                 "MiniMax sparse attention"),
                ("minimax_dense_kv", Named.SUFFIX_PAGES, "MiniMax sparse layers",
                 "MiniMax sparse attention"),
            )
        ),
    )
}  # fmt: skip


@dataclass(frozen=True)
class Request:
    """What both roles know of a request when they name its state."""

    held: int  # prompt tokens the decoder holds (whole pages)
    kv_tokens: int  # c: the tokens whose KV (and state) the decoder receives
    row: int  # this role's request-pool row (differs between the roles)


@dataclass(frozen=True)
class Geometry:
    """A component's shape on one role (the same on both, but for its size)."""

    page_size: int = 1
    window: int = 0  # tokens (window components)
    ring: int = 0  # rows per request (ring components)
    ratio: int = 0  # tokens per compression block (pending-block components)
    online: bool = False  # a pending block is kept in the request's row, not a ring page


def named(kind: str, request: Request, geometry: Geometry) -> list[int]:
    """The indices `request` names in component `kind`, in the order that pairs them
    with the other role's (same positions, same order). Tail ranges are not indices:
    `tail_ranges`."""
    rule = PLANS[kind].named
    ps = geometry.page_size
    if rule is Named.ROW:
        return [request.row]
    if rule in (Named.WINDOW_PAGES, Named.SUFFIX_PAGES):
        if rule is Named.WINDOW_PAGES:
            tokens = window_tokens(request.held, request.kv_tokens, geometry.window, ps)
        else:
            tokens = range(request.held, request.kv_tokens)
        # logical pages; each role maps them to its own physical pages in order
        return list(range(tokens.start // ps, -(-tokens.stop // ps))) if tokens else []
    if rule is Named.RING_ROWS:
        start = max(0, request.kv_tokens - geometry.window)
        ring = geometry.ring
        return [request.row * ring + p % ring for p in range(start, request.kv_tokens)]
    if rule is Named.PENDING_BLOCK:
        c, ratio = request.kv_tokens, geometry.ratio
        if c == 0 or c % ratio == 0:
            return []
        if geometry.online:
            return [request.row]
        pages_per_row = geometry.ring // ratio
        return [request.row * pages_per_row + ((c - 1) % geometry.ring) // ratio]
    raise ValueError(f"{kind} names ranges, not indices: use tail_ranges")


def tail_ranges(request: Request, pool_size: int, tail_size: int) -> list[tuple[int, int]]:
    """DSA's compressed indexer tail (``get_dsa_tail_state_indices``): the request's
    tail ring holds the last c % pool_size tokens' rows from ring position
    (c - n) % tail_size, wrapping once: (first row, rows) per range, within the ring."""
    n = request.kv_tokens % pool_size
    if n == 0:
        return []
    start = (request.kv_tokens - n) % tail_size
    first = min(n, tail_size - start)
    return [(start, first), (0, n - first)] if n > first else [(start, first)]


def writes(
    src_bases: list[int],
    dst_bases: list[int],
    item_bytes: list[int],
    src: list[int],
    dst: list[int],
) -> list[tuple[int, int, int]]:
    """(source address, destination address, bytes): each pair of named indices, in
    every buffer of the component."""
    if len(src) != len(dst):
        raise ValueError(f"the roles named {len(src)} and {len(dst)} indices")
    return [
        (s_base + s * n, d_base + d * n, n)
        for s_base, d_base, n in zip(src_bases, dst_bases, item_bytes, strict=True)
        for s, d in zip(src, dst, strict=True)
    ]
