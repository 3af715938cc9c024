"""SGLang's hybrid sliding-window pool on this server: the window and the sliding layers
its model keeps there, and, on a decoder, the window pages each request names.

A model with sliding-window layers (Mellum, GPT-OSS, Gemma 4, ...) served with SGLang's
hybrid SWA pool keeps those layers' KV in pages of their own; the main pool holds the
full-attention layers only. sgl_pd moves the full layers' pages as any KV and the
sliding layers' window as state slots (`backend.state_slots`): the pages of positions
`core.sliding_window.window_tokens`. After the forward, each send before the last
carries the window pages its chunks completed and the rest go with the metadata
(`before_send_kv_chunk`); layer-wise, during the last chunk's forward, each sliding
layer's as it finishes (`core.layer_steps`).

SGLang's decoder names its window from the whole prompt, n tokens; when this decoder
samples the first token (`backend.first_token`) the KV it receives ends at c = n - 1,
and the position n - 1 it names has no page yet. So the decoder names the window of
its c tokens itself (`around_send_kv_metadata`), as its prefill does from its copy of
c tokens: the two lists cover the same positions, in order. The window-pool slots
SGLang allocated for the positions before the window, which nothing writes, go back at
once (`_free_unsent`): its prefix cache would otherwise hold them as a live window.
"""

from __future__ import annotations

import logging
from typing import Any, ClassVar

import numpy as np

from sgl_pd.core.sliding_window import window_tokens
from sgl_pd.errors import SglPdError

logger = logging.getLogger("sgl_pd.sliding_window")


class _Process:
    window: ClassVar[int | None] = None  # tokens; None: no hybrid SWA pool here
    layers: ClassVar[frozenset[int]] = frozenset()  # the model layers kept in that pool


def after_load_model(result: Any, model_runner: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook of ``ModelRunner.load_model``: SGLang has resolved the model's window
    and, with its hybrid SWA pool on, which layers keep their KV there."""
    if getattr(model_runner, "is_draft_worker", False):
        return result
    layers = sliding_layers_of(model_runner)
    if layers:
        _Process.window = int(model_runner.sliding_window_size)
        _Process.layers = layers
    return result


def sliding_layers_of(model_runner: Any) -> frozenset[int]:
    """The layer ids of `model_runner`'s model whose KV SGLang keeps in its hybrid SWA
    pool (none with the pool off, or without a sliding window)."""
    config = model_runner.model_config
    if not getattr(config, "is_hybrid_swa", False) or not model_runner.sliding_window_size:
        return frozenset()
    return frozenset(config.swa_attention_layer_ids or ())


def window() -> int | None:
    """This process's model's sliding window in tokens, where SGLang keeps its sliding
    layers in the hybrid SWA pool; else None."""
    return _Process.window


def sliding_layers() -> frozenset[int]:
    """The model layers this process's hybrid SWA pool keeps (none without one)."""
    return _Process.layers


class NoWindowPage(SglPdError):
    """A window position has no sliding-window page on this decoder."""


def window_pages(
    req_to_token_row: Any,
    translate: Any,
    held: int,
    kv_tokens: int,
    page_size: int,
    upto: int | None = None,
) -> np.ndarray:
    """This server's sliding-window pages for the positions `window_tokens` names (those
    before `upto` only, if given), in order: `req_to_token_row` (the request's main-pool
    token slots) through `translate` (SGLang's ``translate_swa_indices_for_transfer``)
    to window-pool slots, a page per `page_size` slots. Raises `NoWindowPage` where a
    position has none (slot 0, SGLang's padding: the page would be another request's)."""
    assert _Process.window is not None
    positions = window_tokens(held, kv_tokens, _Process.window, page_size)
    if upto is not None:
        positions = range(positions.start, max(positions.start, min(upto, positions.stop)))
    if not positions:
        return np.zeros(0, dtype=np.int64)
    slots = translate(req_to_token_row[positions.start : positions.stop])
    slots = np.asarray(slots.cpu() if hasattr(slots, "cpu") else slots, dtype=np.int64)
    if (slots <= 0).any():
        raise NoWindowPage(
            f"positions {positions.start}..{positions.stop - 1} of the sliding window have"
            f" {int((slots <= 0).sum())} without a page"
        )
    return slots[::page_size] // page_size


def around_send_kv_metadata(
    original: Any,
    queue: Any,
    decode_req: Any,
    kv_indices: Any,
    page_size: int,
    state_indices: Any = None,
    **kwargs: Any,
) -> Any:
    """AROUND hook of ``DecodePreallocQueue._send_kv_metadata``: the window's entry of
    `state_indices` becomes the pages of the KV this decoder receives (see the module).
    A position without a page fails the request through its receiver."""
    if _Process.window is not None and state_indices is not None:
        from sgl_pd.backend.first_token import expected_kv_tokens
        from sgl_pd.backend.pool import state_kinds

        kinds = state_kinds(queue.kv_manager.kv_args)
        if "swa" in kinds and kwargs.get("destination") is None:
            req = decode_req.req
            allocator = queue.token_to_kv_pool_allocator
            row = queue.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
            held = int(kwargs.get("decode_prefix_len") or 0)
            kv_tokens = expected_kv_tokens(req)
            page_size = int(allocator.page_size)
            state_indices = list(state_indices)
            try:
                if kv_tokens > req.kv.kv_allocated_len:  # (its row holds stale slots there)
                    raise NoWindowPage(
                        f"the request needs {kv_tokens} tokens of KV and this decoder"
                        f" allocated {req.kv.kv_allocated_len}"
                    )
                state_indices[kinds.index("swa")] = window_pages(
                    row, allocator.translate_swa_indices_for_transfer, held, kv_tokens, page_size
                )
                _free_unsent(queue, req, kv_tokens)
            except NoWindowPage as e:
                state_indices[kinds.index("swa")] = None
                decode_req.kv_receiver.refuse(str(e))
    return original(queue, decode_req, kv_indices, page_size, state_indices, **kwargs)


def _free_unsent(queue: Any, req: Any, kv_tokens: int) -> None:
    """Frees this decoder's window-pool slots of the request's positions before its window
    (SGLang allocated them, nothing writes them), as SGLang's own eviction frees a
    request's out-of-window slots: its prefix cache then holds them as evicted and never
    serves them to a later prompt as a cached window (one cut inside this prompt)."""
    from sglang.srt.mem_cache.common import free_swa_out_of_window_slots

    assert _Process.window is not None
    free_swa_out_of_window_slots(
        req,
        kv_tokens,
        sliding_window_size=_Process.window,
        page_size=int(queue.token_to_kv_pool_allocator.page_size),
        req_to_token_pool=queue.req_to_token_pool,
        token_to_kv_pool_allocator=queue.token_to_kv_pool_allocator,
        # evict up to the window's start exactly (`core.sliding_window`), not a page short
        supports_prefix_sharing=False,
    )


def before_send_kv_chunk(
    scheduler: Any, req: Any, last_chunk: bool = False, end_idx: int | None = None, **_: Any
) -> None:
    """BEFORE hook of SGLang's prefill ``_send_kv_chunk``, after the forward sending
    the KV after each chunk's forward: a send before the last also names the window's
    pages that the forwards so far completed, whole pages from the window's start up to
    where this send ends (a page boundary, as SGLang ends it; its staging grid, when
    on, may end the send's KV sooner: the pages named were computed all the same).
    Their KV is final (no later position changes it), and SGLang keeps a position's
    window page while the prompt's end lies within its window, so they go with this
    send's KV (`SglPdKVSender.state_final_so_far`) and only the last chunk's window
    pages wait for the last send. Where SGLang names other pages later (its prefix
    cache swapped one for the tree's), every page goes again after the forward
    (`Room.state_renamed`)."""
    from sgl_pd.backend.prefill.sender import SglPdKVSender

    sender = getattr(req, "disagg_kv_sender", None)
    if not isinstance(sender, SglPdKVSender):
        return
    sender.state_final_so_far(None)  # (a list an earlier call left, its send skipped)
    if last_chunk or _Process.window is None:
        return
    kinds = [c.kind for c in sender.kv_mgr.pool.state]
    if "swa" not in kinds or sender.kv_mgr.prefill.layerwise:
        return  # (layer-wise, each sliding layer's window goes during the last forward)
    allocator = scheduler.token_to_kv_pool_allocator
    page_size = int(allocator.page_size)
    kv_tokens = len(req.origin_input_ids)  # the prompt this prefill computes
    end = int(end_idx) if end_idx is not None else min(int(req.extend_end), kv_tokens)
    row = scheduler.req_to_token_pool.req_to_token[req.kv.req_pool_idx]
    held = int(req.disagg_decode_prefix_len)
    try:
        pages = window_pages(
            row,
            allocator.translate_swa_indices_for_transfer,
            held,
            kv_tokens,
            page_size,
            upto=end - end % page_size,
        )
    except NoWindowPage as e:  # (the last send names every window page anyway)
        logger.debug("request %s: no window pages before the last send: %s", req.rid, e)
        return
    if len(pages):
        slots = tuple(int(p) for p in pages)
        sender.state_final_so_far(tuple(slots if kind == "swa" else () for kind in kinds))
