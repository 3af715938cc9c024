"""Greedy answers of a bundled model by transformers' own forward, as the e2e tests of
models SGLang serves through the CPU harness judge a server's answers: a departure at a
near tie of the reference's top two tokens is two implementations' rounding, not a wrong
token (`sgl_pd.cluster.campaign.Expected`). Also what those tests run alike: a monolithic
server answering rounds of prompts and conversations, and a decode server that refuses
to start."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from sgl_pd.cluster.campaign import Expected
from sgl_pd.cluster.client import generate_ids
from sgl_pd.cluster.conversations import Conversation, script
from sgl_pd.cluster.local import (
    HOST,
    Patience,
    Server,
    pd_process,
    place_servers,
)
from sgl_pd.cluster.processes import ServerStartError, free_ports, managed

NEW_TOKENS = 16
EOS_IDS = (0, 3)  # <|endoftext|>, <|end|>: where greedy answers may stop


def ask_all(url: str, prompts: list[list[int]], new_tokens: int = NEW_TOKENS) -> list[list[int]]:
    """Every prompt's greedy answer, all sent at once."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda ids: generate_ids(url, ids, new_tokens), prompts))


def until_eos(ids: list[int]) -> list[int]:
    """`ids` up to their first stop token, included (SGLang stops there)."""
    for i, token in enumerate(ids):
        if token in EOS_IDS:
            return ids[: i + 1]
    return ids


def transformers_reference(
    model_path: Path, prompts: list[list[int]], new_tokens: int = NEW_TOKENS
) -> list[Expected]:
    """Greedy continuations of `prompts` by transformers' own model (float32), with each
    step's lead of the chosen token over the next (nats)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    answers = []
    for ids in prompts:
        inputs = torch.tensor([ids])
        with torch.no_grad():
            out = model.generate(
                inputs,
                attention_mask=torch.ones_like(inputs),  # (bos is also the pad token)
                max_new_tokens=new_tokens,
                do_sample=False,
                output_scores=True,
                return_dict_in_generate=True,
            )
        tokens = until_eos([int(t) for t in out.sequences[0, len(ids) :]])
        margins = []
        for scores in out.scores[: len(tokens)]:
            top = torch.topk(torch.log_softmax(scores[0].float(), dim=-1), 2).values
            margins.append(float(top[0] - top[1]))
        answers.append(Expected(tuple(tokens), tuple(margins)))
    return answers


def wrong_answers(
    reference: list[Expected], got: list[list[int]]
) -> list[tuple[int, tuple[int, ...], list[int]]]:
    """The answers that depart from the reference other than at a near tie."""
    return [
        (i, want.tokens, answer)
        for i, (want, answer) in enumerate(zip(reference, got, strict=True))
        if want.judge(until_eos(answer)) == "wrong_tokens"
    ]


def mismatches(
    want: list[list[int]], got: list[list[int]]
) -> list[tuple[int, list[int], list[int]]]:
    """The answers of `got` that differ from `want`'s (each up to its stop token)."""
    return [
        (i, a, b)
        for i, (a, b) in enumerate(zip(want, got, strict=True))
        if until_eos(a) != until_eos(b)
    ]


@dataclass(frozen=True)
class MonoRun:
    rounds: list[list[list[int]]]  # per round, per prompt: the greedy tokens
    conversations: list[Conversation]
    log: str


def answer_monolithic(
    server: Server, *, prompts: list[list[int]], rounds: int, openers: list[list[int]]
) -> MonoRun:
    """`server`'s answers to `rounds` rounds of all `prompts` at once, then to three-turn
    conversations from `openers`."""
    answers = [ask_all(server.url, prompts) for _ in range(rounds)]
    conversations = script(server.url, openers, 3, max_new_tokens=NEW_TOKENS)
    return MonoRun(answers, conversations, server.process.log_path.read_text(errors="replace"))


@contextlib.contextmanager
def refusing_decoder(
    model: Path, extra: list[str], workdir: Path, patience: Patience
) -> Iterator[Callable[[], str]]:
    """Starts a decode server of `model` that should exit before it serves, and yields
    a call that waits for it to and returns its log (the test fails if it serves). It
    needs no peer (`--pd-no-auth`: it refuses before meeting one). Entered beside a
    module's servers (`start_side_by_side`), its start shares theirs."""
    (placement,) = place_servers(1)
    (port,) = free_ports(1)
    args = [*extra, "--pd-no-auth"]
    process = pd_process("decode", "decode", model, port, args, workdir, placement)
    with managed([process]):
        process.start()

        def exited_log() -> str:
            with pytest.raises(ServerStartError, match="exited"):
                process.wait_http_ready(f"http://{HOST}:{port}/health", patience.seconds(240))
            return process.log_path.read_text(errors="replace")

        yield exited_log
