"""Which of a prompt's tokens a sliding-window layer's KV must cross from prefill to
decode: SGLang keeps sliding layers in a page space of their own (its hybrid SWA pool)
and frees their out-of-window pages, so only the window's pages move.

A request whose decoder holds the first `held` prompt tokens (whole pages) and needs the
KV of `kv_tokens` (`backend.first_token`: c) decodes its next token at position c; its
sliding layers attend to at most the `window` tokens before it. The pages written are
those of positions [max(held, c - window), c), the start rounded down to a page - the
range SGLang's own transfer uses (its ``_swa_payload``, on both roles). Both servers
compute it from the same four numbers, so the prefill's and the decoder's lists of
window pages pair up one to one, in order.
"""

from __future__ import annotations


def window_tokens(held: int, kv_tokens: int, window: int, page_size: int) -> range:
    """Prompt positions whose sliding-window KV the decoder receives (whole pages from a
    page boundary on, up to `kv_tokens`; empty when the decoder holds them all)."""
    if min(held, kv_tokens, window) < 0 or page_size < 1:
        raise ValueError(f"bad window arguments {held, kv_tokens, window, page_size}")
    start = max(held, kv_tokens - window)
    start -= start % page_size
    return range(min(start, kv_tokens), kv_tokens)


def window_pages(held: int, kv_tokens: int, window: int, page_size: int) -> range:
    """Logical pages (page i: positions [i * page_size, (i + 1) * page_size)) of the
    window's positions, `window_tokens`."""
    tokens = window_tokens(held, kv_tokens, window, page_size)
    if not tokens:
        return range(0)
    return range(tokens.start // page_size, -(-tokens.stop // page_size))
