"""``torch_native`` attention over SGLang's hybrid sliding-window pool (`SWAKVPool`).

A model with sliding-window and full-attention layers (Mellum, GPT-OSS, Gemma 4, ...)
keeps the sliding layers' KV in a pool of its own, with its own slot numbers: SGLang's
allocator maps every full-pool slot of a token inside the window to an SWA slot
(`translate_loc_from_full_to_swa`) and frees SWA slots that fall out of the window as a
request decodes. ``TorchNativeAttnBackend`` writes a sliding layer's K/V at the SWA slot
but *reads* the SWA pool's buffer through ``req_to_token``, which holds full-pool slots:
right only while both allocators happen to hand out the same numbers, then wrong K/V
(silently) or an index past the SWA pool (the scheduler dies). SGLang's other backends
translate; this does what its ``intel_amx`` backend does (``_swa_kv_indices``): for a
sliding layer, the batch's ``req_to_token`` rows are translated to SWA slots once per
forward and the backend reads through them. A token out of the window translates to
slot 0 (SGLang's padding slot), which the backend's window mask never reads.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

_CACHE = "_sgl_pd_swa_rows"  # backend attribute: (req_pool_indices, rows, row numbers)


def is_swa_layer(backend: Any, layer: Any) -> bool:
    """`layer` keeps its KV in the pool's sliding-window part."""
    pool = backend.token_to_kv_pool
    mapping = getattr(pool, "layers_mapping", None)
    if not getattr(backend, "use_sliding_window_kv_pool", False) or mapping is None:
        return False
    return bool(mapping[layer.layer_id][1]) and not getattr(layer, "is_cross_attention", False)


def forget_rows(backend: Any) -> None:
    """A new forward: its requests' rows are translated afresh."""
    setattr(backend, _CACHE, None)


def _swa_rows(backend: Any, forward_batch: Any) -> tuple[Any, Any]:
    """(rows, their numbers): the batch's ``req_to_token`` rows in SWA slots, (batch,
    max context), and 0..batch-1 to address them in place of ``req_pool_indices``."""
    import torch

    cached = getattr(backend, _CACHE, None)
    if cached is not None and cached[0] is forward_batch.req_pool_indices:
        return cached[1], cached[2]
    full = backend.req_to_token_pool.req_to_token[forward_batch.req_pool_indices]
    rows = backend.token_to_kv_pool.translate_loc_from_full_to_swa(full.long()).to(full.dtype)
    numbers = torch.arange(rows.shape[0], dtype=forward_batch.req_pool_indices.dtype)
    setattr(backend, _CACHE, (forward_batch.req_pool_indices, rows, numbers))
    return rows, numbers


class _Rows:
    """Stands in for the backend's ``req_to_token_pool`` while a sliding layer reads."""

    def __init__(self, req_to_token: Any) -> None:
        self.req_to_token = req_to_token


def with_swa_reads(
    original: Callable[..., Any],
    backend: Any,
    q: Any,
    k: Any,
    v: Any,
    layer: Any,
    forward_batch: Any,
    *args: Any,
    **kwargs: Any,
) -> Any:
    """``forward_extend`` / ``forward_decode`` of `layer`: a sliding layer reads its K/V
    through the translated rows (the write, at the SWA slots the backend computed, is
    untouched); any other layer runs as it is."""
    if not is_swa_layer(backend, layer):
        return original(backend, q, k, v, layer, forward_batch, *args, **kwargs)
    rows, numbers = _swa_rows(backend, forward_batch)
    batch = copy.copy(forward_batch)  # shallow: only the row numbers differ
    batch.req_pool_indices = numbers
    pool = backend.req_to_token_pool
    backend.req_to_token_pool = _Rows(rows)
    try:
        return original(backend, q, k, v, layer, batch, *args, **kwargs)
    finally:
        backend.req_to_token_pool = pool


def around_forward_decode(original: Any, backend: Any, *args: Any, **kwargs: Any) -> Any:
    """AROUND hook of ``TorchNativeAttnBackend.forward_decode``."""
    return with_swa_reads(original, backend, *args, **kwargs)


def after_init_forward_metadata(result: Any, backend: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook of ``TorchNativeAttnBackend.init_forward_metadata``."""
    forget_rows(backend)
    return result
