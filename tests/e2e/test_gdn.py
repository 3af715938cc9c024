"""A gated-DeltaNet hybrid served on CPU: the bundled tiny Qwen3-Next (three linear-
attention layers, then a full-attention one; every MLP a MoE with a shared expert).

SGLang keeps each request's linear-attention state - a conv window and a recurrent state
per layer - in its Mamba pool, and runs the layers through five kernels its CPU build
lacks; the CPU harness supplies them in plain torch (`sgl_pd.harness.gdn_kernels_cpu`).
Monolithic, the greedy tokens equal transformers' own forward (a departure at a near tie
of its top two tokens aside) for prompts shorter and longer than a prefill chunk, served
in one batch round after round (slots reused), and in conversations whose later turns
meet their earlier ones in the prefix cache. The conv pool is kept in float32 (SGLang's
default is bfloat16) so that the comparison is exact.

Through PD, the prefill server writes each request's final state - its Mamba slot, one
write per layer and tensor - into the decoder's slot (`sgl_pd.backend.state_slots`):
after the forward with the request's metadata row, or layer-wise during the last chunk's
forward, each linear-attention layer's as it finishes (none is left after the forward).
Two prefill servers behind the router, one streaming the full-attention layer's KV
layer by layer and one sending after the forward, answer
every prompt with the monolithic server's tokens, all at once and round after round;
so do conversations whose later turns the decoder's prefix cache holds part of (its
pages; the state still moves whole), and so does a TP1 prefill server feeding a TP2
decoder, its one rank writing each decode rank's share of its slots (ranks of one TP
size move whole slots, rank to rank, as at TP 1). Local prefill on the
decoder, on by default with its prefix cache, is off for such a model (an extend there
would start the linear-attention layers from a state the decoder's cache does not
keep); asked for by flag, the decoder refuses to start with one line that says so.
Pools are idle after.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

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
from sgl_pd.models import TINY_QWEN3_NEXT_PATH

from .conftest import DECODE_LOCAL_PREFILL
from .transformers_answers import (
    MonoRun,
    answer_monolithic,
    ask_all,
    mismatches,
    refusing_decoder,
    transformers_reference,
    until_eos,
    wrong_answers,
)

pytestmark = pytest.mark.e2e

COMMON_ARGS = [
    "--log-level", "info", "--dtype", "float32", "--chunked-prefill-size", "64",
    "--max-mamba-cache-size", "32",  # (sized from memory otherwise: a large zeroed pool)
]  # fmt: skip
ROUNDS = 3  # rounds of all prompts at once: state slots freed and taken again
PROMPTS: list[list[int]] = [
    prompt_ids("Count: 41 42 43"),
    prompt_ids("Days: Friday"),
    prompt_ids("3 + 4 ="),
    *(long_prompt_ids(n, start=7 * n) for n in (3, 40, 150, 300)),  # 300: five chunks
]
CONVERSATION_OPENERS = [long_prompt_ids(30 + 40 * i, start=300 * i + 5) for i in range(2)]
ENV = {"SGLANG_MAMBA_CONV_DTYPE": "float32"}


@dataclass(frozen=True)
class PdRun:
    rounds: list[list[list[int]]]  # per round, every prompt's answer (all sent at once)
    replies: list[list[Reply]]
    held: list[tuple[int, int]]  # (tokens, held) of each request the prefill servers sent
    modes: set[str]  # the send modes the prefill servers used
    decode_log: str
    pools: PoolStates | None  # None: every pool idle with no leak
    # (mode, chunks, state bytes written after the last chunk's forward) per request
    state_after: list[tuple[str, int, int]]


@dataclass(frozen=True)
class Tp2Run:
    answers: list[list[int]]
    replies: list[list[Reply]]
    sent: int  # timing lines of the prefill server: one per request
    failures: dict[str, str]  # rid -> why the decoder failed its transfer
    pools: PoolStates | None


@dataclass(frozen=True)
class Runs:
    mono: MonoRun
    pd: PdRun
    tp2: Tp2Run
    refused_log: str  # a decoder asked for local prefill: its log, once it exited


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, patience: Patience) -> Iterator[Runs]:
    """A monolithic server, a PD cluster (a decoder with its prefix cache, and two
    prefill servers: layer-wise and after the forward), a TP1 prefill server streaming
    layer by layer into a TP2 decoder, and a decoder asked for local prefill (which
    refuses) start side by side, then answer one after the other."""
    with pytest.MonkeyPatch.context() as patch, contextlib.ExitStack() as stack:
        for name, value in ENV.items():
            patch.setenv(name, value)
        refusal = [*COMMON_ARGS, *DECODE_LOCAL_PREFILL, "--pd-local-prefill-max-tokens", "64"]
        server, cluster, tp2_cluster, refused_log = start_side_by_side(
            stack,
            monolithic_server(
                tmp_path_factory.mktemp("qwen3-next-mono"),
                model=TINY_QWEN3_NEXT_PATH,
                extra=COMMON_ARGS,
                patience=patience,
            ),
            pd_cluster(
                tmp_path_factory.mktemp("qwen3-next-pd"),
                model=TINY_QWEN3_NEXT_PATH,
                prefill_extra=[*COMMON_ARGS, "--pd-kv-send", "layerwise"],
                more_prefills=[[*COMMON_ARGS, "--pd-kv-send", "after-forward"]],
                decode_extra=[*COMMON_ARGS, *DECODE_LOCAL_PREFILL],
                patience=patience,
            ),
            pd_cluster(
                tmp_path_factory.mktemp("qwen3-next-tp2"),
                model=TINY_QWEN3_NEXT_PATH,
                prefill_extra=[*COMMON_ARGS, "--pd-kv-send", "layerwise"],
                decode_extra=[*COMMON_ARGS, "--tp", "2", *DECODE_LOCAL_PREFILL],
                patience=patience,
            ),
            refusing_decoder(
                TINY_QWEN3_NEXT_PATH, refusal, tmp_path_factory.mktemp("refused"), patience
            ),
        )
        mono = answer_monolithic(
            server, prompts=PROMPTS, rounds=ROUNDS, openers=CONVERSATION_OPENERS
        )
        yield Runs(mono, _pd_run(cluster, mono, patience), _tp2_run(tp2_cluster, mono, patience),
                   refused_log())  # fmt: skip


def _pd_run(cluster: PdCluster, mono: MonoRun, patience: Patience) -> PdRun:
    rounds = [ask_all(cluster.router_url, PROMPTS) for _ in range(2)]
    replies = replay(cluster.router_url, mono.conversations, concurrency=2)
    servers = {"prefill": cluster.prefill, "decode": cluster.decode}
    states = wait_pools_idle(servers, patience.seconds(60))
    lines = [
        line
        for prefill in (cluster.prefill, *cluster.more_prefills)
        for line in timing_lines(prefill.process.log_path)
    ]
    return PdRun(
        rounds,
        replies,
        [(int(line["tokens"]), int(line["held"])) for line in lines],
        {str(line["mode"]) for line in lines},
        cluster.decode.process.log_path.read_text(errors="replace"),
        None if pools_idle(servers, states) else states,
        [(str(line["mode"]), int(line["chunks"]), int(line["state_after"])) for line in lines],
    )


def _tp2_run(cluster: PdCluster, mono: MonoRun, patience: Patience) -> Tp2Run:
    """The TP1 prefill server feeding the TP2 decoder: its one rank cuts each decode
    rank's share out of its slots (the recurrent state's heads, the conv state's
    [q | k | v] channels each block in two)."""
    answers = ask_all(cluster.router_url, PROMPTS)
    replies = replay(cluster.router_url, mono.conversations, concurrency=2)
    servers = {"prefill": cluster.prefill, "decode": cluster.decode}
    states = wait_pools_idle(servers, patience.seconds(90))
    return Tp2Run(
        answers,
        replies,
        len(timing_lines(cluster.prefill.process.log_path)),
        decode_failures([cluster.decode.process.log_path]),
        None if pools_idle(servers, states) else states,
    )


@pytest.fixture(scope="module")
def mono(runs: Runs) -> MonoRun:
    return runs.mono


@pytest.fixture(scope="module")
def pd(runs: Runs) -> PdRun:
    return runs.pd


@pytest.fixture(scope="module")
def tp2(runs: Runs) -> Tp2Run:
    return runs.tp2


def test_a_gated_deltanet_model_on_cpu_gives_transformers_tokens(mono: MonoRun) -> None:
    for shim in ("fused_sigmoid_gating_delta_rule_update_cpu (pure torch)", "FusedRMSNormGated"):
        assert shim in mono.log, shim
    reference = transformers_reference(TINY_QWEN3_NEXT_PATH, PROMPTS)
    for i, answers in enumerate(mono.rounds):
        wrong = wrong_answers(reference, answers)
        assert not wrong, (f"round {i}", wrong)


def test_conversation_turns_after_a_prefix_hit_give_transformers_tokens(mono: MonoRun) -> None:
    """Each later turn's prompt holds the earlier turns: their state is in the prefix
    cache, or recomputed - either way the turn's tokens are transformers'."""
    turns = [turn for conversation in mono.conversations for turn in conversation]
    prompts = [list(turn.prompt) for turn in turns]  # type: ignore[arg-type]
    answers = [list(turn.expected.tokens) for turn in turns]
    reference = transformers_reference(TINY_QWEN3_NEXT_PATH, prompts)
    wrong = wrong_answers(reference, [until_eos(a) for a in answers])
    assert not wrong, wrong


def test_the_model_counts(mono: MonoRun) -> None:
    """Trained on counting: the linear-attention layers carry the count."""
    from transformers import PreTrainedTokenizerFast

    tokenizer = PreTrainedTokenizerFast.from_pretrained(TINY_QWEN3_NEXT_PATH)
    text = tokenizer.decode(mono.rounds[0][0])
    assert text.startswith(" 44 45 46"), text


def test_through_pd_the_state_moves_and_tokens_are_monolithic(mono: MonoRun, pd: PdRun) -> None:
    for i, answers in enumerate(pd.rounds):
        assert not mismatches(mono.rounds[0], answers), (
            f"round {i}",
            mismatches(mono.rounds[0], answers),
        )
    assert pd.modes == {"layerwise", "after_forward"}, pd.modes
    assert "local prefill on" not in pd.decode_log
    assert pd.pools is None, pd.pools


def test_layerwise_each_linear_attention_layers_state_goes_during_the_forward(pd: PdRun) -> None:
    """The layer-wise prefill server writes each gated-DeltaNet layer's conv and
    recurrent state as its output projection ran: none after the forward, where a chunk
    carried it (a decoder holding every page gets the state after the forward)."""
    layerwise = [after for mode, chunks, after in pd.state_after if mode == "layerwise" and chunks]
    after_forward = [after for mode, _chunks, after in pd.state_after if mode == "after_forward"]
    assert layerwise and not any(layerwise), pd.state_after
    assert after_forward and all(after_forward), pd.state_after


def test_through_pd_conversations_hold_prefixes_and_match(pd: PdRun) -> None:
    """Later turns: the decoder holds their earlier turns' pages, the rest of the KV and
    the whole state move, and every turn has the monolithic server's tokens."""
    assert not wrong_turns(pd.replies), pd.replies
    assert any(held > 0 for _tokens, held in pd.held), pd.held


def test_a_tp1_prefill_server_feeds_each_tp2_rank_its_share_of_the_state(
    mono: MonoRun, tp2: Tp2Run
) -> None:
    assert not mismatches(mono.rounds[0], tp2.answers), mismatches(mono.rounds[0], tp2.answers)
    assert not wrong_turns(tp2.replies), tp2.replies
    turns = sum(len(r) for r in tp2.replies)
    assert tp2.sent == len(PROMPTS) + turns, tp2.sent
    assert not tp2.failures, tp2.failures
    assert tp2.pools is None, tp2.pools


def test_a_decoder_asked_for_local_prefill_refuses_to_start_and_says_why(runs: Runs) -> None:
    log = runs.refused_log
    assert "is not served with a model with Mamba / linear-attention state" in log, log[-3000:]
