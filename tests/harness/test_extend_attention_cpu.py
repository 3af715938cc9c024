"""The torch_native extend attention shim gives SGLang's own results, without computing
attention over context x context."""

from __future__ import annotations

import pytest
import torch
from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend

from sgl_pd.harness.extend_attention_cpu import around_run_sdpa_forward_extend

SGLANG_EXTEND = TorchNativeAttnBackend._run_sdpa_forward_extend


def _case(
    seed: int, prefixes: list[int], news: list[int], heads: int, kv_heads: int, v_dim: int
) -> tuple:
    g = torch.Generator().manual_seed(seed)
    dim, slots = 16, 256
    tokens = sum(news)
    query = torch.randn(tokens, heads, dim, generator=g)
    k_cache = torch.randn(slots, kv_heads, dim, generator=g)
    v_cache = torch.randn(slots, kv_heads, v_dim, generator=g)
    contexts = [p + n for p, n in zip(prefixes, news, strict=True)]
    req_to_token = torch.zeros(len(news) + 2, max(contexts), dtype=torch.int64)
    pool = torch.randperm(slots, generator=g)
    used = 0
    for r, context in enumerate(contexts):  # rows 1.. (row 0 unused): scattered slots
        req_to_token[r + 1, :context] = pool[used : used + context]
        used += context
    return (
        query,
        k_cache,
        v_cache,
        req_to_token,
        torch.arange(1, len(news) + 1),
        torch.tensor(contexts),
        torch.tensor(prefixes),
        torch.tensor(news),
        v_dim,
    )


@pytest.mark.parametrize(
    ("prefixes", "news", "heads", "kv_heads", "v_dim", "causal"),
    [
        ([0], [7], 4, 4, 16, True),  # a first chunk
        ([40, 0, 13], [2, 9, 1], 4, 2, 16, True),  # verify-like, prefill, decode-like; GQA
        ([30, 5], [3, 4], 1, 1, 12, True),  # absorbed MLA shape: one KV head, v narrower
        ([8], [5], 4, 4, 16, False),  # non-causal
        ([6, 3], [0, 4], 2, 2, 16, True),  # a request with nothing new
    ],
)
def test_the_shim_gives_sglangs_extend_output(
    prefixes: list[int], news: list[int], heads: int, kv_heads: int, v_dim: int, causal: bool
) -> None:
    q, kc, vc, r2t, pools, seqs, pre, new, vd = _case(0, prefixes, news, heads, kv_heads, v_dim)
    want = torch.zeros(q.shape[0], heads, vd)
    got = torch.zeros(q.shape[0], heads, vd)
    args = (q, kc, vc, r2t, pools, seqs, pre, new)
    kwargs = {"scaling": 0.25, "enable_gqa": heads != kv_heads, "causal": causal}
    SGLANG_EXTEND(None, q, want, *args[1:], **kwargs)
    around_run_sdpa_forward_extend(SGLANG_EXTEND, None, q, got, *args[1:], None, **kwargs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_sliding_window_layers_keep_sglangs_path() -> None:
    calls = []

    def original(*args: object) -> str:
        calls.append(args)
        return "sglang"

    q, kc, vc, r2t, pools, seqs, pre, new, vd = _case(1, [4], [2], 2, 2, 16)
    out = torch.zeros(2, 2, vd)
    result = around_run_sdpa_forward_extend(
        original, None, q, out, kc, vc, r2t, pools, seqs, pre, new, causal=True,
        sliding_window_size=3,
    )  # fmt: skip
    assert result == "sglang" and len(calls) == 1
