"""One ordinary SGLang server through sgl_pd's launcher, on CPU, with the bundled model:
greedy text and chat answers equal the stored expectation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgl_pd.cluster.client import chat, complete
from sgl_pd.cluster.local import Server

pytestmark = pytest.mark.e2e

EXPECTED = json.loads((Path(__file__).with_name("expected_outputs.json")).read_text())


@pytest.mark.parametrize("case", EXPECTED["completions"], ids=lambda c: c["prompt"][:24])
def test_text_completion_matches_expectation(mono: Server, case: dict[str, str]) -> None:
    assert complete(mono.url, case["prompt"], max_tokens=case["max_tokens"]) == case["text"]


@pytest.mark.parametrize("case", EXPECTED["chats"], ids=lambda c: c["message"][:24])
def test_chat_completion_matches_expectation(mono: Server, case: dict[str, str]) -> None:
    assert chat(mono.url, case["message"], max_tokens=case["max_tokens"]) == case["text"]


def test_harness_is_announced_in_the_log(mono: Server) -> None:
    log = mono.process.log_path.read_text(errors="replace")
    assert "harness: cpu" in log and "stand-in driver" in log
