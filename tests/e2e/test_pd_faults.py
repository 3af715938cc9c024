"""Faults against a real PD pair (SGLang on CPU, Mooncake TCP, SGLang's router): the
prefiller's KV writes are slowed on purpose (and a few fail), so requests can be aborted
mid-transfer, and 5% of control frames are dropped both ways (each is sent again until
acknowledged). Whatever ends early, no page is written after it went back to the pool:
every request that completes has the monolithic tokens, and both pools end empty. A
server stopped (SIGSTOP) for less than the hang timeout fails nothing; one stopped past
it fails what it was part of and serves again once it runs; a killed one fails its
requests at once, because its connections are refused.

The decoder keeps a prefix cache in a small pool, so cached prefixes are evicted all
the time while transfers run; a request that holds a prefix may be aborted like any
other, and the held pages it locked go back to the cache, unwritten.

The tests share one cluster and run in file order; the last ones kill and restart each
server, so they come last.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests

from sgl_pd.cluster.campaign import (
    abort_at_decoder,
    expected_tokens,
    first_success,
    kill_during_request,
    kill_mid_transfer,
    periodic_pauses,
    post_generate,
    restarter,
    run_campaign,
)
from sgl_pd.cluster.client import generate_ids
from sgl_pd.cluster.local import PdCluster, Server, pd_cluster
from sgl_pd.cluster.logs import decode_failures, last_pool_state, timing_lines
from sgl_pd.cluster.prompts import long_prompt_ids, prompt_ids, varied_prompts

from .conftest import COMMON_ARGS, DECODE_PREFIX_CACHE

pytestmark = pytest.mark.e2e

WRITE_DELAY_MS = 20  # per KV write batch: a 1024-token prompt streams for over a second
FAILURE_RATE = 0.004  # of write batches: a few campaign requests fail on their own
DECODE_POOL_TOKENS = 1536  # small: an aborted long prompt's pages are reused at once
LONG = 1024
PROMPTS_IN_CAMPAIGN = 100
HANG_S = 16  # --pd-hang-timeout on both sides
# a pause under it, past ZMQ's heartbeat (10 s: a connection silent that long is dropped
# with what it queued): nothing may fail, every control message is sent again
PAUSE_S = 12
CONTROL_DROP_RATE = 0.05  # of control frames, both ways: resent until acknowledged
SHARED_PREFIX_ROUNDS = 12  # 96 requests: 5 to 6 of them were wrong before pages were pinned
LIVENESS_LINES = ("hung:", "is gone:", "did not run for")  # what a liveness failure logs


@pytest.fixture(scope="module")
def faulty(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PdCluster]:
    # metrics on: the failure counters are checked per injected cause
    args = [
        *COMMON_ARGS,
        "--pd-hang-timeout", str(HANG_S),
        "--enable-metrics",
        "--pd-inject-control-drop-rate", str(CONTROL_DROP_RATE),
    ]  # fmt: skip
    with pd_cluster(
        tmp_path_factory.mktemp("pd-faults"),
        prefill_extra=[
            *args,
            "--pd-inject-write-delay-ms", str(WRITE_DELAY_MS),
            "--pd-inject-write-failure-rate", str(FAILURE_RATE),
        ],
        decode_extra=[*args, *DECODE_PREFIX_CACHE, "--max-total-tokens", str(DECODE_POOL_TOKENS)],
        router_retries=False,
    ) as cluster:  # fmt: skip
        yield cluster


def _finish(response: requests.Response) -> str:
    return str(response.json()["meta_info"]["finish_reason"]["type"])


def _until_ok(url: str, ids: list[int], tag: str, attempts: int = 4) -> list[int]:
    """A request that may meet an injected failure: its first answer with tokens."""
    for i in range(attempts):
        response = post_generate(url, ids, f"{tag}-{i}", 4)
        if response.status_code == 200 and _finish(response) != "abort":
            return [int(t) for t in response.json()["output_ids"]]
    raise AssertionError(f"{attempts} attempts of {tag} failed")


def _pools_idle(cluster: PdCluster, timeout_s: float = 60.0) -> None:
    """Both servers report an idle pool with nothing used and no leak."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = [last_pool_state(s.process.log_path) for s in (cluster.prefill, cluster.decode)]
        if all(s is not None and s[0] == 0 and s[1] for s in states):
            return
        assert time.monotonic() < deadline, f"pools not back to idle: {states}"
        generate_ids(cluster.router_url, "Count: 1 2", 1)  # a batch makes the next idle line
        time.sleep(1.0)


def test_abort_mid_transfer_then_reuse_the_pages(mono: Server, faulty: PdCluster) -> None:
    """A long prompt aborted while its layers stream; the next long prompt can only get
    pages the aborted one held. Its tokens must be the monolithic ones."""
    first, second = long_prompt_ids(LONG, start=1), long_prompt_ids(LONG, start=5000)
    expected = generate_ids(mono.url, second, 4)
    answer: list[requests.Response] = []
    sender = threading.Thread(
        target=lambda: answer.append(post_generate(faulty.router_url, first, "a1", 4))
    )
    sender.start()
    time.sleep(1.0)  # the prefill forward is done in well under this; the writes are not
    abort_at_decoder(faulty.decode.url, "a1")
    sender.join(60)
    assert answer and (answer[0].status_code != 200 or _finish(answer[0]) == "abort"), (
        "the aborted request came back as if complete"
    )
    assert _until_ok(faulty.router_url, second, "a2") == expected
    _pools_idle(faulty)


def test_abort_of_a_request_holding_a_prefix_then_the_prefix_is_reused(
    mono: Server, faulty: PdCluster
) -> None:
    """A request whose first 200 tokens the decoder holds is aborted while the rest
    streams; its lock on the held prefix goes with it, the prefix stays cached and
    unwritten, and the same request again - holding the prefix once more - has
    monolithic's tokens. (Prompt and answer fit the small pool with SGLang's decode
    reserve; a larger one would wait for pages forever, as it would without PD.)"""
    prefix = long_prompt_ids(200, start=20000)
    assert _until_ok(faulty.router_url, prefix, "held-0") == generate_ids(mono.url, prefix, 4)
    aborted = False
    for attempt, wait_s in enumerate((1.0, 0.6, 0.3)):
        whole = prefix + long_prompt_ids(800, start=30000 + 1000 * attempt)[1:]
        rid = f"held-a{attempt}"
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(post_generate, faulty.router_url, whole, rid, 4)
            time.sleep(wait_s)  # mid-transfer: the writes are slowed, the forward is not
            abort_at_decoder(faulty.decode.url, rid)
            answer = pending.result(timeout=120)
        aborted = "aborted" in decode_failures([faulty.decode.process.log_path]).get(rid, "")
        if aborted:
            assert answer.status_code != 200 or _finish(answer) == "abort", answer.text
            break
    assert aborted, "every request completed before its abort arrived"
    expected = generate_ids(mono.url, whole, 4)
    assert _until_ok(faulty.router_url, whole, "held-b") == expected
    held = timing_lines(faulty.prefill.process.log_path)[-1]["held"]
    assert held >= 199, held
    _pools_idle(faulty)


def test_campaign_with_aborts_and_failures(mono: Server, faulty: PdCluster) -> None:
    """About 100 requests at concurrency 16, 10% aborted at the decoder mid-flight and a
    few failing on injected write errors: nothing else is lost or wrong."""
    prompts = [prompt_ids(p) for p in varied_prompts(PROMPTS_IN_CAMPAIGN, seed=23)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        expected = list(pool.map(lambda p: expected_tokens(mono.url, p, 6), prompts))
    result = run_campaign(
        faulty.router_url,
        faulty.decode.url,
        prompts,
        expected,
        max_new_tokens=6,
        abort_fraction=0.1,
        concurrency=16,
        seed=5,
    )
    assert not result.wrong(), "\n".join(map(str, result.wrong()))
    assert result.count("lost") == 0
    assert result.count("ok") + result.count("near_tie") >= PROMPTS_IN_CAMPAIGN * 0.6
    assert result.aborts_sent >= 5
    _pools_idle(faulty)


def test_dropped_control_frames_were_resent_and_none_given_up(faulty: PdCluster) -> None:
    """The campaign ran with control frames dropped on both sides: they were sent again
    (nothing above failed for it), and no message was given up on a live peer."""
    from .metrics_reading import sample

    for server, role in ((faulty.prefill, "prefill"), (faulty.decode, "decode")):

        def control(event: str, server: Server = server, role: str = role) -> float:
            return sample(server.url, "sgl_pd_control_messages_total", role=role, event=event)

        deadline = time.monotonic() + 10  # the counters follow the liveness tick
        while control("injected_drop") == 0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert control("injected_drop") > 0 and control("resent") > 0, role
        assert control("given_up") == 0, role


def test_concurrent_requests_on_a_new_shared_prefix_get_monolithic_tokens(
    mono: Server, faulty: PdCluster
) -> None:
    """Rounds of 8 concurrent requests that share a prefix no request had before (300 to
    900 tokens), each with its own suffix, while the prefiller's writes lag: the radix
    cache frees each duplicate copy of the prefix after the forward and the next
    forward reuses those pages, so a write that still named them would ship another
    request's KV. Every answer has monolithic's tokens (on a cluster that served the
    campaign first, as the defect needed)."""
    rounds = []
    for r in range(SHARED_PREFIX_ROUNDS):
        prefix = long_prompt_ids(300 + (r * 211) % 600, start=20_000 + 1000 * r)
        rounds.append([prefix + prompt_ids(f" then {s} and {s + r}")[1:] for s in range(8)])
    prompts = [p for batch in rounds for p in batch]
    with ThreadPoolExecutor(max_workers=8) as pool:
        expected = list(pool.map(lambda p: expected_tokens(mono.url, p, 4), prompts))
    answers: list[requests.Response] = []
    for r, batch in enumerate(rounds):
        rids = [f"shared-{r}-{i}" for i in range(len(batch))]
        with ThreadPoolExecutor(max_workers=8) as pool:
            answers += pool.map(
                lambda p, rid: post_generate(faulty.router_url, p, rid, 4), batch, rids
            )
    causes = decode_failures([faulty.decode.process.log_path])
    wrong = []
    for i, (response, want) in enumerate(zip(answers, expected, strict=True)):
        if response.status_code != 200 or _finish(response) == "abort":
            rid = f"shared-{i // 8}-{i % 8}"
            assert "injected failure" in causes.get(rid, ""), f"{rid} failed: {response.text}"
            continue
        got = [int(t) for t in response.json()["output_ids"]]
        if want.judge(got) == "wrong_tokens":
            wrong.append((i, got, want.tokens))
    assert not wrong, f"{len(wrong)} of {len(prompts)} answers wrong: {wrong[:3]}"
    _pools_idle(faulty)


def _injected(cluster: PdCluster, rid: str) -> bool:
    """The request ended on an injected write failure (not a fault a test caused)."""
    return "injected failure" in decode_failures([cluster.decode.process.log_path]).get(rid, "")


def _log_tail(server: Server, since: int) -> str:
    return server.process.log_path.read_bytes()[since:].decode(errors="replace")


def _log_size(server: Server) -> int:
    return server.process.log_path.stat().st_size


def test_each_injected_failure_counts_once_under_its_cause(mono: Server, faulty: PdCluster) -> None:
    """An abort at the decoder counts one `abort` there and nothing on the prefill side;
    every request the injected write failures failed counts one `write_failure` on the
    prefill side (the rooms its log names)."""
    import re

    from .metrics_reading import sample

    def failures(server: Server, role: str, cause: str) -> float:
        return sample(server.url, "sgl_pd_transfer_failures_total", role=role, cause=cause)

    for attempt in range(3):  # an injected write failure may end it before the abort
        aborts = failures(faulty.decode, "decode", "abort")
        prefill_aborts = failures(faulty.prefill, "prefill", "abort")
        rid = f"m1-{attempt}"
        answer: list[requests.Response] = []
        ids = long_prompt_ids(LONG, start=9000 + 1000 * attempt)
        sender = threading.Thread(
            target=lambda a=answer, i=ids, r=rid: a.append(
                post_generate(faulty.router_url, i, r, 4)
            )
        )
        sender.start()
        time.sleep(1.0)  # the writes stream for over a second: the abort lands mid-transfer
        abort_at_decoder(faulty.decode.url, rid)
        sender.join(60)
        time.sleep(1.0)
        cause = decode_failures([faulty.decode.process.log_path]).get(rid, "")
        if "injected failure" not in cause:
            break
    assert failures(faulty.decode, "decode", "abort") == aborts + 1
    assert failures(faulty.prefill, "prefill", "abort") == prefill_aborts

    since = _log_size(faulty.prefill)
    written = failures(faulty.prefill, "prefill", "write_failure")
    prompts = [prompt_ids(p) for p in varied_prompts(60, seed=41)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(lambda p: post_generate(faulty.router_url, p[1], f"w{p[0]}", 2),
                      enumerate(prompts)))  # fmt: skip
    time.sleep(1.0)
    injected = set(
        re.findall(r"request (\d+): .*injected failure", _log_tail(faulty.prefill, since))
    )
    assert failures(faulty.prefill, "prefill", "write_failure") - written == len(injected)
    _pools_idle(faulty)


@pytest.mark.parametrize("victim", ["prefill", "decode"])
def test_a_server_paused_shorter_than_the_hang_timeout_fails_nothing(
    mono: Server, faulty: PdCluster, victim: str
) -> None:
    """Requests in flight (long prompts streaming, short ones queued) while one server is
    stopped for 5 s: all complete with the monolithic tokens, except any an injected write
    failure ended, and neither side logs a liveness failure."""
    server = faulty.prefill if victim == "prefill" else faulty.decode
    prompts = [long_prompt_ids(LONG, start=300 + 7 * i) for i in range(2)]
    prompts += [prompt_ids(p) for p in varied_prompts(6, seed=41)]
    with ThreadPoolExecutor(max_workers=8) as pool:
        expected = list(pool.map(lambda p: expected_tokens(mono.url, p, 4), prompts))
    marks = {s.url: _log_size(s) for s in (faulty.prefill, faulty.decode)}
    rids = [f"pause-{victim}-{i}" for i in range(len(prompts))]
    with ThreadPoolExecutor(max_workers=len(prompts)) as pool:
        with periodic_pauses([server.process], every_s=1.0, pause_s=PAUSE_S) as paused:
            futures = [
                pool.submit(post_generate, faulty.router_url, p, rid, 4)
                for p, rid in zip(prompts, rids, strict=True)
            ]
            while not paused:
                time.sleep(0.1)
        responses = [f.result() for f in futures]
    causes = decode_failures([faulty.decode.process.log_path])
    for rid, response, want in zip(rids, responses, expected, strict=True):
        if response.status_code == 200 and _finish(response) != "abort":
            got = [int(t) for t in response.json()["output_ids"]]
            assert want.judge(got) != "wrong_tokens", f"{rid}: {got} vs {want}"
        else:
            assert "injected failure" in causes.get(rid, ""), f"{rid} failed: {response.text}"
    for s in (faulty.prefill, faulty.decode):
        tail = _log_tail(s, marks[s.url])
        assert not [w for w in LIVENESS_LINES if w in tail], f"{s.url} failed a request"
    _pools_idle(faulty)


def test_a_prefiller_paused_past_the_hang_timeout_fails_its_request_then_serves(
    mono: Server, faulty: PdCluster
) -> None:
    """SIGSTOP the prefill server mid-transfer for longer than the hang timeout: the
    decoder fails the request as hung (the process still accepts connections), the
    prefiller, once it runs again, fails what it held and writes nothing more for it,
    both pools go back to idle, and the next request is served."""
    for attempt in range(3):  # an injected write failure may end it before the pause
        ids = long_prompt_ids(LONG, start=91 + 1000 * attempt)
        rid = f"hang-{attempt}"
        marks = {s.url: _log_size(s) for s in (faulty.prefill, faulty.decode)}
        answer: list[requests.Response] = []
        sender = threading.Thread(
            target=lambda a=answer, i=ids, r=rid: a.append(
                post_generate(faulty.router_url, i, r, 4)
            )
        )
        with periodic_pauses([faulty.prefill.process], every_s=1.0, pause_s=HANG_S + 4) as paused:
            sender.start()
            while not paused:  # one pause, then the block ends
                time.sleep(0.2)
        sender.join(120)
        assert answer and (answer[0].status_code != 200 or _finish(answer[0]) == "abort")
        cause = decode_failures([faulty.decode.process.log_path]).get(rid, "")
        if "injected failure" not in cause:
            break
    assert "hung:" in _log_tail(faulty.decode, marks[faulty.decode.url])
    deadline = time.monotonic() + 30
    while "did not run for" not in _log_tail(faulty.prefill, marks[faulty.prefill.url]):
        assert time.monotonic() < deadline, "the prefiller did not notice it was stopped"
        time.sleep(0.5)
    _pools_idle(faulty)
    expected = generate_ids(mono.url, "Count: 4 5 6", 6)
    assert first_success(faulty.router_url, "Count: 4 5 6", 6, budget_s=120) == expected


def _restart_and_serve(mono: Server, cluster: PdCluster, victim: Server) -> None:
    """Restart `victim` in place; the other side, untouched, serves new requests again."""
    victim.process.restart("restarted")
    victim.process.wait_http_ready(f"{victim.url}/health", 300)
    expected = generate_ids(mono.url, "Count: 7 8 9", 6)
    assert first_success(cluster.router_url, "Count: 7 8 9", 6, budget_s=180) == expected
    _pools_idle(cluster)


def test_killed_prefiller_fails_its_requests_with_a_clear_error(
    mono: Server, faulty: PdCluster
) -> None:
    victim = faulty.prefill
    restart = restarter(victim.process, f"{victim.url}/health", faulty.router_url, 300, 180)

    response = kill_during_request(
        faulty.router_url, victim.process, lambda n: long_prompt_ids(LONG, start=77 + 3000 * n),
        "k1", restart, ended_early=lambda rid: _injected(faulty, rid),
    ).response  # fmt: skip
    if response is not None:  # the router may also just drop the connection
        assert response.status_code != 200 or _finish(response) == "abort"
    decode_log = faulty.decode.process.log_path.read_text(errors="replace")
    # the fast path: its connections were refused, not a wait for the hang timeout
    assert "connections are refused" in decode_log
    _restart_and_serve(mono, faulty, faulty.prefill)


def test_killed_decoder_stops_the_prefillers_writes(mono: Server, faulty: PdCluster) -> None:
    kill_mid_transfer(faulty.router_url, faulty.decode.process, long_prompt_ids(LONG), "k2")
    # the prefiller frees the request's pages once it declared the decoder lost
    deadline = time.monotonic() + 60
    while (state := last_pool_state(faulty.prefill.process.log_path)) is None or state[0]:
        assert time.monotonic() < deadline, f"prefill pages still held: {state}"
        time.sleep(0.5)
    # it stopped because heartbeats went unanswered or a write to the dead peer failed
    failed = [
        line
        for line in faulty.prefill.process.log_path.read_text(errors="replace").splitlines()
        if "rid='k2'" in line and "failed" in line
    ]
    assert failed, "the prefiller did not fail the request of the killed decoder"
    _restart_and_serve(mono, faulty, faulty.decode)
