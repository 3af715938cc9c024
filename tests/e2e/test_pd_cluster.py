"""Prefill server + decode server + SGLang's router, with sgl_pd moving the KV over
real Mooncake TCP: same greedy tokens as one monolithic server, and nothing leaked."""

from __future__ import annotations

import re
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_pd.backend.pool_report import POOL_LINE_PREFIX
from sgl_pd.cluster.client import chat, generate_ids, stream_chat
from sgl_pd.cluster.local import PdCluster, Server

from .conftest import CHUNKED_PREFILL_SIZE
from .prompts import varied_prompts

pytestmark = pytest.mark.e2e

PROMPTS = varied_prompts(50)
MAX_NEW_TOKENS = 12


def _all(url: str) -> list[list[int]]:
    with ThreadPoolExecutor(max_workers=16) as pool:  # all 50 in flight together
        return list(pool.map(lambda p: generate_ids(url, p, MAX_NEW_TOKENS), PROMPTS))


def test_prompts_cover_several_chunks() -> None:
    from transformers import AutoTokenizer

    from sgl_pd.models import TINY_LLAMA_PATH

    tokenizer = AutoTokenizer.from_pretrained(TINY_LLAMA_PATH)
    lengths = [len(tokenizer(p).input_ids) for p in PROMPTS]
    assert min(lengths) < CHUNKED_PREFILL_SIZE < max(lengths) // 4


def test_fifty_concurrent_prompts_match_monolithic_tokens(mono: Server, pd: PdCluster) -> None:
    expected = _all(mono.url)
    got = _all(pd.router_url)
    mismatches = [i for i, (e, g) in enumerate(zip(expected, got, strict=True)) if e != g]
    assert not mismatches, f"prompts {mismatches} differ from monolithic serving"
    assert all(len(ids) == MAX_NEW_TOKENS or ids for ids in got)


def test_streaming_chat_through_the_router(mono: Server, pd: PdCluster) -> None:
    streamed = stream_chat(pd.router_url, "What is 3 + 4?", max_tokens=24)
    assert streamed.text == chat(mono.url, "What is 3 + 4?", max_tokens=24)
    assert streamed.ttft_s <= streamed.total_s


def test_metrics_report_transfers(pd: PdCluster) -> None:
    generate_ids(pd.router_url, PROMPTS[0], 2)
    text = requests.get(f"{pd.prefill.url}/metrics", timeout=30).text
    sent = re.search(r'^sgl_pd_transfer_bytes_total\{role="prefill"\} ([0-9.e+]+)$', text, re.M)
    assert sent is not None and float(sent.group(1)) > 0
    text = requests.get(f"{pd.decode.url}/metrics", timeout=30).text
    done = re.search(r'^sgl_pd_transfer_requests_total\{role="decode"\} ([0-9.e+]+)$', text, re.M)
    assert done is not None and float(done.group(1)) >= 1
    assert re.search(r'^sgl_pd_transfer_seconds_count\{role="decode"\}', text, re.M)


def _last_pool_line(log: str) -> tuple[int, bool] | None:
    lines = [line for line in log.splitlines() if POOL_LINE_PREFIX in line]
    if not lines:
        return None
    used = int(re.search(r"used (\d+) tokens", lines[-1]).group(1))  # type: ignore[union-attr]
    return used, "no leak" in lines[-1]


def test_every_page_is_free_again(pd: PdCluster) -> None:
    """Runs last in this module: after all requests, both pools report 0 used tokens."""
    _all(pd.router_url)
    deadline = time.monotonic() + 60
    states: dict[str, tuple[int, bool] | None] = {}
    while time.monotonic() < deadline:
        states = {
            s.process.name: _last_pool_line(s.process.log_path.read_text(errors="replace"))
            for s in (pd.prefill, pd.decode)
        }
        if all(state == (0, True) for state in states.values()):
            return
        time.sleep(1)
    pytest.fail(f"pools still hold pages after the requests finished: {states}")
