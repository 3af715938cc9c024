"""The same pair with --pd-kv-send after-forward (SGLang's own timing, kept for
comparison) and 64-token pages (what GPU deployments use; the other module runs 1-token
pages): same greedy tokens as monolithic serving, and each chunk's KV is written only
once its forward pass has ended."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_pd.cluster.client import generate_ids
from sgl_pd.cluster.local import PdCluster, Server
from sgl_pd.cluster.logs import timing_lines
from sgl_pd.cluster.prompts import long_prompt_ids, varied_prompts

from .conftest import CHUNKED_PREFILL_SIZE, start_pd

pytestmark = pytest.mark.e2e

PROMPTS = varied_prompts(20, seed=11)
PAGE_SIZE = 64


@pytest.fixture(scope="module")
def pd_after_forward(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdCluster]:
    yield from start_pd(tmp_path_factory, "after-forward", extra=("--page-size", str(PAGE_SIZE)))


def test_concurrent_prompts_match_monolithic_tokens(
    mono: Server, pd_after_forward: PdCluster
) -> None:
    with ThreadPoolExecutor(max_workers=10) as pool:
        expected = list(pool.map(lambda p: generate_ids(mono.url, p, 8), PROMPTS))
        got = list(pool.map(lambda p: generate_ids(pd_after_forward.router_url, p, 8), PROMPTS))
    assert got == expected


def test_kv_is_written_after_the_forward_pass(mono: Server, pd_after_forward: PdCluster) -> None:
    ids = long_prompt_ids(4 * CHUNKED_PREFILL_SIZE)
    assert generate_ids(pd_after_forward.router_url, ids, 4) == generate_ids(mono.url, ids, 4)
    line = timing_lines(pd_after_forward.prefill.process.log_path)[-1]
    # SGLang hands the KV over once per forward, sometimes in one more piece than chunks
    assert line["mode"] == "after_forward" and float(line["chunks"]) >= 4
    assert line["forward_end"] < line["last_chunk_first_write"] <= line["done"]


def test_prompts_around_page_boundaries_match_monolithic_tokens(
    mono: Server, pd_after_forward: PdCluster
) -> None:
    """The decoder samples the first token from prompt token n-1 (D16), so the prefiller
    sends n-1 tokens: prompts that end just before, on and after a page boundary."""
    for n in (1, 2, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1, PAGE_SIZE + 2, 2 * PAGE_SIZE + 1):
        ids = long_prompt_ids(n) if n > 1 else [0]
        assert generate_ids(pd_after_forward.router_url, ids, 6) == generate_ids(
            mono.url, ids, 6
        ), n
