"""Prefill server + decode server + SGLang's router, with sgl_pd streaming the KV layer by
layer over real Mooncake TCP: same greedy tokens as one monolithic server, layers sent
while the forward pass still runs, and nothing leaked."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_pd.cluster.client import chat, generate_ids, stream_chat
from sgl_pd.cluster.local import PdCluster, Server
from sgl_pd.cluster.logs import last_pool_state, timing_lines
from sgl_pd.cluster.prompts import long_prompt_ids, varied_prompts

from .conftest import CHUNKED_PREFILL_SIZE, start_pd

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def pd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdCluster]:
    yield from start_pd(tmp_path_factory, "layerwise")


PROMPTS = varied_prompts(50)
MAX_NEW_TOKENS = 12


def _all(url: str) -> list[list[int]]:
    with ThreadPoolExecutor(max_workers=16) as pool:  # 16 requests in flight at a time
        return list(pool.map(lambda p: generate_ids(url, p, MAX_NEW_TOKENS), PROMPTS))


def test_prompts_cover_several_chunks() -> None:
    from transformers import AutoTokenizer

    from sgl_pd.models import TINY_LLAMA_PATH

    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA_PATH)
    lengths = [len(tokenizer(p).input_ids) for p in PROMPTS]
    assert min(lengths) < CHUNKED_PREFILL_SIZE and max(lengths) > 3 * CHUNKED_PREFILL_SIZE


def test_fifty_concurrent_prompts_match_monolithic_tokens(mono: Server, pd: PdCluster) -> None:
    expected = _all(mono.url)
    got = _all(pd.router_url)
    mismatches = [i for i, (e, g) in enumerate(zip(expected, got, strict=True)) if e != g]
    assert not mismatches, f"prompts {mismatches} differ from monolithic serving"
    assert all(len(ids) == MAX_NEW_TOKENS for ids in got)  # plain text never ends early


def test_streaming_chat_through_the_router(mono: Server, pd: PdCluster) -> None:
    streamed = stream_chat(pd.router_url, "What is 3 + 4?", max_tokens=24)
    assert streamed.text == chat(mono.url, "What is 3 + 4?", max_tokens=24)
    assert streamed.ttft_s <= streamed.total_s


def test_layers_are_sent_before_the_forward_pass_ends(mono: Server, pd: PdCluster) -> None:
    """A long prompt, chunked: the messenger's own clock shows the last chunk's first
    layer written before that chunk's forward pass ended, and the tokens still match."""
    ids = long_prompt_ids(8 * CHUNKED_PREFILL_SIZE)
    assert generate_ids(pd.router_url, ids, 4) == generate_ids(mono.url, ids, 4)
    line = timing_lines(pd.prefill.process.log_path)[-1]
    assert line["mode"] == "layerwise" and line["chunks"] == 8
    assert line["last_chunk_first_write"] < line["forward_end"] <= line["done"]


def test_metrics_report_transfers(pd: PdCluster) -> None:
    generate_ids(pd.router_url, PROMPTS[0], 2)
    text = requests.get(f"{pd.prefill.url}/metrics", timeout=30).text
    sent = re.search(r'^sgl_pd_transfer_bytes_total\{role="prefill"\} ([0-9.e+]+)$', text, re.M)
    assert sent is not None and float(sent.group(1)) > 0
    served = re.search(r'^sgl_pd_transfer_pages_total\{role="prefill"\} ([0-9.e+]+)$', text, re.M)
    assert served is not None and float(served.group(1)) > 0
    text = requests.get(f"{pd.decode.url}/metrics", timeout=30).text
    done = re.search(r'^sgl_pd_transfer_requests_total\{role="decode"\} ([0-9.e+]+)$', text, re.M)
    assert done is not None and float(done.group(1)) >= 1
    assert re.search(r'^sgl_pd_transfer_seconds_count\{role="decode"\}', text, re.M)


def test_every_page_is_free_again(pd: PdCluster) -> None:
    """Runs last in this module: after all its requests, both pools report 0 used tokens."""
    deadline = time.monotonic() + 60
    states: dict[str, tuple[int, bool] | None] = {}
    while time.monotonic() < deadline:
        states = {
            s.process.name: last_pool_state(s.process.log_path) for s in (pd.prefill, pd.decode)
        }
        if all(state == (0, True) for state in states.values()):
            return
        time.sleep(1)
    pytest.fail(f"pools still hold pages after the requests finished: {states}")
