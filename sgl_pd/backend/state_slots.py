"""A request's state besides the KV pages between the two roles: the slots SGLang names
for it, and whether two ranks can move it. Two kinds (`core.wire.StateSlots`):

- a Mamba slot holds each linear-attention layer's final conv and recurrent state after
  the prompt, one slot per request;
- SGLang's hybrid SWA pool keeps the sliding-window layers' KV in pages of their own;
  a request names the pages of its window (`core.sliding_window`: the same positions
  on both roles, so the two lists pair up in order).

Each prefill rank writes its share of the decode rank's slots (`core.state_slices`: at
one TP size its peer's whole slot, one write per region; at another the ranges where
their shares of the sliced axis meet - heads, GDN conv's [q | k | v] channels, a window
page's heads token by token), on the same queue as its KV writes, and counts it as one
more group of its count word once all of it landed (`core.counting`): the decoder sees
the request complete only once every writer's share landed. The state is final when it
goes: after the forward, SGLang names the slots in its last send, after the last
chunk's forward (`prefill.writer.KvWriter.write_metadata`), and the window's pages each
earlier chunk completed went with that chunk's KV (`sliding_window_glue.
before_send_kv_chunk`: no later position changes their KV); layer-wise, the slots are
read before that forward and each state layer's regions go once the forward reports
that layer (`core.layer_steps`), the rest after it; where SGLang then names other slots
(its prefix cache swapped a window page for the tree's, of the same KV), every region
goes again from those, after the forward, before the count. Either way the state
covers the prompt's first n - 1 tokens under the decoder-sampled first token, whose
decode step then reads token n - 1: the state and the window it needs.

The prefill's slots are not pinned (as its KV pages are): SGLang keeps a request's
slots until its sender polls done (only once every write landed) or failed (at once,
once the request failed), and may then hand them to another request while a state
write still reads them. So the state's batch is written first and the count word only
if the request had not failed by the time that batch landed: a request that never
failed before then read intact slots, and one that failed sends no count (its decoder
hears the failure; the bytes that landed sit in its slots, held until nothing can land
- the release rule, `decode.release` - and never read).

A pair whose state cannot be split between its TP sizes (a server that does not say how
TP splits a region, heads replicated over the ranks, sizes that do not divide) fails
the request with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.state_slices import component_mismatch
from sgl_pd.core.wire import StateSlots, state_named_wrong

Slots = tuple[tuple[int, ...], ...]  # a request's slots, one list per state component


def named_slots(
    mine: tuple[StateSlots, ...], state_indices: Sequence[Any] | None
) -> tuple[Slots, str | None]:
    """The slots SGLang names for a request's state (its ``state_indices``: one entry per
    state type of the pool, in the pool's order - a Mamba slot, the sliding window's
    pages, ...) and None; or ((), why) when it names some this rank cannot take."""
    entries = list(state_indices or ())
    if not mine:
        if any(np.asarray(e).size for e in entries if e is not None):
            return (), "sgl_pd does not transfer this model's state besides the KV pages"
        return (), None
    if len(entries) != len(mine):
        return (), f"SGLang named state for {len(entries)} components, this rank has {len(mine)}"
    slots = tuple(
        () if e is None else tuple(int(i) for i in np.asarray(e).reshape(-1)) for e in entries
    )
    why = state_named_wrong(mine, slots)
    return ((), why) if why is not None else (slots, None)


def slot_mismatch(
    decoder: tuple[StateSlots, ...],
    decoder_scheme: ShardingScheme,
    prefill: tuple[StateSlots, ...],
    prefill_scheme: ShardingScheme,
) -> str | None:
    """Why a prefill rank with `prefill` state cannot write a decode rank's with
    `decoder`'s, or None (also when neither keeps any); asked by both sides."""
    if not decoder and not prefill:
        return None
    theirs = ", ".join(c.kind for c in prefill) or "no"
    mine = ", ".join(c.kind for c in decoder) or "no"
    if [c.kind for c in prefill] != [c.kind for c in decoder]:
        return (
            f"the prefill server keeps {theirs} state besides the KV pages, the decoder"
            f" {mine}: serve one model on both"
        )
    src_tp, dst_tp = prefill_scheme.tp_size, decoder_scheme.tp_size
    for d, p in zip(decoder, prefill, strict=True):
        if d.window != p.window:
            return (
                f"the prefill server's sliding window is {p.window} tokens, the"
                f" decoder's {d.window}: serve one model on both"
            )
        split = component_mismatch(p, src_tp, d, dst_tp)
        if src_tp != dst_tp and split is not None and d.dtypes == p.dtypes:
            return (
                f"the prefill server runs TP {src_tp} and the decoder TP {dst_tp}, and"
                f" its {d.kind} state cannot be split between them ({split}): serve both"
                " at one TP size"
            )
        if split is not None or d.dtypes != p.dtypes:
            advice = (
                ", with the same SGLANG_MAMBA_CONV_DTYPE and SGLANG_MAMBA_SSM_DTYPE"
                if d.kind == "mamba"
                else ", with the same KV cache dtype and page size"
            )
            return (
                f"the prefill server keeps its {p.kind} state in slots of another shape"
                f" ({p.dtypes or 'element types unknown'}) than the decoder's"
                f" ({d.dtypes or 'element types unknown'}): serve one model on both{advice}"
            )
    return None


def mamba_dtypes() -> str:
    """The element types SGLang gives this server's Mamba state, as far as its
    environment decides them (``SGLANG_MAMBA_CONV_DTYPE``, ``SGLANG_MAMBA_SSM_DTYPE``;
    the model's own config is the same on both servers of a pair)."""
    from sglang.srt.configs.mamba_utils import mamba2_state_dtype

    dtypes = mamba2_state_dtype(None)
    return ",".join(
        f"{name}={str(dtype).removeprefix('torch.')}"
        for name, dtype in (("conv", dtypes.conv), ("ssm", dtypes.temporal))
    )
