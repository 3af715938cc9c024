"""The same pair with --pd-kv-send after-forward (SGLang's own timing, kept for
comparison) and 64-token pages (what GPU deployments use; the other module runs 1-token
pages): same greedy tokens as monolithic serving, and each chunk's KV is written only
once its forward pass has ended. The decoder keeps a prefix cache, which holds whole
pages only: prompts around page boundaries show what it holds and what still moves."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest

from sgl_pd.cluster.client import generate_ids
from sgl_pd.cluster.conversations import replay, script, wrong_turns
from sgl_pd.cluster.local import PdCluster, Server
from sgl_pd.cluster.logs import timing_lines
from sgl_pd.cluster.prompts import long_prompt_ids, varied_prompts

from .conftest import CHUNKED_PREFILL_SIZE, DECODE_PREFIX_CACHE, start_pd

pytestmark = pytest.mark.e2e

PROMPTS = varied_prompts(20, seed=11)
PAGE_SIZE = 64


@pytest.fixture(scope="module")
def pd_after_forward(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdCluster]:
    yield from start_pd(
        tmp_path_factory,
        "after-forward",
        extra=("--page-size", str(PAGE_SIZE)),
        decode_extra=DECODE_PREFIX_CACHE,
    )


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


def test_held_prefixes_end_on_whole_pages(mono: Server, pd_after_forward: PdCluster) -> None:
    """Prompts inside a cached longer one: the decoder holds the whole pages before the
    prompt's last token (which its first decode step computes) and the rest moves - a
    full hit when the tokens the prefiller computes end on a page boundary."""
    longer = long_prompt_ids(3 * PAGE_SIZE + 5, start=7000)
    generate_ids(pd_after_forward.router_url, longer, 2)
    for n in (PAGE_SIZE, PAGE_SIZE + 1, PAGE_SIZE + 2, 2 * PAGE_SIZE, 2 * PAGE_SIZE + 1):
        ids = longer[:n]
        got = generate_ids(pd_after_forward.router_url, ids, 6)
        assert got == generate_ids(mono.url, ids, 6), n
        line = timing_lines(pd_after_forward.prefill.process.log_path)[-1]
        held = (n - 1) // PAGE_SIZE * PAGE_SIZE
        assert (line["tokens"], line["held"]) == (n - 1, held), (n, line)
        assert (line["chunks"] == 0) == (held == n - 1), (n, line)


def test_multi_turn_conversations_after_the_forward(
    mono: Server, pd_after_forward: PdCluster
) -> None:
    openers = [long_prompt_ids(70 + 37 * i, start=300 * i + 11) for i in range(4)]
    conversations = script(mono.url, openers, turns=3, max_new_tokens=8)
    before = len(timing_lines(pd_after_forward.prefill.process.log_path))
    verdicts = replay(pd_after_forward.router_url, conversations)
    assert not wrong_turns(verdicts), verdicts
    lines = timing_lines(pd_after_forward.prefill.process.log_path)[before:]
    assert sum(line["held"] > 0 for line in lines) >= 4 * 2, lines
