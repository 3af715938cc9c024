"""Extend attention for SGLang's torch_native backend over the new tokens only.

SGLang 0.5.23's `TorchNativeAttnBackend._run_sdpa_forward_extend` computes a request's
extend (a prefill chunk after the first, a speculative verify) by filling a query
tensor as long as the whole context - prefix positions left uninitialised - running
causal attention over context x context, and keeping the last rows: O(context^2) work
for a few new tokens. On the CPU engine that makes a speculative verify step at a
2k-token context cost about as much as the 2k-token prefill.

`sdpa_forward_extend` computes the same rows directly: the request's new queries
(extend_len of them, at positions prefix .. prefix + extend_len - 1) against its whole
context, with the causal mask offset by the prefix (key j visible to new token i iff
j <= prefix + i); a first chunk (no prefix) is plain causal attention, which SDPA runs
with its fused kernel instead of a materialised mask. Encoder (cross-attention) and
sliding-window layers keep SGLang's path.
"""

from __future__ import annotations

from typing import Any


def sdpa_forward_extend(
    query: Any,
    output: Any,
    k_cache: Any,
    v_cache: Any,
    req_to_token: Any,
    req_pool_indices: Any,
    seq_lens: Any,
    extend_prefix_lens: Any,
    extend_seq_lens: Any,
    *,
    scaling: float | None = None,
    enable_gqa: bool = False,
    causal: bool = False,
) -> Any:
    """Shapes as SGLang's: query/output [tokens, heads, dim]; caches [slots, kv_heads,
    dim]; req_to_token [requests, max_context]; the rest [batch] (context lengths)."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    heads_first = query.movedim(0, 1)  # [heads, tokens, dim]
    start = 0
    for i in range(int(seq_lens.shape[0])):
        new = int(extend_seq_lens[i])
        prefix = int(extend_prefix_lens[i])
        context = int(seq_lens[i])
        if not new:
            continue
        slots = req_to_token[req_pool_indices[i], :context]
        q = heads_first[:, start : start + new, :]
        k = k_cache[slots].movedim(0, 1)  # [kv_heads, context, dim]
        v = v_cache[slots].movedim(0, 1)
        if not q.dtype == k.dtype == v.dtype:
            k, v = k.to(q.dtype), v.to(q.dtype)
        mask, is_causal = None, False
        if causal and prefix == 0:
            is_causal = True  # a first chunk: plain causal (SDPA's fused kernel, no mask)
        elif causal:
            rows = torch.arange(new, device=q.device)[:, None] + prefix
            mask = torch.arange(context, device=q.device)[None, :] <= rows  # [new, context]
        out = scaled_dot_product_attention(
            q.unsqueeze(0),
            k.unsqueeze(0),
            v.unsqueeze(0),
            attn_mask=mask,
            is_causal=is_causal,
            scale=scaling,
            enable_gqa=enable_gqa,
        )
        output[start : start + new] = out.squeeze(0).movedim(1, 0)
        start += new
    return output


def around_run_sdpa_forward_extend(
    original: Any,
    self: Any,
    query: Any,
    output: Any,
    k_cache: Any,
    v_cache: Any,
    req_to_token: Any,
    req_pool_indices: Any,
    seq_lens: Any,
    extend_prefix_lens: Any,
    extend_seq_lens: Any,
    encoder_lens: Any = None,
    scaling: float | None = None,
    enable_gqa: bool = False,
    causal: bool = False,
    is_cross_attn: bool = False,
    sliding_window_size: int | None = None,
) -> Any:
    """AROUND hook of `TorchNativeAttnBackend._run_sdpa_forward_extend` (same arguments)."""
    if encoder_lens is not None or (sliding_window_size is not None and sliding_window_size > -1):
        return original(
            self, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
            extend_prefix_lens, extend_seq_lens, encoder_lens, scaling, enable_gqa, causal,
            is_cross_attn, sliding_window_size,
        )  # fmt: skip
    return sdpa_forward_extend(
        query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens,
        extend_prefix_lens, extend_seq_lens,
        scaling=scaling, enable_gqa=enable_gqa, causal=causal,
    )  # fmt: skip
