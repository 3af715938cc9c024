"""The bundled MoE models on ordinary SGLang servers on CPU, one server at a time: tiny
DeepSeek-V3 (MLA) without and with NEXTN speculative decoding (its trained MTP layer as the
draft), and tiny Qwen3-MoE.

Each fixture starts its server, collects every answer the tests look at, and stops it
before the next one starts (2 cores)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from sgl_pd.cluster.client import REQUEST_TIMEOUT_S
from sgl_pd.cluster.local import Patience, Server, monolithic_server
from sgl_pd.models import TINY_DEEPSEEK_V3_PATH, TINY_QWEN3_MOE_PATH

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


@dataclass(frozen=True)
class Run:
    """What one server answered: per prompt, the greedy text and SGLang's meta_info."""

    texts: list[str]
    meta: list[dict[str, Any]]
    log: str


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


def serve_and_ask(log_dir: Path, model: Path, extra: list[str], patience: Patience) -> Run:
    with monolithic_server(log_dir, model=model, extra=extra, patience=patience) as server:
        texts, meta = generate(server, PROMPTS)
        # once more, one prompt at a time: batching must not change greedy text
        singles = [generate(server, [p])[0][0] for p in PROMPTS]
        assert singles == texts, (singles, texts)
        log = server.process.log_path.read_text(errors="replace")
    return Run(texts, meta, log)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory, patience: Patience) -> Iterator[Run]:
    yield serve_and_ask(
        tmp_path_factory.mktemp("deepseek"), TINY_DEEPSEEK_V3_PATH, COMMON_ARGS, patience
    )


@pytest.fixture(scope="module")
def deepseek_nextn(tmp_path_factory: pytest.TempPathFactory, patience: Patience) -> Iterator[Run]:
    yield serve_and_ask(
        tmp_path_factory.mktemp("deepseek-nextn"),
        TINY_DEEPSEEK_V3_PATH,
        [*COMMON_ARGS, *NEXTN_ARGS],
        patience,
    )


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory: pytest.TempPathFactory, patience: Patience) -> Iterator[Run]:
    yield serve_and_ask(
        tmp_path_factory.mktemp("qwen3-moe"), TINY_QWEN3_MOE_PATH, COMMON_ARGS, patience
    )


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
