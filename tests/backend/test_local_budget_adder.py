"""The local step's budget against SGLang's real `PrefillAdder`: whatever the number of
running streams, a step admits local work and a chunked local request continues with a
whole page at least (or its whole remainder) - never the negative chunk that crashed a
decoder at 512 concurrent requests."""

from __future__ import annotations

from array import array
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.sampling.sampling_params import SamplingParams

from sgl_pd.core.local_budget import adder_budget

from .sglang_pools import radix_cache, token_allocator

POOL_TOKENS = 1 << 16


class _Running:
    """A running batch as the adder reads it (its requests' reservations are not under
    test: none)."""

    def __init__(self) -> None:
        self.reqs: list[Any] = []


def _adder(page_size: int, budget: int, running: int) -> PrefillAdder:
    allocator = token_allocator(POOL_TOKENS, page_size)
    tree = radix_cache(allocator, page_size, disable=True)
    # what the scheduler passes: mixed decode tokens = the running streams (SGLang
    # takes them out of both budgets when is_mixed_chunk is set, as a local step sets it)
    return PrefillAdder(page_size, tree, allocator, _Running(), 0.5, budget, budget, running)


def _chunked_request(prompt: int, done: int) -> Req:
    params = SamplingParams(max_new_tokens=8)
    params.normalize(None)
    req = Req("local", "", array("q", range(1000, 1000 + prompt)), params)
    req.refresh_fill_ids()
    req.prefix_len = done  # its chunks so far
    return req


@settings(max_examples=200, deadline=None)
@given(
    running=st.integers(0, 1024),
    local_pages=st.integers(1, 64),
    page_size=st.sampled_from([1, 16, 64]),
)
def test_any_number_of_running_streams_leaves_the_local_budget_whole(
    running: int, local_pages: int, page_size: int
) -> None:
    local = local_pages * page_size
    for mixed in (True, False):
        # SGLang passes the running batch size as the mixed decode tokens only when the
        # step mixes (`is_mixed_chunk`, set from the step's plan)
        adder = _adder(
            page_size, adder_budget(local, running, mixed=mixed), running if mixed else 0
        )
        assert adder.rem_input_tokens == local
        assert adder.rem_chunk_tokens == local
        assert adder.budget_state() == AddReqResult.CONTINUE


@settings(max_examples=100, deadline=None)
@given(
    running=st.integers(0, 1024),
    local_pages=st.integers(1, 16),
    page_size=st.sampled_from([1, 16]),
    prompt_pages=st.integers(2, 40),
    done_pages=st.integers(1, 39),
)
def test_a_chunked_local_request_continues_by_at_least_a_page(
    running: int, local_pages: int, page_size: int, prompt_pages: int, done_pages: int
) -> None:
    done_pages = min(done_pages, prompt_pages - 1)
    prompt, done = prompt_pages * page_size, done_pages * page_size
    local = local_pages * page_size
    req = _chunked_request(prompt, done)
    adder = _adder(page_size, adder_budget(local, running, mixed=True), running)
    adder.add_chunked_req(req)
    chunk = req.extend_end - req.prefix_len
    assert chunk == min(local, prompt - done)
    assert chunk >= min(page_size, prompt - done)


@pytest.mark.parametrize("running", [16, 300])
def test_the_budget_sglang_took_for_the_step_starved_and_then_went_negative(
    running: int,
) -> None:
    """Why `adder_budget` exists: a budget of 16 with 16 or more streams admits nothing,
    and a chunked request continues with a chunk of 16 - streams tokens."""
    adder = _adder(1, 16, running)
    assert adder.budget_state() == AddReqResult.OTHER
    req = _chunked_request(400, 100)
    adder.add_chunked_req(req)
    assert req.extend_end - req.prefix_len == 16 - running <= 0
