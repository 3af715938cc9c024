"""A request's state besides the KV pages (a Mamba / linear-attention slot) between the
two roles: the slot SGLang names for it, and whether two ranks can move it.

A Mamba slot holds each linear-attention layer's final conv and recurrent state after
the prompt. Both roles keep one slot per request in pools of the same shape, so the
prefill's slot is copied whole into the decoder's, one write per region, with the
metadata row (`prefill.writer.KvWriter.write_metadata`), behind every KV write of the
request on the same queue and under the same count word: the decoder sees the request
complete only once the state landed. The state is final then: SGLang hands its slot
to the last send, after the last chunk's forward (the prompt's first n - 1 tokens under
the decoder-sampled first token, whose decode step then reads token n - 1: the state it
needs).

The prefill's slot is not pinned (as its pages are): SGLang keeps a request's slot until
its sender polls done (only once every write landed) or failed (at once, once the request
failed), and may then hand the slot to another request while a state write still reads
it. So the state's batch is written first and the count
word only if the request had not failed by the time that batch landed: a request that
never failed before then read an intact slot, and one that failed sends no count (its
decoder hears the failure; the bytes that landed sit in its slot, held until nothing
can land - the release rule, `decode.release` - and never read).

Ranks of different TP sizes hold different slices of every layer's state (heads split
by TP); moving slices between them is not served yet, so such a pair fails the request
with the reason.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.wire import StateSlots


def state_slot_of(
    mine: StateSlots | None, state_indices: Sequence[Any] | None
) -> tuple[int | None, str | None]:
    """The one slot SGLang names for a request's state (its ``state_indices``, one entry
    per state type of the pool), and None; or (None, why) when it names none where this
    rank keeps state, or some where it keeps none."""
    named = [np.asarray(s).reshape(-1) for s in (state_indices or ()) if s is not None]
    named = [s for s in named if s.size]
    if mine is None:
        if named:
            return None, "sgl_pd does not transfer this model's state besides the KV pages"
        return None, None
    if len(named) != 1 or named[0].size != 1:
        count = sum(s.size for s in named)
        return None, f"the request names {count} {mine.kind} state slots, not one"
    slot = int(named[0][0])
    if not 0 <= slot < mine.slots:
        return None, f"{mine.kind} state slot {slot} is outside this rank's {mine.slots}"
    return slot, None


def slot_mismatch(
    decoder: StateSlots | None,
    decoder_scheme: ShardingScheme,
    prefill: StateSlots | None,
    prefill_scheme: ShardingScheme,
) -> str | None:
    """Why a prefill rank with `prefill` state slots cannot write a decode rank's with
    `decoder`'s, or None (also when neither keeps any); asked by both sides."""
    if decoder is None and prefill is None:
        return None
    if decoder is None or prefill is None:
        theirs = prefill.kind if prefill is not None else "no"
        mine = decoder.kind if decoder is not None else "no"
        return (
            f"the prefill server keeps {theirs} state besides the KV pages, the decoder"
            f" {mine}: serve one model on both"
        )
    if decoder_scheme.tp_size != prefill_scheme.tp_size:
        return (
            f"the prefill server runs TP {prefill_scheme.tp_size} and the decoder TP"
            f" {decoder_scheme.tp_size}: a model's {decoder.kind} state moves between servers"
            " of one TP size only (for now)"
        )
    if not decoder.same_shape(prefill):
        return (
            f"the prefill server keeps its {prefill.kind} state in slots of another shape"
            f" ({prefill.dtypes or 'element types unknown'}) than the decoder's"
            f" ({decoder.dtypes or 'element types unknown'}): serve one model on both, with"
            " the same SGLANG_MAMBA_CONV_DTYPE and SGLANG_MAMBA_SSM_DTYPE"
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
