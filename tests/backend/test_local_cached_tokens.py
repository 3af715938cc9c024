"""What the decoder's tree cache serves a local request (`local_prefill._cached_tokens`),
against SGLang's real RadixCache and Req: what it holds of the prompt, up to what SGLang
reuses - never the prompt's last token, nor any from a `logprob_start_len` on, whose
logprobs SGLang computes however much is cached (so a follow-up asking for its whole
prompt's logprobs is a whole prefill, not its short suffix)."""

from __future__ import annotations

from array import array

import pytest
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import InsertParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey
from sglang.srt.sampling.sampling_params import SamplingParams

from sgl_pd.backend.decode import local_prefill

from .sglang_pools import radix_cache, token_allocator

HELD = list(range(1000, 1300))  # a conversation the decoder served: 300 tokens


def _tree(page_size: int = 1, *, eagle: bool = False) -> RadixCache:
    tree = radix_cache(token_allocator(1 << 12, page_size), page_size, eagle=eagle)
    tree.insert(InsertParams(key=RadixKey(array("q", HELD)), value=torch.arange(len(HELD))))
    return tree


def _req(prompt: list[int], logprob_start: int | None = None) -> Req:
    params = SamplingParams(max_new_tokens=8)
    params.normalize(None)
    req = Req("r", "", array("q", prompt), params, return_logprob=logprob_start is not None)
    req.logprob_start_len = -1 if logprob_start is None else logprob_start  # (as queued)
    return req


@pytest.mark.parametrize(
    ("prompt", "logprob_start", "served"),
    [
        ([*HELD, 1, 2, 3], None, 300),  # a follow-up: all it holds
        ([*HELD, 1, 2, 3], 290, 290),  # logprobs of its last 13: those recomputed
        ([*HELD, 1, 2, 3], 0, 0),  # its whole prompt's logprobs: nothing served
        (HELD, None, 299),  # the whole prompt held: its last token still computed
        (HELD[:100], None, 99),
    ],
)
def test_the_cache_serves_what_it_holds_up_to_what_sglang_reuses(
    prompt: list[int], logprob_start: int | None, served: int
) -> None:
    tree, req = _tree(), _req(prompt, logprob_start)
    assert local_prefill._cached_tokens(tree, req) == served
    req.init_next_round_input(tree)  # SGLang's own match for the request agrees
    assert req.prefix_len == served


@pytest.mark.parametrize(
    ("prompt", "logprob_start", "served"),
    [
        ([*HELD, 1, 2, 3], None, 288),  # the held whole pages: 18 of 16 tokens
        (HELD[:288], None, 272),  # a prompt held whole, in whole pages: its last page again
        ([*HELD, 1, 2, 3], 290, 288),
        ([*HELD, 1, 2, 3], 280, 272),  # (from the start's page on)
    ],
)
def test_with_pages_the_cache_serves_whole_pages(
    prompt: list[int], logprob_start: int | None, served: int
) -> None:
    tree = _tree(page_size=16)
    req = _req(prompt, logprob_start)
    assert local_prefill._cached_tokens(tree, req) == served
    # as SGLang's own match for the request finds it
    req.init_next_round_input(tree)
    assert req.prefix_len == served


def test_over_eagle_s_bigram_keys_the_cache_serves_what_sglang_finds() -> None:
    """A decoder drafting with EAGLE keys its tree by token pairs: a prompt held whole
    is served all but its last two tokens."""
    tree = _tree(eagle=True)
    for prompt, served in ((HELD, 298), ([*HELD, 1, 2, 3], 299)):
        req = _req(prompt)
        assert local_prefill._cached_tokens(tree, req) == served
        req.init_next_round_input(tree)
        assert req.prefix_len == served


def test_a_retracted_request_is_served_its_prompt_and_recomputes_its_output() -> None:
    tree, req = _tree(), _req(HELD)
    req.output_ids = array("q", [5, 6, 7])  # (decoded before the retraction: not held)
    assert local_prefill._cached_tokens(tree, req) == 300
    req.init_next_round_input(tree)
    assert req.prefix_len == 300
