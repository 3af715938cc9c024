"""The bundled models of the mission's architectures, served on CPU: tiny DeepSeek-V3
(MLA, MoE, a trained NextN/MTP layer) without and with NEXTN speculative decoding, and tiny
Qwen3-MoE, first on ordinary SGLang servers, then through SGLang's router in PD mode.

The monolithic servers start side by side; each in turn then collects every answer the
tests look at (the greedy reference for the PD runs included); they stop together. Each
PD cluster has two prefill servers, one streaming layer by layer and one sending after
the forward, which the router takes in turn: one cluster covers both send modes at one
page size. Tiny Qwen3-MoE goes through PD at TP 2 on both sides.
"""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from sgl_pd.cluster.client import REQUEST_TIMEOUT_S
from sgl_pd.cluster.conversations import Conversation, Reply, replay, script, wrong_turns
from sgl_pd.cluster.local import (
    Patience,
    PdCluster,
    Server,
    monolithic_server,
    pd_cluster,
    scheduler_ranks,
    start_side_by_side,
)
from sgl_pd.cluster.logs import TimingLine, last_pool_state, timing_lines, wait_pools_idle
from sgl_pd.cluster.mesh import MeshServer, pd_mesh
from sgl_pd.cluster.prompts import long_prompt_ids, varied_prompts
from sgl_pd.models import TINY_DEEPSEEK_V3_PATH, TINY_QWEN3_MOE_PATH

from .conftest import DECODE_PREFIX_CACHE

pytestmark = pytest.mark.e2e

COMMON_ARGS = ["--log-level", "info", "--dtype", "float32"]
NEXTN_ARGS = [
    "--speculative-algorithm", "NEXTN",
    "--speculative-num-steps", "1",
    "--speculative-eagle-topk", "1",
    "--speculative-num-draft-tokens", "2",
]  # fmt: skip
PROMPTS = ["Count: 41 42 43", "Days: Friday", "3 + 4 =", "Months: March"]
MAX_NEW_TOKENS = 24
# 30 prompts for the PD comparisons: one and two tokens (the first goes the upstream way,
# the second prefills a single token), then 10 to ~450 tokens (up to 4 chunks of 128)
PD_PROMPTS: list[str | list[int]] = [
    long_prompt_ids(1),
    long_prompt_ids(2),
    *varied_prompts(28, seed=23),
]
PD_NEW_TOKENS = 12
CHUNK_ARGS = ["--chunked-prefill-size", "128"]


@dataclass(frozen=True)
class Answer:
    """One greedy answer: its token ids and SGLang's meta_info (speculative counts)."""

    ids: list[int]
    meta: dict[str, Any]


@dataclass(frozen=True)
class Run:
    """What one server answered: per prompt, the greedy text and SGLang's meta_info, per
    PD prompt the greedy answer, and multi-turn conversations scripted from its answers."""

    texts: list[str]
    meta: list[dict[str, Any]]
    log: str
    answers: list[Answer]
    conversations: list[Conversation]


# openers of the multi-turn conversations: each longer than a 64-token page, so that
# later turns hold whole pages at every page size used here
CONVERSATION_OPENERS = [long_prompt_ids(90 + 50 * i, start=500 * i + 3) for i in range(2)]
CONVERSATION_TURNS = 3


def ask_one(url: str, prompt: str | list[int]) -> Answer:
    response = requests.post(
        f"{url}/generate",
        json={
            ("text" if isinstance(prompt, str) else "input_ids"): prompt,
            "sampling_params": {"max_new_tokens": PD_NEW_TOKENS, "temperature": 0},
        },
        timeout=REQUEST_TIMEOUT_S,
    )
    response.raise_for_status()
    body = response.json()
    return Answer([int(t) for t in body["output_ids"]], body["meta_info"])


def ask_all(url: str) -> list[Answer]:
    """The PD prompts, eight at a time (batches mix lengths and chunked prefills)."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda p: ask_one(url, p), PD_PROMPTS))


def generate(server: Server, prompts: list[str]) -> tuple[list[str], list[dict[str, Any]]]:
    """Greedy ``/generate`` for each prompt in one batch (SGLang keeps the order)."""
    response = requests.post(
        f"{server.url}/generate",
        json={
            "text": prompts,
            "sampling_params": {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0},
        },
        timeout=REQUEST_TIMEOUT_S,
    )
    response.raise_for_status()
    answers = response.json()
    return [a["text"] for a in answers], [a["meta_info"] for a in answers]


def ask_monolithic(server: Server) -> Run:
    """Every answer the tests look at, from one monolithic server."""
    texts, meta = generate(server, PROMPTS)
    # once more, one prompt at a time: batching must not change greedy text
    singles = [generate(server, [p])[0][0] for p in PROMPTS]
    assert singles == texts, (singles, texts)
    answers = ask_all(server.url)
    conversations = script(
        server.url, CONVERSATION_OPENERS, CONVERSATION_TURNS, max_new_tokens=PD_NEW_TOKENS
    )
    log = server.process.log_path.read_text(errors="replace")
    return Run(texts, meta, log, answers, conversations)


MONOLITHIC = {  # name -> (model, flags)
    "deepseek": (TINY_DEEPSEEK_V3_PATH, [*COMMON_ARGS, *CHUNK_ARGS]),
    "deepseek-nextn": (TINY_DEEPSEEK_V3_PATH, [*COMMON_ARGS, *CHUNK_ARGS, *NEXTN_ARGS]),
    "qwen3-moe": (TINY_QWEN3_MOE_PATH, [*COMMON_ARGS, *CHUNK_ARGS]),
}


@pytest.fixture(scope="module")
def monolithic(tmp_path_factory: pytest.TempPathFactory, patience: Patience) -> dict[str, Run]:
    """The monolithic servers start side by side (a start is mostly single-threaded
    imports), then answer one at a time (answering side by side, their threads would
    spin against each other on two cores), and stop."""
    with contextlib.ExitStack() as stack:
        servers = start_side_by_side(
            stack,
            *(
                monolithic_server(
                    tmp_path_factory.mktemp(name), model=model, extra=extra, patience=patience
                )
                for name, (model, extra) in MONOLITHIC.items()
            ),
        )
        return {
            name: ask_monolithic(server) for name, server in zip(MONOLITHIC, servers, strict=True)
        }


@pytest.fixture(scope="module")
def deepseek(monolithic: dict[str, Run]) -> Run:
    return monolithic["deepseek"]


@pytest.fixture(scope="module")
def deepseek_nextn(monolithic: dict[str, Run]) -> Run:
    return monolithic["deepseek-nextn"]


@pytest.fixture(scope="module")
def qwen3_moe(monolithic: dict[str, Run]) -> Run:
    return monolithic["qwen3-moe"]


def test_deepseek_greedy_text_is_readable(deepseek: Run) -> None:
    count, days, fact, months = deepseek.texts
    assert count.startswith(" 44 45 46 47"), count
    assert days.startswith(" Saturday Sunday Monday"), days
    assert fact.startswith(" 7."), fact
    assert months.startswith(" April May June"), months


def test_deepseek_uses_the_cpu_shims(deepseek: Run) -> None:
    assert "applying CPU shim: MLA attention dispatch registered for torch_native" in deepseek.log


def test_nextn_output_equals_greedy_output(deepseek: Run, deepseek_nextn: Run) -> None:
    assert deepseek_nextn.texts == deepseek.texts


def test_nextn_drafts_are_accepted(deepseek_nextn: Run) -> None:
    for meta in deepseek_nextn.meta:
        assert meta["spec_verify_ct"] > 0, meta
        # one draft token per verify: the rate is accepted drafts / proposed drafts
        assert meta["spec_num_proposed_drafts"] == meta["spec_verify_ct"], meta
        assert meta["spec_num_correct_drafts"] > 0, meta
        assert 0.0 < meta["spec_accept_rate"] <= 1.0, meta
        assert meta["spec_accept_length"] > 1.0, meta
    assert "applying CPU shim: torch_native draft-extend backend" in deepseek_nextn.log


def test_qwen3_moe_answers_deterministically(qwen3_moe: Run) -> None:
    # serve_and_ask compared the batched answers with one-at-a-time ones already
    count, days, fact, months = qwen3_moe.texts
    assert count.startswith(" 44 45 46 47"), count
    assert days.startswith(" Saturday Sunday Monday"), days
    assert fact.startswith(" 7."), fact
    assert months.startswith(" April May June"), months
    assert all(m["completion_tokens"] == MAX_NEW_TOKENS for m in qwen3_moe.meta)


# -- through the router, in PD mode --------------------------------------------------------


@dataclass(frozen=True)
class PdRun:
    answers: list[Answer]
    modes: dict[str, int]  # send mode -> requests the prefill servers finished in it
    pools: dict[str, tuple[int, bool] | None]  # server -> (tokens used, no leak), idle
    parallel_sampling: requests.Response  # the answer to a request with n = 2
    replies: list[list[Reply]]  # the reference's conversations, replayed turn by turn
    held: list[int]  # per replayed turn: prompt tokens the decoder held (prefill lines)


def _idle_pools(cluster: PdCluster, patience: Patience) -> dict[str, tuple[int, bool] | None]:
    """Each server's last idle-pool line once every one reports no pages in use (or the
    state when the wait ran out: the test shows it)."""
    servers = [cluster.prefill, *cluster.more_prefills, cluster.decode]
    deadline = time.monotonic() + patience.seconds(60)
    while True:
        states = {s.process.name: last_pool_state(s.process.log_path) for s in servers}
        if all(state == (0, True) for state in states.values()) or time.monotonic() > deadline:
            return states
        time.sleep(1)


def serve_pd(
    log_dir: Path,
    model: Path,
    extra: list[str],
    patience: Patience,
    conversations: list[Conversation],
) -> PdRun:
    """A decode server (with a prefix cache) and two prefill servers (layer-wise,
    after-forward) behind the router, all with `extra`; asks the PD prompts, replays the
    conversations, then waits for idle pools."""
    # Three MoE servers on two cores answer heartbeats late while they compute; these
    # tests are about tokens, not liveness (which test_pd_faults checks).
    args = [*COMMON_ARGS, *CHUNK_ARGS, *extra]
    with pd_cluster(
        log_dir,
        model=model,
        prefill_extra=[*args, "--pd-kv-send", "layerwise"],
        more_prefills=[[*args, "--pd-kv-send", "after-forward"]],
        decode_extra=[*args, *DECODE_PREFIX_CACHE],
        patience=patience,
    ) as cluster:
        answers = ask_all(cluster.router_url)
        before = _prefill_lines(cluster)
        replies = replay(cluster.router_url, conversations, concurrency=3)
        held = [int(line["held"]) for line in _prefill_lines(cluster)[len(before) :]]
        parallel = requests.post(
            f"{cluster.router_url}/generate",
            json={"text": "Days: Friday", "sampling_params": {"max_new_tokens": 4, "n": 2}},
            timeout=REQUEST_TIMEOUT_S,
        )
        pools = _idle_pools(cluster, patience)
        modes: dict[str, int] = {}
        for line in _prefill_lines(cluster):
            modes[str(line["mode"])] = modes.get(str(line["mode"]), 0) + 1
    return PdRun(answers, modes, pools, parallel, replies, held)


def _prefill_lines(cluster: PdCluster) -> list[TimingLine]:
    """Every prefill server's timing lines, in the order the requests finished."""
    lines = [
        line
        for server in (cluster.prefill, *cluster.more_prefills)
        for line in timing_lines(server.process.log_path)
    ]
    return sorted(lines, key=lambda line: float(line["done"]))


@pytest.fixture(scope="module")
def deepseek_nextn_pd_page64(
    tmp_path_factory: pytest.TempPathFactory, patience: Patience, deepseek_nextn: Run
) -> Iterator[PdRun]:
    yield serve_pd(
        tmp_path_factory.mktemp("deepseek-nextn-pd-64"),
        TINY_DEEPSEEK_V3_PATH,
        [*NEXTN_ARGS, "--page-size", "64"],
        patience,
        deepseek_nextn.conversations,
    )


def _assert_same_tokens(reference: Run, pd: PdRun) -> None:
    mismatches = [
        (i, want.ids, got.ids)
        for i, (want, got) in enumerate(zip(reference.answers, pd.answers, strict=True))
        if want.ids != got.ids
    ]
    assert not mismatches, mismatches


def _assert_served_well(pd: PdRun) -> None:
    # both send modes carried requests (one request, one mode: 29 PD prompts in all,
    # the one-token prompt included; SGLang's warm-up is not ours)
    assert set(pd.modes) == {"layerwise", "after_forward"}, pd.modes
    assert all(count >= 10 for count in pd.modes.values()), pd.modes
    assert all(state == (0, True) for state in pd.pools.values()), pd.pools


def _spec(answer: Answer, key: str) -> int:
    """A speculative count of one answer; SGLang leaves them out of an answer that
    needed no verify step (say, one that ended on its first token)."""
    return int(answer.meta.get(key, 0))


def _accept_rate(answers: list[Answer]) -> float:
    correct = sum(_spec(a, "spec_num_correct_drafts") for a in answers)
    proposed = sum(_spec(a, "spec_num_proposed_drafts") for a in answers)
    return correct / proposed


def test_deepseek_nextn_through_pd_gives_monolithic_tokens(
    deepseek: Run, deepseek_nextn: Run, deepseek_nextn_pd_page64: PdRun
) -> None:
    """Greedy tokens through PD with NEXTN on both sides equal monolithic serving's,
    with and without NEXTN there, in both send modes, at 64 tokens a page (FlashMLA's
    page on a GPU; a page of 1 is the sharded DeepSeek test's)."""
    pd = deepseek_nextn_pd_page64
    _assert_same_tokens(deepseek_nextn, pd)
    _assert_same_tokens(deepseek, pd)
    _assert_served_well(pd)


def test_the_prefill_seeds_the_decoders_first_draft(
    deepseek_nextn: Run, deepseek_nextn_pd_page64: PdRun
) -> None:
    """The MTP hand-off: the decoder's first verify checks the draft the prefill's MTP
    layer proposed from the prompt (its KV, top-k and hidden state shipped with the
    request), so acceptance through PD matches monolithic serving's. A decoder that had
    to start the draft from nothing could not accept the first proposal of a short
    answer; here every short prompt's drafts are all accepted, as monolithically."""
    pd = deepseek_nextn_pd_page64
    mono_rate, pd_rate = _accept_rate(deepseek_nextn.answers), _accept_rate(pd.answers)
    assert abs(pd_rate - mono_rate) <= 0.05, (mono_rate, pd_rate)
    for mono, through_pd in zip(deepseek_nextn.answers, pd.answers, strict=True):
        # one verify fewer or more at most: PD's first verify also checks the first token
        verifies = _spec(through_pd, "spec_verify_ct"), _spec(mono, "spec_verify_ct")
        assert abs(verifies[0] - verifies[1]) <= 1, (mono.meta, through_pd.meta)
    perfect = [
        i for i, mono in enumerate(deepseek_nextn.answers) if mono.meta.get("spec_accept_rate") == 1
    ]
    assert perfect, "the MTP layer accepted no prompt's drafts in full monolithically"
    still = [i for i in perfect if pd.answers[i].meta.get("spec_accept_rate") == 1]
    assert len(still) >= 0.9 * len(perfect), [(i, pd.answers[i].meta) for i in perfect]


def _assert_conversations_hold_and_match(pd: PdRun) -> None:
    """Every replayed turn has monolithic's tokens, and every turn after the first held
    a prefix (the previous turn's prompt and answer, in whole pages)."""
    assert not wrong_turns(pd.replies), pd.replies
    assert len(pd.held) == len(CONVERSATION_OPENERS) * CONVERSATION_TURNS
    assert sum(h > 0 for h in pd.held) >= len(CONVERSATION_OPENERS) * (CONVERSATION_TURNS - 1)


def test_deepseek_nextn_conversations_hold_prefixes_and_accept_drafts(
    deepseek_nextn: Run, deepseek_nextn_pd_page64: PdRun
) -> None:
    """Later turns start from the decoder's held prefix; the draft model's KV of that
    prefix is held too (the draft layer is one more layer of the same pages), so draft
    acceptance on those turns stays within 0.05 of monolithic serving's."""
    pd = deepseek_nextn_pd_page64
    _assert_conversations_hold_and_match(pd)
    later = [t for c in deepseek_nextn.conversations for t in c[1:]]
    through_pd = [r for c in pd.replies for r in c[1:]]
    mono_answers = [Answer(list(t.expected.tokens), t.meta) for t in later]
    pd_answers = [Answer(list(r.tokens), r.meta) for r in through_pd]
    mono_rate, pd_rate = _accept_rate(mono_answers), _accept_rate(pd_answers)
    assert abs(pd_rate - mono_rate) <= 0.05, (mono_rate, pd_rate)


# -- sharded servers through the router --------------------------------------------------

SHARDED_PROMPTS = 24  # the first PD prompts: up to ~450 tokens; 5 ranks share two cores


@dataclass(frozen=True)
class ShardedRun:
    answers: dict[tuple[str, str], list[Answer]]  # (prefill, decode) -> answers
    timing: dict[str, list[TimingLine]]  # prefill server -> its ranks' timing lines
    pools: dict[str, dict[str, tuple[int, bool]]]  # server -> rank -> (used, no leak), idle
    ranks: dict[str, int]  # server -> its scheduler processes
    logs: dict[str, str]  # server -> its log
    # (prefill, decode) -> the reference's conversations replayed, and per turn the
    # prompt tokens the decoder held (one prefill rank's lines)
    replies: dict[tuple[str, str], list[list[Reply]]]
    held: dict[tuple[str, str], list[int]]
    parallel_sampling: requests.Response | None = None  # the answer to a request with n = 2


def serve_sharded(
    log_dir: Path,
    model: Path,
    servers: list[MeshServer],
    routes: list[tuple[str, str]],
    patience: Patience,
    conversations: list[Conversation],
    ask_parallel: bool = False,
) -> ShardedRun:
    """`servers` with one router per route; the sharded prompts through each route in
    turn, and the conversations (each route's decoder has a prefix cache of its own),
    then every rank's idle pool. `ask_parallel`: also a request with n = 2 through the
    first route."""
    prompts = PD_PROMPTS[:SHARDED_PROMPTS]
    with pd_mesh(log_dir, servers, routes, model=model, patience=patience) as mesh:
        answers, replies, held = {}, {}, {}
        for route in routes:
            with ThreadPoolExecutor(8) as pool:
                url = mesh.router(*route)
                answers[route] = list(pool.map(lambda p, url=url: ask_one(url, p), prompts))
            log = mesh.servers[route[0]].process.log_path
            before = len(timing_lines(log))
            replies[route] = replay(url, conversations, concurrency=3)
            held[route] = [int(line["held"]) for line in timing_lines(log)[before:]]
        parallel = None
        if ask_parallel:
            parallel = requests.post(
                f"{mesh.router(*routes[0])}/generate",
                json={"text": "Days: Friday", "sampling_params": {"max_new_tokens": 4, "n": 2}},
                timeout=REQUEST_TIMEOUT_S,
            )
        ranks = {name: scheduler_ranks(s.process.argv) for name, s in mesh.servers.items()}
        pools = wait_pools_idle(mesh.servers, patience.seconds(90))
        timing = {
            n: timing_lines(s.process.log_path)
            for n, s in mesh.servers.items()
            if s.process.name.startswith("p_")
        }
        logs = {n: s.process.log_path.read_text(errors="replace") for n, s in mesh.servers.items()}
    return ShardedRun(answers, timing, pools, ranks, logs, replies, held, parallel)


def _sharded_args(extra: list[str]) -> tuple[str, ...]:
    return (*COMMON_ARGS, *CHUNK_ARGS, *extra)


DEEPSEEK_ROUTES = [("p_tp2", "d_tp1"), ("p_tp1", "d_tp2")]


@pytest.fixture(scope="module")
def deepseek_nextn_sharded(
    tmp_path_factory: pytest.TempPathFactory, patience: Patience, deepseek_nextn: Run
) -> ShardedRun:
    """MLA: every rank holds the whole latent, so each TP2 side is two replica sets (D14);
    TP2 -> TP1 picks one source rank per request, TP1 -> TP2 feeds both decode ranks."""
    args = _sharded_args(NEXTN_ARGS)
    return serve_sharded(
        tmp_path_factory.mktemp("deepseek-nextn-sharded"),
        TINY_DEEPSEEK_V3_PATH,
        [
            MeshServer("p_tp2", "prefill", (*args, "--tp", "2", "--pd-kv-send", "layerwise")),
            MeshServer("p_tp1", "prefill", (*args, "--pd-kv-send", "after-forward")),
            MeshServer("d_tp1", "decode", (*args, *DECODE_PREFIX_CACHE)),
            MeshServer("d_tp2", "decode", (*args, *DECODE_PREFIX_CACHE, "--tp", "2")),
        ],
        DEEPSEEK_ROUTES,
        patience,
        deepseek_nextn.conversations,
    )


@pytest.fixture(scope="module")
def qwen3_moe_sharded(
    tmp_path_factory: pytest.TempPathFactory, patience: Patience, qwen3_moe: Run
) -> ShardedRun:
    """4 KV heads over TP2 on both sides (D12), the experts split over both ranks, at 16
    tokens a page (a page of 1 is the Llama modules' and DeepSeek's here: the MoE layers
    change nothing the transfer sees)."""
    args = _sharded_args(["--tp", "2", "--page-size", "16"])
    return serve_sharded(
        tmp_path_factory.mktemp("qwen3-moe-sharded"),
        TINY_QWEN3_MOE_PATH,
        [
            MeshServer("p_tp2", "prefill", (*args, "--pd-kv-send", "layerwise")),
            MeshServer("d_tp2", "decode", (*args, *DECODE_PREFIX_CACHE)),
        ],
        [("p_tp2", "d_tp2")],
        patience,
        qwen3_moe.conversations,
        ask_parallel=True,
    )


def _assert_sharded_tokens(reference: Run, by_route: dict[tuple[str, str], list[Answer]]) -> None:
    want = reference.answers[:SHARDED_PROMPTS]
    for route, answers in by_route.items():
        mismatches = [
            (i, w.ids, g.ids)
            for i, (w, g) in enumerate(zip(want, answers, strict=True))
            if w.ids != g.ids
        ]
        assert not mismatches, (route, len(mismatches), mismatches)


def _assert_sharded_conversations(run: ShardedRun, route: tuple[str, str], ranks: int) -> None:
    """The replayed conversations have monolithic's tokens, and later turns held
    prefixes (`ranks`: timing lines per request, one per prefill rank)."""
    assert not wrong_turns(run.replies[route]), (route, run.replies[route])
    later = len(CONVERSATION_OPENERS) * (CONVERSATION_TURNS - 1)
    assert sum(h > 0 for h in run.held[route]) >= ranks * later, (route, run.held[route])


def _assert_every_rank_idle(run: ShardedRun) -> None:
    for name, states in run.pools.items():
        assert len(states) == run.ranks[name], (name, states)
        assert all(v == (0, True) for v in states.values()), (name, states)


@pytest.mark.parametrize("route", DEEPSEEK_ROUTES, ids=["tp2-tp1", "tp1-tp2"])
def test_deepseek_nextn_sharded_gives_monolithic_tokens_and_acceptance(
    deepseek: Run, deepseek_nextn: Run, deepseek_nextn_sharded: ShardedRun, route: tuple[str, str]
) -> None:
    """Greedy tokens equal monolithic serving's (with and without NEXTN), and draft
    acceptance through the sharded pair matches monolithic NEXTN's: the draft layer's KV
    reaches every decode rank from whichever source rank was picked."""
    answers = deepseek_nextn_sharded.answers[route]
    _assert_sharded_tokens(deepseek_nextn, {route: answers})
    _assert_sharded_tokens(deepseek, {route: answers})
    mono_rate = _accept_rate(deepseek_nextn.answers[:SHARDED_PROMPTS])
    assert abs(_accept_rate(answers) - mono_rate) <= 0.05, (mono_rate, _accept_rate(answers))
    _assert_sharded_conversations(deepseek_nextn_sharded, route, 2 if route[0] == "p_tp2" else 1)
    _assert_every_rank_idle(deepseek_nextn_sharded)


def test_a_replica_rank_that_writes_nothing_lets_the_request_complete(
    deepseek_nextn_sharded: ShardedRun,
) -> None:
    """TP2 -> TP1 with MLA: one source rank per request writes the KV (D14), the other
    writes no page; every request still completed (tokens above), and both ranks sent."""
    lines = [line for line in deepseek_nextn_sharded.timing["p_tp2"] if "rank" in line]
    by_rank = {r: [line for line in lines if line["rank"] == r] for r in (0.0, 1.0)}
    assert all(by_rank.values()), by_rank.keys()
    rooms: dict[float, list[float]] = {}
    for line in lines:
        rooms.setdefault(float(line["room"]), []).append(float(line["bytes"]))
    # a request of the TP2 -> TP1 route: one rank's bytes, the other's zero
    split = [sent for sent in rooms.values() if len(sent) == 2 and min(sent) == 0 < max(sent)]
    assert len(split) >= SHARDED_PROMPTS - 1, rooms
    assert all(max(line["bytes"] for line in by_rank[r]) > 0 for r in by_rank)


def test_qwen3_moe_tp2_to_tp2_gives_monolithic_tokens(
    qwen3_moe: Run, qwen3_moe_sharded: ShardedRun
) -> None:
    _assert_sharded_tokens(qwen3_moe, qwen3_moe_sharded.answers)
    _assert_sharded_conversations(qwen3_moe_sharded, ("p_tp2", "d_tp2"), 2)
    _assert_every_rank_idle(qwen3_moe_sharded)


def test_parallel_sampling_is_refused_with_its_reason(qwen3_moe_sharded: ShardedRun) -> None:
    """n > 1 cannot work through SGLang's PD (the copies share one bootstrap room): the
    client is told so, nothing hangs, and no page is left behind (checked above)."""
    answer = qwen3_moe_sharded.parallel_sampling
    assert answer is not None and answer.status_code == 400, answer
    assert "send n separate requests" in answer.text, answer.text


@pytest.fixture(scope="module")
def deepseek_dp_attention(
    tmp_path_factory: pytest.TempPathFactory, patience: Patience, deepseek: Run
) -> ShardedRun:
    """The article's DP-decode deployment in small: a TP1 prefill server feeding one
    decode server with DP attention (two attention-DP ranks, each its own pool and
    requests, the MoE over both); each DP rank is a one-rank decoder to the prefill."""
    args = _sharded_args([])
    return serve_sharded(
        tmp_path_factory.mktemp("deepseek-dp-attention"),
        TINY_DEEPSEEK_V3_PATH,
        [
            MeshServer("p_tp1", "prefill", (*args, "--pd-kv-send", "layerwise")),
            MeshServer(
                "d_dp2",
                "decode",
                (
                    *args,
                    *DECODE_PREFIX_CACHE,
                    "--tp",
                    "2",
                    "--dp",
                    "2",
                    "--enable-dp-attention",
                    "--decode-log-interval",
                    "1",
                ),
            ),
        ],
        [("p_tp1", "d_dp2")],
        patience,
        deepseek.conversations,
    )


def test_deepseek_dp_attention_decode_gives_monolithic_tokens(
    deepseek: Run, deepseek_dp_attention: ShardedRun
) -> None:
    _assert_sharded_tokens(deepseek, deepseek_dp_attention.answers)
    _assert_sharded_conversations(deepseek_dp_attention, ("p_tp1", "d_dp2"), 1)
    _assert_every_rank_idle(deepseek_dp_attention)
    # both attention-DP ranks decoded requests of their own
    log = deepseek_dp_attention.logs["d_dp2"]
    for tag in ("DP0 TP0", "DP1 TP1"):
        assert re.search(rf"{tag}\] Decode batch[^,]*, #running-req: [1-9]", log), tag
