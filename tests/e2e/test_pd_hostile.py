"""Hostile input against a real PD pair (SGLang on CPU, SGLang's router): processes without
the cluster secret get nothing back from any listener, a member that sends thousands
of hostile frames leaves both servers healthy, running and giving the same tokens, and
every request body that once took a server down or got a 5xx is answered 4xx by the PD
pair and a monolithic server alike.

The tests share one cluster and run in file order: the strangers first, then the member.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from sgl_pd.cluster import hostile
from sgl_pd.cluster.client import generate_ids
from sgl_pd.cluster.hostile_requests import Body, send
from sgl_pd.cluster.local import Patience, PdCluster, Server, pd_cluster
from sgl_pd.cluster.prompts import prompt_ids, varied_prompts

pytestmark = pytest.mark.e2e

MAX_NEW_TOKENS = 6
STRANGER_FRAMES = 3000  # per listener
MEMBER_FRAMES = 1500
FLOOD_SENDERS = 5000  # per inbox: far more than an outbox's peer limit (1024)
LOG_LINES_ALLOWED = 2000  # lines each log may grow by: rate-limited, whatever was sent


@dataclass
class Setup:
    cluster: PdCluster
    log_dir: Path
    targets: hostile.Targets
    witness: hostile.Witness
    pids: dict[str, set[int]]
    prompts: list[list[int]]
    expected: list[list[int]]


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory, patience: Patience) -> Iterator[Setup]:
    log_dir = tmp_path_factory.mktemp("pd-hostile")
    prompts = [prompt_ids(p) for p in varied_prompts(3, seed=19)]
    with pd_cluster(log_dir, patience=patience) as cluster:
        expected = [generate_ids(cluster.router_url, p, MAX_NEW_TOKENS) for p in prompts]
        targets, witness = hostile.find_targets(cluster, log_dir, patience.seconds(30.0))
        pids = {
            "prefill": hostile.process_tree(cluster.prefill),
            "decode": hostile.process_tree(cluster.decode),
        }
        try:
            yield Setup(cluster, log_dir, targets, witness, pids, prompts, expected)
        finally:
            witness.close()


def _assert_unharmed(s: Setup, patience: Patience) -> None:
    checked = hostile.check_cluster(
        s.cluster,
        s.pids,
        s.prompts,
        s.expected,
        max_new_tokens=MAX_NEW_TOKENS,
        timeout_s=patience.seconds(60.0),
    )
    assert checked.server_crashes == 0, checked.notes
    assert checked.health_failures == 0, checked.notes
    assert checked.output_changed == 0, checked.notes


def _logs(s: Setup) -> list[Path]:
    return [s.log_dir / "prefill.log", s.log_dir / "decode.log"]


def test_the_decode_inbox_is_found(setup: Setup) -> None:
    endpoints = setup.targets.endpoints()
    assert len(set(endpoints.values())) == 3, endpoints


def test_strangers_get_no_answer(setup: Setup, patience: Patience) -> None:
    tally = hostile.run_strangers(
        setup.targets, setup.witness, STRANGER_FRAMES, quiet_s=patience.seconds(2.0), seed=3
    )
    assert tally.frames_sent == 3 * STRANGER_FRAMES
    assert tally.answers == 0, "a process without the cluster secret got an answer"
    _assert_unharmed(setup, patience)


def test_a_hostile_member_harms_nothing(setup: Setup, patience: Patience) -> None:
    logs = _logs(setup)
    lines_before = {p.name: len(p.read_text(errors="replace").splitlines()) for p in logs}
    rooms = hostile.RealRooms()
    campaign = hostile.Campaign.create(setup.targets, setup.witness.endpoint, rooms)
    live = hostile.LiveTraffic(
        setup.cluster,
        setup.prompts,
        setup.expected,
        rooms,
        max_new_tokens=MAX_NEW_TOKENS,
        timeout_s=patience.seconds(300.0),
        seed=3,
    )
    member = hostile.MemberSockets(setup.targets)
    try:
        sent = hostile.run_member(campaign, member, MEMBER_FRAMES, seed=3).frames_sent
        sent += hostile.heartbeat_flood(
            setup.targets, member, FLOOD_SENDERS, lambda n: None
        ).frames_sent
        sent += hostile.send_oversized(setup.targets).frames_sent
    finally:
        member.close()
        result = live.stop(patience.seconds(300.0))
    assert sent >= MEMBER_FRAMES + 2 * FLOOD_SENDERS
    assert result.requests > 0
    assert (result.changed, result.failed) == (0, 0), "real requests changed under forged traffic"
    _assert_unharmed(setup, patience)
    findings = hostile.log_findings(logs)
    assert findings["tracebacks"] == 0, findings
    assert findings["injected_lines"] == 0, "a peer's text started a log line of its own"
    for p in logs:
        added = len(p.read_text(errors="replace").splitlines()) - lines_before[p.name]
        assert added <= LOG_LINES_ALLOWED, f"{p.name} grew by {added} lines"


# Every request body that ever killed a server, got a 5xx or a dropped connection
# (`bench_hostile_requests.py` saves them; the ones found are copied here): one JSON object
# a line, with how it was found; "expect": "answered" where a 200 stream ending with the
# error is the right answer (Ollama's streams)
HOSTILE_REQUEST_CASES = Path(__file__).with_name("hostile_request_cases.jsonl")


def _bounded(endpoint: str, body: dict) -> dict:
    """An Ollama body without a token limit, once served, generates until EOS (minutes
    on a loaded CPU): given one, its hostile fields untouched."""
    if endpoint.startswith("/api/") and "options" not in body:
        return {**body, "options": {"num_predict": 8}}
    return body


def _hostile_request_cases() -> list[dict]:
    lines = HOSTILE_REQUEST_CASES.read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def test_every_body_that_once_failed_a_server_is_refused_and_harms_nothing(
    setup: Setup, mono: Server, patience: Patience
) -> None:
    """Each body, to a monolithic server and through the router to the PD pair: the
    monolithic server answers 4xx, the PD pair 4xx too or, where the router replaced the
    offending fields with its own (bootstrap fields), answers it; no 5xx, and afterwards
    every server is healthy and gives the same tokens (runs last: the member phase above
    counts tracebacks in the logs)."""
    cases = _hostile_request_cases()
    assert len(cases) >= 21
    wrong = []
    for case in cases:
        item = Body(case["endpoint"], _bounded(case["endpoint"], case["body"]), "regression")
        mono_answer = send(mono.url, item, patience.seconds(60.0))
        pd_answer = send(setup.cluster.router_url, item, patience.seconds(60.0))
        refused = isinstance(mono_answer.status, int) and 400 <= mono_answer.status < 500
        if case.get("expect") == "answered":  # a stream that began: its error ends it
            refused = isinstance(mono_answer.status, int) and not mono_answer.server_error
        if not refused:
            wrong.append(f"monolithic {item.endpoint} ({case['found']}): {mono_answer}")
        if not isinstance(pd_answer.status, int) or pd_answer.server_error:
            wrong.append(f"pd {item.endpoint} ({case['found']}): {pd_answer}")
    assert wrong == []
    _assert_unharmed(setup, patience)
    assert requests.get(f"{mono.url}/health", timeout=patience.seconds(30.0)).status_code == 200
    prompt = setup.prompts[0]
    assert generate_ids(mono.url, prompt, MAX_NEW_TOKENS) == setup.expected[0]
