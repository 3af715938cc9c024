"""Direct mode (D3): one prefill server feeding two decoders, clients talking to the
decoders, which submit the prefills themselves. The same servers also sit behind SGLang's
router, whose flow keeps working. The prefill server's KV writes are slowed on purpose,
so a decoder that scheduled a request before its transfer was complete by counting would
decode from pages not yet written: every request must still give monolithic's tokens.
Both decoders keep a prefix cache: a client that sends a conversation's turns to one
decoder has its earlier turns held there, and the router's cache-aware decode policy
sends a conversation's next turn where its prefix lives."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_pd.cluster.campaign import first_success, kill_during_request, restarter
from sgl_pd.cluster.client import chat, generate_ids, send_as_router, stream_chat
from sgl_pd.cluster.conversations import replay, script, wrong_turns
from sgl_pd.cluster.local import DirectCluster, Server, direct_cluster
from sgl_pd.cluster.logs import last_pool_state, timing_lines
from sgl_pd.cluster.prompts import long_prompt_ids, prompt_ids, varied_prompts
from sgl_pd.cluster.streaming import metric_sums

from .conftest import CHUNKED_PREFILL_SIZE, COMMON_ARGS, DECODE_LOCAL_PREFILL

pytestmark = pytest.mark.e2e

WRITE_DELAY_MS = 25  # per KV write batch (a layer group): a long prompt streams for ~1 s
PROMPTS = varied_prompts(30)
MAX_NEW_TOKENS = 8


@pytest.fixture(scope="module")
def direct(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectCluster]:
    args = list(COMMON_ARGS)
    with direct_cluster(
        tmp_path_factory.mktemp("direct"),
        prefill_extra=[*args, "--pd-inject-write-delay-ms", str(WRITE_DELAY_MS)],
        decode_extra=[*args, *DECODE_LOCAL_PREFILL, "--enable-metrics"],
        decoders=2,
        with_router=True,
        decode_policy="cache_aware",
    ) as cluster:
        yield cluster


def _both(cluster: DirectCluster, prompts: list[str]) -> list[list[int]]:
    """Every prompt sent to a decoder, alternating, 16 at a time."""
    urls = [cluster.decoders[i % 2].url for i in range(len(prompts))]
    with ThreadPoolExecutor(max_workers=16) as pool:
        return list(
            pool.map(
                lambda a: generate_ids(a[0], a[1], MAX_NEW_TOKENS), zip(urls, prompts, strict=True)
            )
        )


def test_concurrent_requests_to_both_decoders_match_monolithic(
    mono: Server, direct: DirectCluster
) -> None:
    with ThreadPoolExecutor(max_workers=16) as pool:
        expected = list(pool.map(lambda p: generate_ids(mono.url, p, MAX_NEW_TOKENS), PROMPTS))
    got = _both(direct, PROMPTS)
    mismatches = [i for i, (e, g) in enumerate(zip(expected, got, strict=True)) if e != g]
    assert not mismatches, f"prompts {mismatches} differ from monolithic serving"


def test_a_slowed_transfer_is_waited_for(mono: Server, direct: DirectCluster) -> None:
    """A prompt of 8 chunks streams at least one delayed batch per chunk: its first token
    comes after them, and it is monolithic's."""
    ids = long_prompt_ids(8 * CHUNKED_PREFILL_SIZE, start=5)
    started = time.monotonic()
    got = generate_ids(direct.decoders[1].url, ids, 4)
    assert time.monotonic() - started > 8 * WRITE_DELAY_MS / 1e3
    assert got == generate_ids(mono.url, ids, 4)


def test_openai_chat_streams_from_a_decoder(mono: Server, direct: DirectCluster) -> None:
    streamed = stream_chat(direct.decoders[0].url, "What is 3 + 4?", max_tokens=24)
    assert streamed.text == chat(mono.url, "What is 3 + 4?", max_tokens=24)


def test_the_router_flow_works_on_the_same_servers(mono: Server, direct: DirectCluster) -> None:
    assert direct.router_url is not None
    for prompt in PROMPTS[:4]:
        assert generate_ids(direct.router_url, prompt, 6) == generate_ids(mono.url, prompt, 6)


SYSTEM_PROMPT = long_prompt_ids(150, start=777)  # shared by every conversation below
CONVERSATIONS, TURNS = 4, 3


def _openers(first: int) -> list[list[int]]:
    """Each conversation's first prompt: the system prompt, then a message of its own."""
    return [
        SYSTEM_PROMPT + long_prompt_ids(20 + 9 * i, start=first + 50 * i)[1:]
        for i in range(CONVERSATIONS)
    ]


def _held_since(direct: DirectCluster, before: int) -> list[int]:
    """Held tokens of the requests the prefill server finished since its line `before`."""
    return [int(line["held"]) for line in timing_lines(direct.prefill.process.log_path)[before:]]


def _turns_holding_their_conversation(held: list[int], system_tokens: int) -> int:
    """Requests that held more than the shared system prompt: an earlier turn of their
    own conversation was on that decoder."""
    return sum(h > system_tokens + 10 for h in held)


def test_a_client_keeps_its_conversation_on_one_decoder(
    mono: Server, direct: DirectCluster
) -> None:
    """Direct mode: each conversation's turns go to one decoder (the client's choice), so
    every turn after the first holds its conversation so far there: sent to the prefill
    server with that prefix held, or prefilled on the decoder itself (a short turn)."""
    conversations = script(mono.url, _openers(9000), turns=TURNS, max_new_tokens=6)
    before = len(timing_lines(direct.prefill.process.log_path))
    local_before = _local_prefills(direct)
    replies = [replay(direct.decoders[i % 2].url, [c])[0] for i, c in enumerate(conversations)]
    assert not wrong_turns(replies), replies
    local = _local_prefills(direct) - local_before
    deadline = time.monotonic() + 30  # (a prefill server logs a request after its answer)
    while len(held := _held_since(direct, before)) < CONVERSATIONS * TURNS - local:
        assert time.monotonic() < deadline, (held, local)
        time.sleep(0.2)
    holding = _turns_holding_their_conversation(held, len(SYSTEM_PROMPT))
    assert holding + local >= CONVERSATIONS * (TURNS - 1), (held, local)


def _local_prefills(direct: DirectCluster) -> int:
    name = "sgl_pd_local_prefills_total"
    return int(sum(metric_sums(d.url, [name])[name] for d in direct.decoders))


def test_the_cache_aware_router_keeps_turns_where_their_prefix_lives(
    mono: Server, direct: DirectCluster
) -> None:
    """Conversations sharing a system prompt through the router (cache-aware decode
    policy, which matches prompt texts) over two decoders, a round of turns at a time:
    every turn has monolithic's tokens, and every turn after the first round finds at
    least the system prompt held where it lands. Both decoders are sent the system
    prompt first: the router may put a whole round on one decoder and the next on the
    other (its choice, not ours); how many turns also find their own conversation there
    is the router's hit rate, which bench_multiturn measures."""
    assert direct.router_url is not None
    system = "Count: " + " ".join(str(i) for i in range(500, 560))
    system_tokens = len(prompt_ids(system))
    for decoder in direct.decoders:  # (direct mode: each decoder's cache holds it after)
        warm = {"text": f"{system} Warm.", "sampling_params": {"max_new_tokens": 1}}
        requests.post(f"{decoder.url}/generate", json=warm, timeout=120).raise_for_status()
    openers = [
        f"{system} Next {i}: " + " ".join(str(7 * i + j) for j in range(9))
        for i in range(CONVERSATIONS)
    ]
    conversations = script(mono.url, openers, turns=TURNS, max_new_tokens=6)
    held_by_round = []
    local_before = _local_prefills(direct)  # (short turns the decoder prefills itself)
    for turn in range(TURNS):
        before = len(timing_lines(direct.prefill.process.log_path))
        round_of = [[c[turn]] for c in conversations]
        replies = replay(direct.router_url, round_of, concurrency=CONVERSATIONS)
        assert not wrong_turns(replies), (turn, replies)
        held_by_round.append(_held_since(direct, before))
    later = [h for held in held_by_round[1:] for h in held]
    local = _local_prefills(direct) - local_before
    assert len(later) + local == CONVERSATIONS * (TURNS - 1), (held_by_round, local)
    assert all(h >= system_tokens - 1 for h in later), held_by_round


def _router_send(
    direct: DirectCluster, decoder: Server, text: str, *, prefill_late: bool = False
) -> tuple[requests.Response, requests.Response]:
    body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
    return send_as_router(
        direct.prefill.url, decoder.url, direct.bootstrap_port, body, prefill_late=prefill_late
    )


def test_router_follow_ups_are_prefilled_on_the_decoder_and_the_prefill_server_skips_them(
    mono: Server, direct: DirectCluster
) -> None:
    """Router flow (requests sent as SGLang's router sends them): a follow-up turn whose
    history the decoder holds is prefilled there; the prefill server, told to skip its
    copy, answers it with no token - also when its copy arrives after the decoder's
    answer - and keeps nothing of it (no transfer; no page: the last test). Tokens are
    monolithic's."""
    decoder = direct.decoders[0]
    prompt = "Count: " + " ".join(str(i) for i in range(260_000, 260_120))

    def mono_ids(text: str) -> list[int]:
        body = {"text": text, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
        return requests.post(f"{mono.url}/generate", json=body, timeout=120).json()["output_ids"]

    transfers_before = len(timing_lines(direct.prefill.process.log_path))
    prefilled, decoded = _router_send(direct, decoder, prompt)
    assert prefilled.ok and decoded.ok, (prefilled.text[:300], decoded.text[:300])
    assert decoded.json()["output_ids"] == mono_ids(prompt)
    local_before = _local_prefills(direct)
    for turn in range(3):
        prompt = f"{prompt}{decoded.json()['text']} Then {270 + turn}."
        prefilled, decoded = _router_send(direct, decoder, prompt, prefill_late=turn == 2)
        assert decoded.ok and decoded.json()["output_ids"] == mono_ids(prompt), turn
        assert prefilled.ok and prefilled.json()["meta_info"].get("pd_prefilled_by_decoder")
    assert _local_prefills(direct) - local_before == 3
    time.sleep(1)  # (a prefill server logs a transfer after its answer: none may come)
    assert len(timing_lines(direct.prefill.process.log_path)) == transfers_before + 1


def test_a_batch_is_refused_with_the_reason(direct: DirectCluster) -> None:
    body = {"text": ["Count: 1", "Count: 2"], "sampling_params": {"max_new_tokens": 2}}
    response = requests.post(f"{direct.decoders[0].url}/generate", json=body, timeout=60)
    assert response.status_code == 400 and "one prompt per request" in response.text


def _pools_idle(servers: list[Server], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    states: dict[str, tuple[int, bool] | None] = {}
    while time.monotonic() < deadline:
        states = {s.process.name: last_pool_state(s.process.log_path) for s in servers}
        if all(state == (0, True) for state in states.values()):
            return
        time.sleep(1)
    pytest.fail(f"pools still hold pages after the requests finished: {states}")


def test_a_killed_prefiller_fails_its_requests_then_is_picked_up_again(
    mono: Server, direct: DirectCluster
) -> None:
    """Runs late: the prefill server dies mid-transfer. The request in flight ends with an
    error within seconds (its connections are refused); new ones are refused at once,
    naming the server; once it is back the decoders, never restarted, use it again."""
    decoder = direct.decoders[0]
    victim = direct.prefill
    restart = restarter(victim.process, f"{victim.url}/health", decoder.url, 300, 180)

    killed = kill_during_request(
        decoder.url, victim.process,
        lambda n: long_prompt_ids(8 * CHUNKED_PREFILL_SIZE, start=11 + 9000 * n), "direct-k1",
        restart, waits_s=(0.5, 0.25, 0.1),
    )  # fmt: skip
    assert killed.kill_to_answer_s < 30, killed
    if killed.response is not None:
        response = killed.response
        finish = response.json()["meta_info"]["finish_reason"]["type"] if response.ok else None
        assert not response.ok or finish == "abort", response.text[:300]
    time.sleep(4.5)  # the decoders' probes see the registry gone
    started = time.monotonic()
    response = requests.post(
        f"{decoder.url}/generate",
        json={"input_ids": long_prompt_ids(64, start=5), "sampling_params": {"max_new_tokens": 2}},
        timeout=60,
    )
    assert response.status_code == 400 and "no prefill server took the request" in response.text
    assert time.monotonic() - started < 10
    # a prompt short enough for the decoder to prefill itself is served meanwhile
    assert generate_ids(decoder.url, "Count: 1 2", 3) == generate_ids(mono.url, "Count: 1 2", 3)
    direct.prefill.process.restart("restarted")
    direct.prefill.process.wait_http_ready(f"{direct.prefill.url}/health", 300)
    expected = generate_ids(mono.url, "Count: 7 8 9", 6)
    for d in direct.decoders:
        assert first_success(d.url, "Count: 7 8 9", 6, budget_s=120) == expected


def test_every_page_is_free_again(direct: DirectCluster) -> None:
    """Runs last: prefill server and both decoders report 0 used tokens."""
    for d in direct.decoders:
        generate_ids(d.url, "Count: 1 2", 1)  # a batch on each makes a fresh pool line
    _pools_idle([direct.prefill, *direct.decoders])
