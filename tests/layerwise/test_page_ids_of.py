"""`page_ids_of` on CPU tensors: the ids SGLang's `kv_to_page_indices` computes, known at
once, and a copy of their own (SGLang may rewrite the request's row after the notice)."""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.common import kv_to_page_indices

from sgl_pd.backend.prefill.layerwise_glue import page_ids_of


def test_cpu_ids_match_sglangs_and_do_not_alias_the_row() -> None:
    row = torch.arange(64, 64 + 40, dtype=torch.int32)  # token slots of one request
    for page_size in (1, 16):
        ids = page_ids_of(row, page_size)
        assert ids.resolved
        assert ids.array().tolist() == kv_to_page_indices(row, page_size).tolist()
    before = page_ids_of(row, 1).array().copy()
    ids = page_ids_of(row, 1)
    row[:] = 0  # SGLang points the row at another copy of the prefix
    assert ids.array().tolist() == before.tolist()
