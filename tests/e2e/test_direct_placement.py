"""Direct mode with two prefill servers: a decoder sends a prompt to the one predicted to
give its first token soonest (`core.placement`), so the next turn of a conversation, whose
long prefix one of them computed, goes there - and gets monolithic's tokens. A turn that
adds only a short suffix to what the decoder holds is prefilled by the decoder itself
(`backend/decode/local_prefill.py`), as are short prompts while every prefill server is
saturated; running streams go on, aborts leave nothing behind."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import requests

from sgl_pd.cluster.client import (
    generate_ids,
    send_as_router,
    set_local_prefill_limit,
    stream_generate,
)
from sgl_pd.cluster.local import DirectCluster, Patience, Server, direct_cluster
from sgl_pd.cluster.logs import pools_idle, timing_lines, unexpected_warnings, wait_pools_idle
from sgl_pd.cluster.prompts import long_prompt_ids
from sgl_pd.core.placement import BLOCK_TOKENS

from .conftest import COMMON_ARGS, DECODE_LOCAL_PREFILL

pytestmark = pytest.mark.e2e

LOCAL_MAX_TOKENS = 128  # the decoder prefills uncached suffixes up to this long itself
SATURATED_TOKENS = 600  # prompt tokens outstanding at a prefill server that saturate it


@pytest.fixture(scope="module")
def two_prefills(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectCluster]:
    with direct_cluster(
        tmp_path_factory.mktemp("placement"),
        prefill_extra=COMMON_ARGS,
        decode_extra=[
            *COMMON_ARGS,
            "--enable-metrics",
            *DECODE_LOCAL_PREFILL,
            "--pd-local-prefill-max-tokens",
            str(LOCAL_MAX_TOKENS),
            "--pd-prefill-saturated-tokens",
            str(SATURATED_TOKENS),
            # two ranks: local steps are decided and batched alike on each
            "--tp",
            "2",
        ],
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
        # (by more than the decoder prefills itself, which the tests below exercise)
        prompt = [*prompt, *long_prompt_ids(2 * LOCAL_MAX_TOKENS, start=7000 + 500 * turn)]
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


def _kept_here(prompt: list[int], suffix: int, max_new_tokens: int) -> dict[str, Any]:
    """A greedy request of `prompt` that stays on the decoder once placed there, whatever
    its models predict: it asks for the logprobs of its last `suffix` prompt tokens, which
    only a prefill of them gives, and the decoder prefills them itself. (A plain request
    goes where its first token is predicted sooner: on a loaded machine, where the
    decoder's two ranks compute a token three times slower than the prefill server, that
    can be the prefill server - which the unit tests of `core.local_budget` cover.)"""
    return {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        "return_logprob": True,
        "logprob_start_len": len(prompt) - suffix,
    }


def _output_ids(url: str, body: dict[str, Any]) -> list[int]:
    response = requests.post(f"{url}/generate", json=body, timeout=300)
    response.raise_for_status()
    return [int(t) for t in response.json()["output_ids"]]


def _metric(decoder: Server, name: str, reason: str) -> float:
    metrics = requests.get(f"{decoder.url}/metrics", timeout=30).text
    found = re.search(rf'{name}\{{reason="{reason}"\}} (\S+)', metrics)
    return float(found.group(1)) if found else 0.0


def test_follow_up_turns_are_prefilled_on_the_decoder(
    mono: Server, two_prefills: DirectCluster
) -> None:
    """The first, long turn goes to a prefill server; each follow-up adds a short message
    to what the decoder holds (the history and its own answers) and is prefilled there
    (`_kept_here`), token-identical to monolithic serving."""
    decoder = two_prefills.decoders[0]
    prompt = long_prompt_ids(5 * BLOCK_TOKENS, start=41)
    before = _prefilled(two_prefills)
    answer = generate_ids(decoder.url, prompt, 8)
    assert answer == generate_ids(mono.url, prompt, 8)
    assert sum(_prefilled(two_prefills, sum(before) + 1)) == sum(before) + 1
    local_before = _metric(decoder, "sgl_pd_local_prefills_total", "cached_prefix")
    for turn in range(3):
        prompt = [*prompt, *answer, *long_prompt_ids(24, start=9000 + 100 * turn)]
        body = _kept_here(prompt, 24, 8)
        answer = _output_ids(decoder.url, body)
        assert answer == _output_ids(mono.url, body), f"turn {turn}"
    local = _metric(decoder, "sgl_pd_local_prefills_total", "cached_prefix") - local_before
    assert local == 3
    time.sleep(1)  # (a prefill server logs a request after its answer: none may come)
    assert sum(_prefilled(two_prefills)) == sum(before) + 1, "a follow-up went to a prefiller"


def test_local_prefill_turned_off_while_serving_sends_follow_ups_out_until_turned_on(
    mono: Server, two_prefills: DirectCluster
) -> None:
    """At 0, a follow-up the decoder holds all but 24 tokens of goes to a prefill server,
    sent directly or as a router sends it (both ranks took the setting); back at its
    start-up value, the next follow-ups are placed here again, in both flows (one sent
    as a router sends it may still go out where its first token is sooner remote: it
    counts as placed here all the same)."""
    decoder = two_prefills.decoders[0]
    history = long_prompt_ids(4 * BLOCK_TOKENS, start=71_000)
    prefilled_before = sum(_prefilled(two_prefills))
    answer = generate_ids(decoder.url, history, 4)  # (prefilled remotely: 1)
    turns = _Turns(mono, two_prefills, [*history, *answer])
    local_before = _metric(decoder, "sgl_pd_local_prefills_total", "cached_prefix")
    try:
        assert set_local_prefill_limit(decoder.url, 0) == [True]
        turns.kept_here(72_000)  # (kept here, were it placed here)
        assert not turns.as_router(73_000).get("pd_prefilled_by_decoder")
        assert _metric(decoder, "sgl_pd_local_prefills_total", "cached_prefix") == local_before
        assert sum(_prefilled(two_prefills, prefilled_before + 3)) == prefilled_before + 3
    finally:  # (whatever failed: the module's later tests need local prefill on)
        restored = set_local_prefill_limit(decoder.url, LOCAL_MAX_TOKENS)
    assert restored == [True]
    turns.kept_here(74_000)
    turns.as_router(75_000)
    local = _metric(decoder, "sgl_pd_local_prefills_total", "cached_prefix") - local_before
    assert local == 2


class _Turns:
    """A conversation's follow-ups of 24 tokens on the cluster's decoder, each checked
    against monolithic's tokens; `conversation`: all of it so far."""

    def __init__(self, mono: Server, cluster: DirectCluster, conversation: list[int]) -> None:
        self.mono, self.cluster, self.conversation = mono, cluster, conversation

    def kept_here(self, start: int) -> None:
        """Sent to the decoder, asking for its new tokens' logprobs (`_kept_here`)."""
        prompt = [*self.conversation, *long_prompt_ids(24, start=start)]
        body = _kept_here(prompt, 24, 4)
        answer = _output_ids(self.cluster.decoders[0].url, body)
        assert answer == _output_ids(self.mono.url, body)
        self.conversation = [*prompt, *answer]

    def as_router(self, start: int) -> dict[str, Any]:
        """Sent as a router sends it, plain; the prefill server's meta_info."""
        prompt = [*self.conversation, *long_prompt_ids(24, start=start)]
        body = {"input_ids": prompt, "sampling_params": {"temperature": 0, "max_new_tokens": 4}}
        prefilled, decoded = send_as_router(
            self.cluster.prefill.url,
            self.cluster.decoders[0].url,
            self.cluster.bootstrap_port,
            body,
        )
        assert prefilled.ok and decoded.ok, (prefilled.text[:300], decoded.text[:300])
        answer = [int(t) for t in decoded.json()["output_ids"]]
        assert answer == generate_ids(self.mono.url, prompt, 4)
        self.conversation = [*prompt, *answer]
        meta: dict[str, Any] = prefilled.json()["meta_info"]
        return meta


def test_running_streams_go_on_while_the_decoder_prefills(
    mono: Server, two_prefills: DirectCluster
) -> None:
    """Follow-ups while a stream runs - prefilled here, mixed into the stream's decode
    steps, or remote where the decoder predicts their first token sooner there (on a
    loaded machine it may) - and the stream all get monolithic's tokens (the stream's
    pace is the benchmark's business: bench_placement.py)."""
    decoder = two_prefills.decoders[0]
    stream_prompt = long_prompt_ids(100, start=61_000)
    streamed: list[int] = []

    def stream() -> None:
        for _, chunk in stream_generate(decoder.url, stream_prompt, 48, ignore_eos=True):
            streamed[:] = chunk["output_ids"]

    streaming = threading.Thread(target=stream)
    streaming.start()
    history = long_prompt_ids(4 * BLOCK_TOKENS, start=63_000)
    answer = generate_ids(decoder.url, history, 4)
    follow_ups = []
    for turn in range(3):
        history = [*history, *answer, *long_prompt_ids(16, start=65_000 + 100 * turn)]
        answer = generate_ids(decoder.url, history, 4)
        follow_ups.append((list(history), answer))
    streaming.join(timeout=300)
    for prompt, got in follow_ups:
        assert got == generate_ids(mono.url, prompt, 4)
    expected = requests.post(
        f"{mono.url}/generate",
        json={
            "input_ids": stream_prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": 48, "ignore_eos": True},
        },
        timeout=120,
    ).json()["output_ids"]
    assert streamed == expected


def test_short_prompts_go_local_while_every_prefill_server_is_saturated(
    mono: Server, two_prefills: DirectCluster
) -> None:
    decoder = two_prefills.decoders[0]
    placed = sum(
        _metric(decoder, "sgl_pd_prefill_placements_total", r) for r in ("cached_prefix", "load")
    )
    saturated = _metric(decoder, "sgl_pd_local_prefills_total", "saturated")
    longs = [long_prompt_ids(1800, start=100_000 + 10_000 * i) for i in range(2)]
    threads = [threading.Thread(target=generate_ids, args=(decoder.url, p, 2)) for p in longs]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while (
        sum(
            _metric(decoder, "sgl_pd_prefill_placements_total", r)
            for r in ("cached_prefix", "load")
        )
        < placed + 2
    ):  # both long prompts taken: one each, over the saturation bound
        assert time.monotonic() < deadline, "the long prompts were not placed"
        time.sleep(0.05)
    short = _kept_here(long_prompt_ids(40, start=130_000), 40, 6)
    got = _output_ids(decoder.url, short)
    for t in threads:
        t.join(timeout=300)
    assert _metric(decoder, "sgl_pd_local_prefills_total", "saturated") == saturated + 1
    assert got == _output_ids(mono.url, short)


def test_local_prefills_aborted_at_any_point_end_cleanly(two_prefills: DirectCluster) -> None:
    """Aborted while queued, prefilling or decoding: each request ends (finished or
    aborted, never an error) and holds nothing (checked by the last test)."""
    decoder = two_prefills.decoders[0]
    history = long_prompt_ids(4 * BLOCK_TOKENS, start=140_000)
    answer = generate_ids(decoder.url, history, 4)
    for i, delay_s in enumerate((0.0, 0.01, 0.05, 0.3)):
        rid = f"local-abort-{i}"
        prompt = [*history, *answer, *long_prompt_ids(20, start=150_000 + 100 * i)]
        body = {
            "input_ids": prompt,
            "rid": rid,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
        }
        with ThreadPoolExecutor(1) as pool:
            answer_future = pool.submit(
                requests.post, f"{decoder.url}/generate", json=body, timeout=300
            )
            time.sleep(delay_s)
            requests.post(f"{decoder.url}/abort_request", json={"rid": rid}, timeout=30)
            response = answer_future.result(timeout=300)
        assert response.status_code in (200, 400, 500), response.text[:300]
        if response.ok:
            finish = response.json()["meta_info"]["finish_reason"]["type"]
            assert finish in ("abort", "length"), response.text[:300]


@pytest.mark.parametrize("pause_after_s", [0.0, 0.5])
def test_a_retracting_pause_recomputes_local_requests_on_the_decoder(
    pause_after_s: float, mono: Server, two_prefills: DirectCluster
) -> None:
    """`pause_generation(retract)` frees every request's KV; a locally prefilled one has
    no prefill server to recompute it, so the decoder recomputes prompt and output itself
    (longer than one local step: chunked) and answers as if never interrupted - paused
    right after its local step or while it decodes."""
    decoder = two_prefills.decoders[0]
    history = long_prompt_ids(4 * BLOCK_TOKENS, start=170_000 + int(1000 * pause_after_s))
    answer = generate_ids(decoder.url, history, 4)
    prompt = [*history, *answer, *long_prompt_ids(20, start=180_000)]
    body = _kept_here(prompt, 20, 160)
    body["sampling_params"]["ignore_eos"] = True
    local_before = _metric(decoder, "sgl_pd_local_prefills_total", "cached_prefix")
    with ThreadPoolExecutor(1) as pool:
        answer_future = pool.submit(
            requests.post, f"{decoder.url}/generate", json=body, timeout=300
        )
        time.sleep(pause_after_s)
        requests.post(
            f"{decoder.url}/pause_generation", json={"mode": "retract"}, timeout=60
        ).raise_for_status()
        time.sleep(0.3)
        requests.post(f"{decoder.url}/continue_generation", json={}, timeout=60).raise_for_status()
        response = answer_future.result(timeout=300)
    assert _metric(decoder, "sgl_pd_local_prefills_total", "cached_prefix") == local_before + 1
    expected = requests.post(f"{mono.url}/generate", json=body, timeout=300).json()
    assert response.status_code == 200, response.text[:300]
    assert response.json()["output_ids"] == expected["output_ids"]


def test_every_page_is_free_again(two_prefills: DirectCluster, patience: Patience) -> None:
    """Runs last in this module: local, remote and aborted requests left nothing."""
    servers = {"prefill": two_prefills.prefill, "decode": two_prefills.decoders[0]}
    servers.update({f"prefill{i + 1}": s for i, s in enumerate(two_prefills.more_prefills)})
    states = wait_pools_idle(servers, patience.seconds(60))
    assert pools_idle(servers, states), f"pools still hold pages: {states}"


def test_no_server_warned_about_anything_its_settings_cause(two_prefills: DirectCluster) -> None:
    """Local prefill, aborts and pauses included, the servers' processes logged no warning
    but those SGLang logs on any healthy server (`cluster.logs.EXPECTED_WARNINGS`); in
    particular SGLang found no SGL_* variable of ours to rename."""
    servers = (two_prefills.prefill, *two_prefills.more_prefills, *two_prefills.decoders)
    for server in servers:
        assert unexpected_warnings(server) == [], server.process.name
        log = server.process.log_path.read_text(errors="replace")
        assert not re.search(r"SGL_PD_\w+ is deprecated|SGLPD_\w+ is deprecated", log)
