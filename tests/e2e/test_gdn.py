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

sgl_pd does not transfer that state yet: a server of the model refuses to start with
one line that says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sgl_pd.cluster.local import Patience
from sgl_pd.cluster.prompts import long_prompt_ids, prompt_ids
from sgl_pd.models import TINY_QWEN3_NEXT_PATH

from .transformers_answers import (
    MonoRun,
    monolithic_answers,
    refused_decoder_log,
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


@pytest.fixture(scope="module")
def mono(tmp_path_factory: pytest.TempPathFactory, patience: Patience) -> Iterator[MonoRun]:
    with monolithic_answers(
        tmp_path_factory.mktemp("qwen3-next-mono"),
        TINY_QWEN3_NEXT_PATH,
        COMMON_ARGS,
        {"SGLANG_MAMBA_CONV_DTYPE": "float32"},
        patience,
        prompts=PROMPTS,
        rounds=ROUNDS,
        openers=CONVERSATION_OPENERS,
    ) as run:
        yield run


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


def test_a_server_of_the_model_refuses_to_start_and_says_why(
    tmp_path: Path, patience: Patience, mono: MonoRun
) -> None:
    """(After the monolithic server: one server at a time on two cores.)"""
    log = refused_decoder_log(TINY_QWEN3_NEXT_PATH, COMMON_ARGS, tmp_path, patience)
    assert "keeps state besides the paged KV cache (mamba" in log, log[-3000:]
