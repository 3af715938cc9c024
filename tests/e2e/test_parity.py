"""Every request feature SGLang serves, sent to a monolithic server and through a PD
pair behind SGLang's router (both with every feature turned on): the same answer, or a
clear refusal - never a hang, never another answer with HTTP 200.

The table is `sgl_pd.cluster.parity.ROWS` (the docs' table is generated from it); the
stateful features (abort, pause and continue) are tests of their own below.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import requests

from sgl_pd.cluster import parity
from sgl_pd.cluster.local import (
    Patience,
    PdCluster,
    Server,
    monolithic_server,
    pd_cluster,
    start_side_by_side,
)
from sgl_pd.cluster.logs import pools_idle, wait_pools_idle
from sgl_pd.models.tiny_lora import write_tiny_lora

from .conftest import COMMON_ARGS

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def servers(
    tmp_path_factory: pytest.TempPathFactory, patience: Patience
) -> Iterator[tuple[Server, PdCluster]]:
    lora = write_tiny_lora(tmp_path_factory.mktemp("lora"))
    flags = [*COMMON_ARGS, *parity.server_flags(str(lora))]
    with contextlib.ExitStack() as stack:
        mono, pd = start_side_by_side(
            stack,
            monolithic_server(
                tmp_path_factory.mktemp("parity-mono"), extra=flags, patience=patience
            ),
            pd_cluster(
                tmp_path_factory.mktemp("parity-pd"),
                prefill_extra=[*flags, "--pd-kv-send", "layerwise"],
                decode_extra=flags,
                patience=patience,
            ),
        )
        yield mono, pd


def _timeout_s(patience: Patience) -> float:
    """Far below the decoder's transfer timeout (120 s): a request left waiting for KV
    that will never come times out here instead of being answered."""
    return patience.seconds(60)


@pytest.mark.parametrize("row", parity.ROWS, ids=lambda row: row.feature)
def test_each_request_feature_is_answered_as_monolithic_answers_it_or_refused(
    row: parity.ParityRow, servers: tuple[Server, PdCluster], patience: Patience
) -> None:
    mono, pd = servers
    expected = parity.send(mono.url, row, _timeout_s(patience))
    through_pd = parity.send(pd.router_url, row, _timeout_s(patience))
    problems = parity.answers_agree(row, expected, through_pd)
    assert not problems, f"{row.feature} ({row.outcome.value}): {problems[:5]}"


def _row(feature_start: str) -> parity.ParityRow:
    return next(row for row in parity.ROWS if row.feature.startswith(feature_start))


def test_the_adapter_and_the_processor_change_the_answer(
    servers: tuple[Server, PdCluster], patience: Patience
) -> None:
    """Rows that would pass with the feature ignored on both sides are worth nothing."""
    _, pd = servers
    timeout = _timeout_s(patience)
    base = parity.send(pd.router_url, _row("token-id prompt"), timeout).body["output_ids"]
    lora = parity.send(pd.router_url, _row("LoRA adapter"), timeout).body["output_ids"]
    banned = parity.send(pd.router_url, _row("custom logit processor"), timeout).body
    from sgl_pd.cluster.parity_processor import BANNED_TOKEN

    assert lora != base
    assert BANNED_TOKEN in base and BANNED_TOKEN not in banned["output_ids"]


def _long_request(url: str, rid: str, started: threading.Event, out: list[Any]) -> None:
    body = {
        "input_ids": parity.PROMPT_IDS,
        "rid": rid,
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True},
    }
    with requests.post(f"{url}/generate", json=body, stream=True, timeout=300) as response:
        events = []
        for line in response.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                events.append(json.loads(line[6:]))
                started.set()
        out.append((response.status_code, events))
        started.set()


def _run_interrupted(url: str, interrupt: Any, timeout_s: float) -> tuple[int, list[Any]]:
    """Streams a long greedy request, calls `interrupt(rid)` once tokens flow, and
    returns (status, streamed events)."""
    rid = uuid.uuid4().hex
    started, out = threading.Event(), []
    thread = threading.Thread(target=_long_request, args=(url, rid, started, out))
    thread.start()
    assert started.wait(timeout_s), "no token streamed"
    interrupt(rid)
    thread.join(timeout_s)
    assert not thread.is_alive() and out, "the request was not answered"
    return out[0]


def test_an_abort_ends_the_request_as_in_monolithic(
    servers: tuple[Server, PdCluster], patience: Patience
) -> None:
    mono, pd = servers
    timeout = _timeout_s(patience)
    for entry, aborted_at in ((mono.url, mono.url), (pd.router_url, pd.decode.url)):
        status, events = _run_interrupted(
            entry,
            lambda rid, at=aborted_at: requests.post(
                f"{at}/abort_request", json={"rid": rid}, timeout=timeout
            ).raise_for_status(),
            timeout,
        )
        last = events[-1]["meta_info"]
        assert status == 200 and last["finish_reason"]["type"] == "abort", (entry, last)
        assert len(events[-1]["output_ids"]) < 200


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_pause_and_continue_give_the_uninterrupted_answer(
    mode: str, servers: tuple[Server, PdCluster], patience: Patience
) -> None:
    """The decoder paused mid-generation (`retract` frees the request's KV, which the
    prefill server recomputes on continue) resumes with the tokens it would have made."""
    mono, pd = servers
    timeout = _timeout_s(patience)

    def pause_and_continue(rid: str) -> None:
        at = pd.decode.url
        requests.post(f"{at}/pause_generation", json={"mode": mode}, timeout=timeout)
        time.sleep(0.5)  # the request sits paused (no assertion rests on this)
        requests.post(f"{at}/continue_generation", json={}, timeout=timeout).raise_for_status()

    status, events = _run_interrupted(pd.router_url, pause_and_continue, timeout)
    body = {
        "input_ids": parity.PROMPT_IDS,
        "sampling_params": {"temperature": 0, "max_new_tokens": 200, "ignore_eos": True},
    }
    expected = requests.post(f"{mono.url}/generate", json=body, timeout=timeout).json()
    assert status == 200
    assert events[-1]["output_ids"] == expected["output_ids"]


def test_every_page_is_free_again(servers: tuple[Server, PdCluster], patience: Patience) -> None:
    """Runs last in this module: refused, aborted and retracted requests left nothing."""
    _, pd = servers
    pair = {"prefill": pd.prefill, "decode": pd.decode}
    states = wait_pools_idle(pair, patience.seconds(60))
    assert pools_idle(pair, states), f"pools still hold pages: {states}"
