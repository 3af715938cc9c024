"""Local prefill under a production decoder's load: follow-up turns placed on the decoder
while 0 to 300 streams run on it are answered with monolithic's tokens - prefilled
there within a few steps, or sent to the prefill server when that is sooner or no step
admits them - in both flows; a chunked local request goes on while the streams outgrow
its step budget (the negative chunk that crashed a decoder at 512 concurrent requests);
nothing is held afterwards.

Two decoders on one prefill server (direct mode, requests sent as the router sends them
for the router flow):
- decoder 0: the defaults (ITL SLO on, at most 128 local tokens a step), room for 340
  running requests;
- decoder 1: 16 local tokens a step without an SLO (every step carries 16, mixed into
  the streams' decode where SGLang can mix), and room for `SMALL_RUNNING` running
  requests, so that streams can fill every request slot.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import pytest
import requests

from sgl_pd.backend.metrics import SENT_OUT_REASONS
from sgl_pd.cluster.client import generate_ids, send_as_router
from sgl_pd.cluster.local import DirectCluster, Patience, Server, direct_cluster
from sgl_pd.cluster.logs import pools_idle, unexpected_warnings, wait_pools_idle
from sgl_pd.cluster.prompts import long_prompt_ids
from sgl_pd.cluster.streaming import metric_sums

from .conftest import COMMON_ARGS, DECODE_LOCAL_PREFILL

pytestmark = pytest.mark.e2e

SMALL_RUNNING = 40  # decoder 1's --max-running-requests
STREAM_PROMPT_TOKENS = 40
ANSWER_TOKENS = 4
LOCAL = "sgl_pd_local_prefills_total"
SENT_OUT = "sgl_pd_local_prefills_sent_out_total"
LOCAL_STEPS = "sgl_pd_local_prefill_steps_total"  # mixed or unmixed
RUNNING = "sglang:num_running_reqs"
STREAM_CAP_TOKENS = 1024  # a stream's answer at most (streams run until a test ends them)


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DirectCluster]:
    with direct_cluster(
        tmp_path_factory.mktemp("local-load"),
        prefill_extra=COMMON_ARGS,
        decode_extra=[
            *COMMON_ARGS, *DECODE_LOCAL_PREFILL, "--enable-metrics",
            "--pd-local-prefill-max-tokens", "128",
            # the streams' fresh prompts go to the prefill server however many wait there
            "--pd-prefill-saturated-tokens", "10000000",
        ],
        decoder_extras=[
            # a pool that holds 340 requests with SGLang's decode reservation for each
            ["--max-running-requests", "340", "--max-total-tokens", "262144",
             "--num-reserved-decode-tokens", "256"],
            [
                "--max-running-requests", str(SMALL_RUNNING),
                "--pd-local-prefill-step-tokens", "16", "--pd-local-prefill-itl-slo", "0",
            ],
        ],
        decoders=2,
    ) as cluster:  # fmt: skip
        yield cluster


@contextmanager
def _streams(
    decoder: Server,
    count: int,
    patience: Patience,
    *,
    seed: int,
    start: Callable[[], None] | None = None,
) -> Iterator[list[list[int]]]:
    """`count` streamed requests decoding on `decoder`, all running before the body runs
    and each running until the body is over: then its connection is closed, which SGLang
    answers by aborting it (none reaches STREAM_CAP_TOKENS first unless the body outlasts
    that many steps). Yields, once the body is over, each stream's tokens by then - after
    the decoder runs as many requests as before. `start`: called once the streams are
    sent, before they run."""
    tokens: list[list[int]] = []
    if count == 0:
        yield tokens
        return
    before = _metric(decoder, RUNNING)
    over = threading.Event()

    def one(i: int) -> list[int]:
        body = {
            "input_ids": _stream_prompt(seed, i),
            "sampling_params": {
                "temperature": 0, "max_new_tokens": STREAM_CAP_TOKENS, "ignore_eos": True,
            },
            "stream": True,
        }  # fmt: skip
        last = b""
        with requests.post(
            f"{decoder.url}/generate", json=body, stream=True, timeout=patience.seconds(900)
        ) as response:
            response.raise_for_status()
            for line in response.iter_lines():  # a chunk a step: the latest holds all
                if line.startswith(b"data:") and line.strip() != b"data: [DONE]":
                    last = line
                if over.is_set():
                    break  # (leaving the block closes the connection)
        return [int(t) for t in json.loads(last[len(b"data:") :])["output_ids"]] if last else []

    with ThreadPoolExecutor(count) as pool:
        futures = [pool.submit(one, i) for i in range(count)]
        if start is not None:
            start()
        deadline = time.monotonic() + patience.seconds(300)
        try:
            while _metric(decoder, RUNNING) < before + count:
                assert time.monotonic() < deadline, f"{count} streams were not all running"
                assert not any(f.done() for f in futures), "a stream ended before all ran"
                time.sleep(0.2)
            yield tokens
        finally:
            over.set()
        tokens.extend(f.result() for f in futures)
    deadline = time.monotonic() + patience.seconds(120)
    while _metric(decoder, RUNNING) > before:
        assert time.monotonic() < deadline, "the closed streams still run on the decoder"
        time.sleep(0.2)


def _stream_prompt(seed: int, i: int) -> list[int]:
    return long_prompt_ids(STREAM_PROMPT_TOKENS, start=seed + 97 * i)


STREAM_CHECKED_TOKENS = 96  # of a stream's tokens, compared with monolithic's


def _check_streams(mono: Server, streams: list[list[int]], seed: int) -> None:
    """A sample of the streams decoded monolithic's tokens (EOS ignored, as they ask) as
    far as each went, up to STREAM_CHECKED_TOKENS: the longer the answer, the likelier
    a near tie between two greedy runs."""
    for i in range(0, len(streams), max(1, len(streams) // 4)):
        got = streams[i][:STREAM_CHECKED_TOKENS]
        assert got, f"stream {i} gave no token"
        body = {
            "input_ids": _stream_prompt(seed, i),
            "sampling_params": {"temperature": 0, "max_new_tokens": len(got), "ignore_eos": True},
        }
        expected = requests.post(f"{mono.url}/generate", json=body, timeout=300).json()
        assert got == expected["output_ids"], f"stream {i}"


def _metric(server: Server, name: str, **labels: str) -> float:
    if not labels:
        return metric_sums(server.url, [name])[name]
    text = requests.get(f"{server.url}/metrics", timeout=30).text
    wanted = ",".join(f'{k}="{v}"' for k, v in labels.items())
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and wanted in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _placements(decoder: Server) -> float:
    """Requests the decoder's HTTP process handed to a prefill server (direct mode)."""
    return sum(
        _metric(decoder, "sgl_pd_prefill_placements_total", reason=r)
        for r in ("cached_prefix", "load")
    )


def _sent_out(decoder: Server) -> dict[str, float]:
    """The decoder's local requests sent to a prefill server so far, by reason."""
    return {why: _metric(decoder, SENT_OUT, why=why) for why in SENT_OUT_REASONS}


def _history(decoder: Server, start: int) -> tuple[list[int], list[int]]:
    """A conversation's first turn (prefilled remotely): its prompt and answer."""
    prompt = long_prompt_ids(4 * 64, start=start)
    return prompt, generate_ids(decoder.url, prompt, ANSWER_TOKENS)


@pytest.mark.parametrize(
    ("decoder_index", "streams"), [(0, 0), (0, 16), (0, 64), (0, 300), (1, 16), (1, 30)]
)
def test_follow_ups_are_answered_whatever_runs_on_the_decoder(
    decoder_index: int, streams: int, mono: Server, loaded: DirectCluster, patience: Patience
) -> None:
    """Each follow-up is prefilled here or sent out - never left waiting - with
    monolithic's tokens; so are the streams."""
    decoder = loaded.decoders[decoder_index]
    seed = 1_000_000 + 10_000 * streams + 500_000 * decoder_index
    prompt, answer = _history(decoder, seed)
    placed_before = _metric(decoder, LOCAL)
    sent_before = _metric(decoder, SENT_OUT)
    steps_before = _metric(decoder, LOCAL_STEPS)
    mixed_before = _metric(decoder, LOCAL_STEPS, kind="mixed")
    follow_ups = []
    with _streams(decoder, streams, patience, seed=seed + 5000) as answers:
        for turn in range(2):
            prompt = [*prompt, *answer, *long_prompt_ids(24, start=seed + 100 * turn + 50)]
            answer = generate_ids(decoder.url, prompt, ANSWER_TOKENS)
            follow_ups.append((list(prompt), answer))
    placed = _metric(decoder, LOCAL) - placed_before
    sent_out = _metric(decoder, SENT_OUT) - sent_before
    assert placed == 2, "the follow-ups were not placed on the decoder"
    assert 0 <= sent_out <= placed
    if sent_out < placed:  # prefilled here: in local steps, mixed with the streams or not
        assert _metric(decoder, LOCAL_STEPS) > steps_before
        if decoder_index == 1 and streams:  # (no SLO: each step mixes where SGLang can)
            assert _metric(decoder, LOCAL_STEPS, kind="mixed") > mixed_before
    for asked, got in follow_ups:
        assert got == generate_ids(mono.url, asked, ANSWER_TOKENS)
    assert len(answers) == streams
    _check_streams(mono, answers, seed + 5000)


def test_a_chunked_local_request_goes_on_while_the_streams_outgrow_its_budget(
    mono: Server, loaded: DirectCluster, patience: Patience
) -> None:
    """A 120-token suffix at 16 tokens a step takes 8 local steps; meanwhile 30 streams
    join the running batch (more than the step's 16 tokens: SGLang's adder took one
    token per stream from the step's budget, which starved the step and then chunked
    the request by a negative length). The request asks for its new tokens' logprobs,
    which only a prefill of them gives: it stays here whatever the streams do. (From
    further back SGLang would recompute more than the decoder prefills itself: a
    prefill server's, `core.placement.PromptKey.reusable`.)"""
    decoder = loaded.decoders[1]
    prompt, answer = _history(decoder, 3_000_000)
    prompt = [*prompt, *answer, *long_prompt_ids(120, start=3_100_000)]
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": 32},
        "return_logprob": True,
        "logprob_start_len": len(prompt) - 120,
    }
    placed_before = _metric(decoder, LOCAL)
    sent_before = _metric(decoder, SENT_OUT)
    got: list[requests.Response] = []

    def follow_up() -> None:
        got.append(
            requests.post(f"{decoder.url}/generate", json=body, timeout=patience.seconds(600))
        )

    thread = threading.Thread(target=follow_up, daemon=True)
    with _streams(decoder, 30, patience, seed=3_200_000, start=thread.start) as answers:
        thread.join(timeout=patience.seconds(600))
    assert not thread.is_alive() and got, "the chunked local request was not answered"
    assert got[0].status_code == 200, got[0].text[:300]
    assert _metric(decoder, LOCAL) - placed_before == 1
    assert _metric(decoder, SENT_OUT) == sent_before, "it was sent out, not chunked here"
    expected = requests.post(f"{mono.url}/generate", json=body, timeout=300).json()
    assert got[0].json()["output_ids"] == expected["output_ids"]
    _check_streams(mono, answers, 3_200_000)


@pytest.mark.parametrize("flow", ["direct", "router"])
def test_a_local_request_the_decoder_has_no_room_for_goes_to_the_prefill_server(
    flow: str, mono: Server, loaded: DirectCluster, patience: Patience
) -> None:
    """Every request slot of decoder 1 is taken by streams: no local step can admit the
    follow-up, which goes to the prefill server at once - transferred requests take
    each slot that frees first - and is answered there once a slot frees (the router
    flow's prefill server, never told to skip its copy, prefills it). It may go out
    sooner still, on arrival, where the remote first token is predicted sooner (`slower`)
    or, in direct mode, from the HTTP process (the scheduler's latest offer, every slot
    taken); never after waiting for admission (`unadmitted`)."""
    decoder = loaded.decoders[1]
    seed = 4_000_000 + (0 if flow == "direct" else 100_000)
    prompt, answer = _history(decoder, seed)
    prompt = [*prompt, *answer, *long_prompt_ids(24, start=seed + 50)]
    sent_before = _sent_out(decoder)
    body = {
        "input_ids": prompt,
        "sampling_params": {"temperature": 0, "max_new_tokens": ANSWER_TOKENS},
    }
    local_before = _metric(decoder, LOCAL)
    answered: list[requests.Response] = []  # the decoder's answer (and the prefill server's)

    def follow_up() -> None:
        if flow == "direct":
            answered.append(
                requests.post(f"{decoder.url}/generate", json=body, timeout=patience.seconds(600))
            )
            return
        prefilled, decoded = send_as_router(
            loaded.prefill.url,
            decoder.url,
            loaded.bootstrap_port,
            body,
            timeout_s=patience.seconds(600),
        )
        answered.extend((decoded, prefilled))

    def went_out() -> float:  # (placements: direct mode only)
        sent = sum(n - sent_before[why] for why, n in _sent_out(decoder).items())
        return sent + _placements(decoder) - placed_before

    thread = threading.Thread(target=follow_up, daemon=True)
    with _streams(decoder, SMALL_RUNNING, patience, seed=seed + 5000) as answers:
        placed_before = _placements(decoder)  # (once the streams were placed)
        thread.start()
        deadline = time.monotonic() + patience.seconds(300)
        # its fate is decided while every slot is taken; it is answered once they free
        while went_out() < 1 and thread.is_alive():
            assert time.monotonic() < deadline, "the follow-up was neither sent out nor answered"
            time.sleep(0.2)
    thread.join(timeout=patience.seconds(600))
    assert not thread.is_alive() and answered, "the follow-up was not answered"
    response = answered[0]
    if flow == "router":
        prefilled = answered[1]
        assert prefilled.ok, prefilled.text[:300]
        assert not prefilled.json()["meta_info"].get("pd_prefilled_by_decoder")
    assert response.ok, response.text[:300]
    sent = {why: n - sent_before[why] for why, n in _sent_out(decoder).items()}
    local = _metric(decoder, LOCAL) - local_before
    assert went_out() == 1 and sent["unadmitted"] == 0, (sent, went_out(), local)
    assert response.json()["output_ids"] == generate_ids(mono.url, prompt, ANSWER_TOKENS)
    _check_streams(mono, answers, seed + 5000)


def test_every_page_is_free_again(loaded: DirectCluster, patience: Patience) -> None:
    """Runs last in this module: local, sent-out and streamed requests left nothing."""
    servers = {"prefill": loaded.prefill}
    servers.update({f"decode{i}": d for i, d in enumerate(loaded.decoders)})
    states = wait_pools_idle(servers, patience.seconds(120))
    assert pools_idle(servers, states), f"pools still hold pages: {states}"


def test_no_server_warned_about_anything(loaded: DirectCluster) -> None:
    for server in (loaded.prefill, *loaded.decoders):
        assert unexpected_warnings(server) == [], server.process.name
