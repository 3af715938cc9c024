"""Sliding-window models served on CPU and through sgl_pd: the bundled tiny Mellum
(three sliding layers with a window of 16 tokens, one full-attention layer) and tiny
Gemma 3 (five sliding layers, one full).

Monolithic, SGLang keeps the sliding layers in its hybrid SWA pool, with slot numbers of
their own; the CPU harness makes ``torch_native`` read them through those numbers
(`sgl_pd.harness.swa_attention_cpu`). The pool is kept small and out-of-window slots are
freed every step, so that the two numberings part within a few rounds: greedy tokens
must still equal transformers' own forward (a departure at a near tie of its top two
tokens aside).

Through PD, with the hybrid pool on both servers as small and as often evicted: the
full-attention layer's KV moves as pages, the sliding layers' window as pages of the
sliding pool (`sgl_pd.backend.sliding_window_glue`), from two prefill servers behind
the router: one layer-wise, and a TP2 one after the forward whose ranks each write their
KV head of every page, window pages included, into the TP1 decoder. Tokens equal
the monolithic server's, over rounds of prompts shorter and longer than the window
(chunked), in conversations whose later turns hold a prefix on the decoder (hits
before and inside the window), and both pools (both page spaces) are idle after.

Gemma 3 SGLang always serves with the hybrid pool off: every layer's KV sits in one
pool and moves as pages, the window applied in attention only. Through PD, its answers
and its follow-ups' (the decoder holding their prompts) equal transformers'.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest
import requests

from sgl_pd.cluster.campaign import abort_at_decoder
from sgl_pd.cluster.client import send_as_router
from sgl_pd.cluster.conversations import Reply, replay, wrong_turns
from sgl_pd.cluster.local import (
    Patience,
    PdCluster,
    monolithic_server,
    pd_cluster,
    start_side_by_side,
)
from sgl_pd.cluster.logs import (
    PoolStates,
    decode_failures,
    pools_idle,
    timing_lines,
    wait_pools_idle,
)
from sgl_pd.cluster.prompts import long_prompt_ids, prompt_ids
from sgl_pd.core.sliding_window import window_pages
from sgl_pd.models import TINY_GEMMA3_PATH, TINY_MELLUM_PATH
from sgl_pd.models.train_tiny_moe import SLIDING_WINDOW

from . import transformers_answers
from .conftest import DECODE_PREFIX_CACHE
from .transformers_answers import (
    MonoRun,
    answer_monolithic,
    mismatches,
    refusing_decoder,
    transformers_reference,
    wrong_answers,
)

pytestmark = pytest.mark.e2e

COMMON_ARGS = ["--log-level", "info", "--dtype", "float32", "--chunked-prefill-size", "64"]
# a pool a few prompts fill, with a sliding part as large as the full one: slots are
# reused soon, in each numbering its own way
SMALL_POOL = ["--max-total-tokens", "640", "--swa-full-tokens-ratio", "1.0"]
# through PD: room for the decoder's reservation of decode tokens beside every prompt;
# pages of 4 tokens, so that windows and held prefixes start and end inside pages
PAGE_SIZE = 4
PD_POOL = [
    *("--max-total-tokens", "2048", "--swa-full-tokens-ratio", "1.0"),
    *("--page-size", str(PAGE_SIZE)),
]
# SGLang's attention window for Mellum: the tokens before the current one it attends to
SGLANG_WINDOW = SLIDING_WINDOW - 1
NEW_TOKENS = transformers_answers.NEW_TOKENS
ROUNDS = 4  # rounds of all prompts at once: the numberings part after a few
PD_ROUNDS = 2
WRITE_DELAY_MS = 60  # per KV write batch: a long prompt (15 chunks) streams for about a second
LONG = 900  # tokens of the prompts aborted mid-transfer and sent after
# shorter than the window (a few tokens) to several windows and chunks long
PROMPTS: list[list[int]] = [
    prompt_ids("Count: 41 42 43"),
    prompt_ids("Days: Friday"),
    prompt_ids("3 + 4 ="),
    *(
        long_prompt_ids(n, start=7 * n)
        for n in (SLIDING_WINDOW - 1, SLIDING_WINDOW + 1, 40, 150, 300)
    ),
]
ABORT_AFTER = long_prompt_ids(LONG, start=60_000)
# long prompts answered with one token (no decode step after their first: nothing of
# theirs is evicted by decoding), then each cut short with a few new tokens: the
# decoder's cache holds the first part, and the window before the cut lies where the
# long prompt's KV never came (only its own window did)
CUT_SOURCES = [long_prompt_ids(n, start=80_000 + n) for n in (150, 300)]
TRUNCATED = [
    [*source[:cut], *long_prompt_ids(5, start=70_000 + cut)]
    for source, cut in zip(CUT_SOURCES, (100, 200), strict=True)
]
CONVERSATION_OPENERS = [long_prompt_ids(30 + 40 * i, start=300 * i + 5) for i in range(2)]
# a prompt whose window crosses the first chunk's end: 71 tokens prefilled (the decoder
# samples the first), window positions from 56 (or 52), the first chunk's 64 tokens
# (after any prefix the prefill server holds) completing some of its pages
STRADDLING = long_prompt_ids(72, start=90_000)


def ask_all(url: str, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return transformers_answers.ask_all(url, prompts, NEW_TOKENS)


@dataclass(frozen=True)
class PdRun:
    rounds: list[list[list[int]]]  # the answers to PROMPTS, round after round
    truncated: list[list[int]]  # the answers to TRUNCATED, after the rounds
    replies: list[list[Reply]]
    tp2_sent: int  # timing lines of the TP2 prefill server: one per rank and request
    failures: dict[str, str]  # rid -> why the decoder failed its transfer (aborts aside)
    pools: PoolStates | None  # None: both pools idle with no leak
    # the layer-wise prefill server's (chunks, window bytes written after the last
    # chunk's forward, whether SGLang renamed the window's pages after it) per request
    state_after: list[tuple[int, int, bool]]
    straddled: Straddled


@dataclass(frozen=True)
class Straddled:
    """STRADDLING, sent as the router sends it to the after-forward TP2 prefill server."""

    answer: list[int]
    # its ranks' (tokens the decoder held, chunks, window bytes written with the first
    # chunk's KV, after the last chunk's forward, whether SGLang renamed the window's
    # pages)
    state: list[tuple[int, int, int, int, bool]]


@dataclass(frozen=True)
class GemmaRun:
    prompts: list[list[int]]  # the prompts, then follow-ups holding them as prefixes
    answers: list[list[int]]
    pools: PoolStates | None  # None: both pools idle with no leak


@dataclass(frozen=True)
class AbortRun:
    """A long prompt aborted at the decoder while its KV streams (writes slowed), then
    another long prompt, which can only get the pages it held."""

    aborted: requests.Response | None  # the decoder's answer to the aborted one
    logged: str  # why the decoder says its transfer failed ("" if it did not)
    after: list[int]  # the next prompt's tokens


@dataclass(frozen=True)
class Runs:
    mono: MonoRun
    pd: PdRun
    abort: AbortRun
    gemma3_pd: GemmaRun
    refused_log: str  # a decoder asked for checksums beside the window: its log, exited


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, patience: Patience) -> Iterator[Runs]:
    """Mellum's monolithic server, a Mellum PD pair and a Gemma 3 PD pair start side by
    side (a start is mostly single-threaded imports), then answer one after the other.
    Out-of-window slots go back to the sliding pool every step, not every 128 tokens
    (the variable reaches every server; only the monolithic one keeps a hybrid pool)."""
    with pytest.MonkeyPatch.context() as patch, contextlib.ExitStack() as stack:
        patch.setenv("SGLANG_SWA_EVICTION_INTERVAL", "1")
        server, mellum, gemma, refused_log = start_side_by_side(
            stack,
            monolithic_server(
                tmp_path_factory.mktemp("mellum-mono"),
                model=TINY_MELLUM_PATH,
                extra=[*COMMON_ARGS, *SMALL_POOL],
                patience=patience,
            ),
            router_pd(
                tmp_path_factory,
                TINY_MELLUM_PATH,
                PD_POOL,
                patience,
                both_sends=True,
                prefill_only=["--pd-inject-write-delay-ms", str(WRITE_DELAY_MS)],
            ),
            router_pd(tmp_path_factory, TINY_GEMMA3_PATH, [], patience),
            refusing_decoder(
                TINY_MELLUM_PATH,
                [*COMMON_ARGS, "--pd-kv-checksum"],
                tmp_path_factory.mktemp("refused"),
                patience,
            ),
        )
        mono = answer_monolithic(
            server, prompts=PROMPTS, rounds=ROUNDS, openers=CONVERSATION_OPENERS
        )
        rounds = [ask_all(mellum.router_url) for _ in range(PD_ROUNDS)]
        transformers_answers.ask_all(mellum.router_url, CUT_SOURCES, 1)
        truncated = ask_all(mellum.router_url, TRUNCATED)
        straddled = straddle(mellum, patience)
        replies = replay(mellum.router_url, mono.conversations, concurrency=2)
        failures = decode_failures([mellum.decode.process.log_path])
        tp2_sent = len(timing_lines(mellum.more_prefills[-1].process.log_path))
        after = [
            (int(line["chunks"]), int(line["state_after"]), bool(line["state_renamed"]))
            for line in timing_lines(mellum.prefill.process.log_path)
        ]
        aborted = abort_mid_transfer(mellum, patience)
        pools = idle_pools(mellum, patience)
        pd = PdRun(rounds, truncated, replies, tp2_sent, failures, pools, after, straddled)
        yield Runs(mono, pd, aborted, gemma_run(gemma, patience), refused_log())


@pytest.fixture(scope="module")
def mono(runs: Runs) -> MonoRun:
    return runs.mono


@pytest.fixture(scope="module")
def pd(runs: Runs) -> PdRun:
    return runs.pd


@pytest.fixture(scope="module")
def gemma3_pd(runs: Runs) -> GemmaRun:
    return runs.gemma3_pd


def test_the_hybrid_pool_on_cpu_reads_the_sliding_layers_right(mono: MonoRun) -> None:
    assert "applying CPU shim: torch_native reads sliding-window layers" in mono.log
    reference = transformers_reference(TINY_MELLUM_PATH, PROMPTS)
    for i, answers in enumerate(mono.rounds):
        assert not wrong_answers(reference, answers), (
            f"round {i}",
            wrong_answers(reference, answers),
        )


def test_the_model_counts_past_its_window(mono: MonoRun) -> None:
    """Trained on counting: a prompt longer than the window still continues the count
    (the full-attention layer and the window's last tokens carry it)."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(TINY_MELLUM_PATH)
    text = tokenizer.decode(mono.rounds[0][0])
    assert text.startswith(" 44 45 46"), text


def router_pd(
    tmp_path_factory: pytest.TempPathFactory,
    model: Path,
    extra: list[str],
    patience: Patience,
    both_sends: bool = False,
    prefill_only: list[str] | None = None,
) -> contextlib.AbstractContextManager[PdCluster]:
    """A prefill and a decode server of `model` (the decoder with its prefix cache, every
    prompt's KV sent) behind the router, all with `extra`, the prefill servers also with
    `prefill_only`; `both_sends`: a second prefill server, the first sending layer-wise
    and the second, a TP2 one, after the forward (the router takes them in turn)."""
    args = [*COMMON_ARGS, *extra]
    prefill = [*args, *(prefill_only or [])]
    more = [[*prefill, "--tp", "2", "--pd-kv-send", "after-forward"]]
    return pd_cluster(
        tmp_path_factory.mktemp(model.name),
        model=model,
        prefill_extra=[*prefill, "--pd-kv-send", "layerwise"] if both_sends else prefill,
        more_prefills=more if both_sends else [],
        decode_extra=[*args, *DECODE_PREFIX_CACHE],
        patience=patience,
    )


def straddle(cluster: PdCluster, patience: Patience) -> Straddled:
    """`Straddled`: the after-forward server is the router's second prefill server."""
    server = cluster.more_prefills[-1]
    argv = server.process.argv
    bootstrap_port = int(argv[argv.index("--disaggregation-bootstrap-port") + 1])
    body = {
        "input_ids": STRADDLING,
        "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS},
    }
    _, answer = send_as_router(
        server.url, cluster.decode.url, bootstrap_port, body, timeout_s=patience.seconds(120)
    )
    answer.raise_for_status()
    state = [
        (int(line["held"]), int(line["chunks"]), int(line["state_early"]),
         int(line["state_after"]), bool(line["state_renamed"]))
        for line in timing_lines(server.process.log_path)
        if line["tokens"] == len(STRADDLING) - 1
    ]  # fmt: skip
    return Straddled([int(t) for t in answer.json()["output_ids"]], state)


def abort_mid_transfer(cluster: PdCluster, patience: Patience) -> AbortRun:
    """`AbortRun`, sent as the router sends it to the layer-wise prefill server (the
    abort is tried earlier each time until one lands before the transfer ended)."""
    answer: requests.Response | None = None
    logged = ""
    for attempt, wait_s in enumerate((0.8, 0.5, 0.3, 0.1)):
        rid = f"swa-abort-{attempt}"
        body = {
            "rid": rid,
            "input_ids": long_prompt_ids(LONG, start=50_000 + 1000 * attempt),
            "sampling_params": {"temperature": 0, "max_new_tokens": 4},
        }
        with ThreadPoolExecutor(1) as pool:
            pending = pool.submit(
                send_as_router,
                cluster.prefill.url,
                cluster.decode.url,
                cluster.bootstrap_port,
                body,
                timeout_s=patience.seconds(120),
            )
            time.sleep(wait_s)  # mid-transfer: the writes are slowed, the forward is not
            abort_at_decoder(cluster.decode.url, rid)
            _prefilled, answer = pending.result(timeout=patience.seconds(150))
        logged = decode_failures([cluster.decode.process.log_path]).get(rid, "")
        if logged:
            break
    after = transformers_answers.ask_all(cluster.router_url, [ABORT_AFTER], NEW_TOKENS)[0]
    return AbortRun(answer, logged, after)


def idle_pools(cluster: PdCluster, patience: Patience) -> PoolStates | None:
    """None once both servers' pools report nothing in use and no leak; else what they
    report when the wait ran out (the test shows it)."""
    servers = {"prefill": cluster.prefill, "decode": cluster.decode}
    states = wait_pools_idle(servers, patience.seconds(60))
    return None if pools_idle(servers, states) else states


def test_through_pd_with_the_hybrid_pool_tokens_are_monolithic(mono: MonoRun, pd: PdRun) -> None:
    for i, answers in enumerate(pd.rounds):
        wrong = mismatches(mono.rounds[0], answers)
        assert not wrong, (f"round {i}", wrong)
    # later turns hold the earlier ones on the decoder: prefixes ending before and
    # inside the last window of the prompt
    assert not wrong_turns(pd.replies), pd.replies
    assert not pd.failures, pd.failures
    assert pd.pools is None, pd.pools


def test_layerwise_each_sliding_layers_window_goes_during_the_forward(pd: PdRun) -> None:
    """The layer-wise prefill server writes each sliding layer's window pages as its
    attention output projection ran: none after the forward, where a chunk carried it -
    unless SGLang's prefix cache swapped a window page for the tree's copy after the
    forward (a prompt seen before: its last page recomputed), when all of it goes again
    from the pages SGLang names (the answers above are monolithic's either way)."""
    carried = [after for chunks, after, renamed in pd.state_after if chunks and not renamed]
    again = [after for chunks, after, renamed in pd.state_after if chunks and renamed]
    assert carried and not any(carried), pd.state_after
    assert all(again), pd.state_after


def test_a_tp2_prefill_server_feeds_the_tp1_decoders_window(pd: PdRun) -> None:
    """The router's second prefill server runs TP2: each of its ranks holds one of the two
    KV heads, and writes that head of every token of the window pages (and of the full
    layer's pages) into the TP1 decoder's, which gathers both (answers checked above)."""
    assert pd.tp2_sent > 0 and pd.tp2_sent % 2 == 0, pd.tp2_sent


# -- a Gemma-3-style model: SGLang keeps its hybrid SWA pool off ----------------------------


def gemma_run(cluster: PdCluster, patience: Patience) -> GemmaRun:
    answers = ask_all(cluster.router_url)
    # follow-ups: each prompt, its answer and a few more tokens, so that the decoder
    # holds the prompt's pages and the prefill server computes the rest
    follow_ups = [
        [*p, *a, *long_prompt_ids(SLIDING_WINDOW // 2 + 3, start=900)]
        for p, a in zip(PROMPTS, answers, strict=True)
    ]
    answers += ask_all(cluster.router_url, follow_ups)
    return GemmaRun([*PROMPTS, *follow_ups], answers, idle_pools(cluster, patience))


def window_page_bytes_per_rank(tp: int) -> int:
    """Bytes of one window page a prefill rank of TP `tp` writes: its KV heads of the
    page's tokens, K and V, in every sliding layer (float32)."""
    config = json.loads((TINY_MELLUM_PATH / "config.json").read_text())
    sliding = config["layer_types"].count("sliding_attention")
    heads = config["num_key_value_heads"] // tp
    return sliding * 2 * PAGE_SIZE * heads * config["head_dim"] * 4


def test_after_the_forward_the_window_pages_of_the_first_chunk_go_with_its_kv(
    pd: PdRun,
) -> None:
    """The after-forward server writes the window pages the first chunk completed with
    that chunk's KV, and only the last chunk's after its forward: together the window's
    pages once each, on each rank its KV head of every page; transformers' tokens."""
    reference = transformers_reference(TINY_MELLUM_PATH, [STRADDLING])
    assert not wrong_answers(reference, [pd.straddled.answer])
    state = pd.straddled.state
    assert len(state) == 2, state  # one line per rank
    page = window_page_bytes_per_rank(tp=2)
    for held, chunks, early, after, renamed in state:
        window = window_pages(held, len(STRADDLING) - 1, SGLANG_WINDOW, PAGE_SIZE)
        assert chunks == 2 and not renamed, state
        assert early > 0 and after > 0 and early + after == len(window) * page, (state, page)


def test_a_gemma3_style_model_through_pd_gives_transformers_tokens(gemma3_pd: GemmaRun) -> None:
    """Gemma 3's sliding layers in SGLang's one plain pool (its hybrid pool is off for
    them): the window is applied in attention only, and the KV moves as any other."""
    reference = transformers_reference(TINY_GEMMA3_PATH, gemma3_pd.prompts)
    wrong = wrong_answers(reference, gemma3_pd.answers)
    assert not wrong, wrong
    assert gemma3_pd.pools is None, gemma3_pd.pools


def test_checksums_beside_the_window_refuse_to_start_and_say_why(runs: Runs) -> None:
    """The keyed sums cover the KV pages, not the window's: refused at start-up."""
    log = runs.refused_log
    assert "--pd-kv-checksum covers the KV pages only" in log and "(swa)" in log, log[-3000:]


def test_a_prefix_held_from_a_longer_prompt_gives_transformers_tokens(pd: PdRun) -> None:
    """The decoder holds the first part of an earlier, longer prompt: of that prompt only
    the window before its end came over, so the window before the cut was never written
    there - the decoder must not serve it from its cache."""
    reference = transformers_reference(TINY_MELLUM_PATH, TRUNCATED)
    assert not wrong_answers(reference, pd.truncated), wrong_answers(reference, pd.truncated)


def test_an_abort_mid_transfer_leaves_pages_the_next_prompt_uses_rightly(runs: Runs) -> None:
    """Aborted at the decoder while its KV (and then its window) streamed: the client
    hears an abort, the next long prompt - in pages the aborted one held, in both page
    spaces - gives transformers' tokens, and the pools are idle after (checked with the
    rounds above)."""
    abort = runs.abort
    assert "aborted" in abort.logged, abort.logged or "every request completed first"
    answer = abort.aborted
    assert answer is not None
    finish = answer.json()["meta_info"]["finish_reason"]["type"] if answer.ok else None
    assert not answer.ok or finish == "abort", answer.text[:300]
    reference = transformers_reference(TINY_MELLUM_PATH, [ABORT_AFTER])
    assert not wrong_answers(reference, [abort.after]), wrong_answers(reference, [abort.after])
    assert runs.pd.pools is None, runs.pd.pools
