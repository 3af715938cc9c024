"""Direct mode with two prefill servers: a decoder sends a prompt to the one predicted to
give its first token soonest (`core.placement`), so the next turn of a conversation, whose
long prefix one of them computed, goes there - and gets monolithic's tokens."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest
import requests

from sgl_pd.cluster.client import generate_ids
from sgl_pd.cluster.local import DirectCluster, Server, direct_cluster
from sgl_pd.cluster.logs import timing_lines
from sgl_pd.cluster.prompts import long_prompt_ids
from sgl_pd.core.placement import BLOCK_TOKENS

from .conftest import COMMON_ARGS

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def two_prefills(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectCluster]:
    with direct_cluster(
        tmp_path_factory.mktemp("placement"),
        prefill_extra=COMMON_ARGS,
        decode_extra=[*COMMON_ARGS, "--enable-metrics"],
        decoders=1,
        prefills=2,
    ) as cluster:
        yield cluster


def _prefilled(cluster: DirectCluster, total: int | None = None) -> list[int]:
    """How many requests each prefill server has prefilled so far; with `total`, once
    their lines add up to it (a server logs a request when its last write completed,
    which the client's answer may precede)."""
    servers = (cluster.prefill, *cluster.more_prefills)
    deadline = time.monotonic() + 30
    while True:
        counts = [len(timing_lines(s.process.log_path)) for s in servers]
        if total is None or sum(counts) >= total or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def test_each_turn_of_a_conversation_goes_where_its_prefix_was_computed(
    mono: Server, two_prefills: DirectCluster
) -> None:
    decoder = two_prefills.decoders[0]
    history = long_prompt_ids(6 * BLOCK_TOKENS, start=31)
    before = _prefilled(two_prefills)
    assert generate_ids(decoder.url, history, 4) == generate_ids(mono.url, history, 4)
    first = _prefilled(two_prefills, sum(before) + 1)
    (chosen,) = [i for i, (a, b) in enumerate(zip(before, first, strict=True)) if b > a]
    prompt = history
    for turn in range(3):  # each turn extends the conversation: the prefix stays there
        prompt = [*prompt, *long_prompt_ids(20, start=7000 + 50 * turn)]
        counts = _prefilled(two_prefills)
        assert generate_ids(decoder.url, prompt, 4) == generate_ids(mono.url, prompt, 4)
        after = _prefilled(two_prefills, sum(counts) + 1)
        assert [b - a for a, b in zip(counts, after, strict=True)] == [
            int(i == chosen) for i in range(len(counts))
        ], f"turn {turn}: prefilled {counts} -> {after}, the prefix is on server {chosen}"
    metrics = requests.get(f"{decoder.url}/metrics", timeout=30).text
    placed = {
        m.group(1): float(m.group(2))
        for m in re.finditer(r'sgl_pd_prefill_placements_total\{reason="(\w+)"\} (\S+)', metrics)
    }
    assert placed.get("cached_prefix", 0) >= 3, placed  # the three follow-up turns


def test_fresh_prompts_are_shared_between_the_prefill_servers(
    mono: Server, two_prefills: DirectCluster
) -> None:
    decoder = two_prefills.decoders[0]
    before = _prefilled(two_prefills)
    for n in range(4):
        ids = long_prompt_ids(100, start=20_000 + 1000 * n)
        assert generate_ids(decoder.url, ids, 2) == generate_ids(mono.url, ids, 2)
    after = _prefilled(two_prefills, sum(before) + 4)
    assert all(b > a for a, b in zip(before, after, strict=True)), (before, after)
