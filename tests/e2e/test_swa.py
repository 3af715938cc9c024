"""Sliding-window models served on CPU and through sgl_pd: the bundled tiny Mellum
(three sliding layers with a window of 16 tokens, one full-attention layer) and tiny
Gemma 3 (five sliding layers, one full).

Monolithic, SGLang keeps the sliding layers in its hybrid SWA pool, with slot numbers of
their own; the CPU harness makes ``torch_native`` read them through those numbers
(`sgl_pd.harness.swa_attention_cpu`). The pool is kept small and out-of-window slots are
freed every step, so that the two numberings part within a few rounds: greedy tokens
must still equal transformers' own forward (a departure at a near tie of its top two
tokens aside).

Through PD the hybrid pool is off on both servers (``--disable-hybrid-swa-memory``): every
layer's KV sits in one pool and moves as pages, the window applied in attention only.
Tokens equal the monolithic server's, for prompts shorter and longer than the window, in
conversations whose later turns hold a prefix on the decoder (hits before and inside the
window), and the pools are idle after. With the hybrid pool on, a server refuses to start
(a decoder here; a prefill server's manager asks the same question), with one line that
names the flag.

Gemma 3 SGLang always serves with the hybrid pool off: through PD, its answers and its
follow-ups' (the decoder holding their prompts) equal transformers'.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from sgl_pd.cluster.conversations import Reply, replay, wrong_turns
from sgl_pd.cluster.local import (
    Patience,
    PdCluster,
    monolithic_server,
    pd_cluster,
    start_side_by_side,
)
from sgl_pd.cluster.logs import PoolStates, pools_idle, wait_pools_idle
from sgl_pd.cluster.prompts import long_prompt_ids, prompt_ids
from sgl_pd.models import TINY_GEMMA3_PATH, TINY_MELLUM_PATH
from sgl_pd.models.train_tiny_moe import SLIDING_WINDOW

from . import transformers_answers
from .conftest import DECODE_PREFIX_CACHE
from .transformers_answers import (
    MonoRun,
    answer_monolithic,
    mismatches,
    refused_decoder_log,
    transformers_reference,
    wrong_answers,
)

pytestmark = pytest.mark.e2e

COMMON_ARGS = ["--log-level", "info", "--dtype", "float32", "--chunked-prefill-size", "64"]
# a pool a few prompts fill, with a sliding part as large as the full one: slots are
# reused soon, in each numbering its own way
SMALL_POOL = ["--max-total-tokens", "640", "--swa-full-tokens-ratio", "1.0"]
NO_HYBRID_POOL = ["--disable-hybrid-swa-memory"]
NEW_TOKENS = transformers_answers.NEW_TOKENS
ROUNDS = 4  # rounds of all prompts at once: the numberings part after a few
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
CONVERSATION_OPENERS = [long_prompt_ids(30 + 40 * i, start=300 * i + 5) for i in range(2)]


def ask_all(url: str, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return transformers_answers.ask_all(url, prompts, NEW_TOKENS)


@dataclass(frozen=True)
class PdRun:
    answers: list[list[int]]
    replies: list[list[Reply]]
    pools: PoolStates | None  # None: both pools idle with no leak


@dataclass(frozen=True)
class GemmaRun:
    prompts: list[list[int]]  # the prompts, then follow-ups holding them as prefixes
    answers: list[list[int]]
    pools: PoolStates | None  # None: both pools idle with no leak


@dataclass(frozen=True)
class Runs:
    mono: MonoRun
    pd: PdRun
    gemma3_pd: GemmaRun


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, patience: Patience) -> Iterator[Runs]:
    """Mellum's monolithic server, a Mellum PD pair and a Gemma 3 PD pair start side by
    side (a start is mostly single-threaded imports), then answer one after the other.
    Out-of-window slots go back to the sliding pool every step, not every 128 tokens
    (the variable reaches every server; only the monolithic one keeps a hybrid pool)."""
    with pytest.MonkeyPatch.context() as patch, contextlib.ExitStack() as stack:
        patch.setenv("SGLANG_SWA_EVICTION_INTERVAL", "1")
        server, mellum, gemma = start_side_by_side(
            stack,
            monolithic_server(
                tmp_path_factory.mktemp("mellum-mono"),
                model=TINY_MELLUM_PATH,
                extra=[*COMMON_ARGS, *SMALL_POOL],
                patience=patience,
            ),
            router_pd(tmp_path_factory, TINY_MELLUM_PATH, NO_HYBRID_POOL, patience),
            router_pd(tmp_path_factory, TINY_GEMMA3_PATH, [], patience),
        )
        mono = answer_monolithic(
            server, prompts=PROMPTS, rounds=ROUNDS, openers=CONVERSATION_OPENERS
        )
        pd = PdRun(
            ask_all(mellum.router_url),
            replay(mellum.router_url, mono.conversations, concurrency=2),
            idle_pools(mellum, patience),
        )
        yield Runs(mono, pd, gemma_run(gemma, patience))


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
    tmp_path_factory: pytest.TempPathFactory, model: Path, extra: list[str], patience: Patience
) -> contextlib.AbstractContextManager[PdCluster]:
    """A prefill and a decode server of `model` (the decoder with its prefix cache, every
    prompt's KV sent) behind the router, both with `extra`."""
    args = [*COMMON_ARGS, *extra]
    return pd_cluster(
        tmp_path_factory.mktemp(model.name),
        model=model,
        prefill_extra=args,
        decode_extra=[*args, *DECODE_PREFIX_CACHE],
        patience=patience,
    )


def idle_pools(cluster: PdCluster, patience: Patience) -> PoolStates | None:
    """None once both servers' pools report nothing in use and no leak; else what they
    report when the wait ran out (the test shows it)."""
    servers = {"prefill": cluster.prefill, "decode": cluster.decode}
    states = wait_pools_idle(servers, patience.seconds(60))
    return None if pools_idle(servers, states) else states


def test_through_pd_without_the_hybrid_pool_tokens_are_monolithic(mono: MonoRun, pd: PdRun) -> None:
    assert not mismatches(mono.rounds[0], pd.answers), mismatches(mono.rounds[0], pd.answers)
    # later turns hold the earlier ones on the decoder: prefixes ending before and
    # inside the last window of the prompt
    assert not wrong_turns(pd.replies), pd.replies
    assert pd.pools is None, pd.pools


def test_with_the_hybrid_pool_a_server_refuses_to_start_and_names_the_flag(
    tmp_path: Path, patience: Patience, gemma3_pd: GemmaRun
) -> None:
    """(Once the servers above answered: a start takes a core.)"""
    log = refused_decoder_log(TINY_MELLUM_PATH, COMMON_ARGS, tmp_path, patience)
    assert "--disable-hybrid-swa-memory" in log, log[-3000:]


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


def test_a_gemma3_style_model_through_pd_gives_transformers_tokens(gemma3_pd: GemmaRun) -> None:
    """Gemma 3's sliding layers in SGLang's one plain pool (its hybrid pool is off for
    them): the window is applied in attention only, and the KV moves as any other."""
    reference = transformers_reference(TINY_GEMMA3_PATH, gemma3_pd.prompts)
    wrong = wrong_answers(reference, gemma3_pd.answers)
    assert not wrong, wrong
    assert gemma3_pd.pools is None, gemma3_pd.pools
