"""Multi-turn conversations, the traffic a decoder's prefix cache is for: each turn's
prompt is the previous turn's prompt, its answer and a new message, so a decoder that
served the previous turn already holds most of the next one's KV - the answer's part
only it ever computed.

A conversation is scripted once on a reference (monolithic) server, turn by turn from
that server's own greedy answers (`script`), then replayed on the server under test,
turn after turn (`replay`): every turn is judged against the reference's tokens, a first
departure at a near tie of the reference's top two tokens counting as `near_tie`
(`campaign.Expected`). Used by the end-to-end tests; `benchmarks/bench_multiturn.py`
streams its requests (for TTFT) with `sgl_pd.cluster.streaming`.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import requests

from sgl_pd.cluster.campaign import REQUEST_TIMEOUT_S, Expected, expected_answer
from sgl_pd.cluster.prompts import prompt_ids


@dataclass(frozen=True)
class Turn:
    # token ids, or a text (as chat clients send; a router routes texts by prefix)
    prompt: tuple[int, ...] | str
    expected: Expected  # the reference server's greedy answer, with its margins
    meta: dict[str, Any] = field(default_factory=dict)  # the reference's meta_info


@dataclass(frozen=True)
class Reply:
    """One turn as the server under test answered it."""

    verdict: str  # "ok", "near_tie" or "wrong_tokens" against the reference
    tokens: tuple[int, ...]
    meta: dict[str, Any]  # SGLang's meta_info (speculative counts, ...)


Conversation = list[Turn]


def follow_up_text(conversation: int, turn: int) -> str:
    """The new message of a turn after the first, different for every turn."""
    return f" Then {conversation * 7 + turn + 2} and"


def follow_up(conversation: int, turn: int) -> list[int]:
    """`follow_up_text` as token ids (without the tokenizer's start token)."""
    ids, start = prompt_ids(follow_up_text(conversation, turn)), prompt_ids("")
    return ids[len(start) :] if ids[: len(start)] == start else ids


def script(
    url: str,
    openers: Sequence[Sequence[int] | str],
    turns: int,
    max_new_tokens: int,
    *,
    concurrency: int = 8,
) -> list[Conversation]:
    """One conversation per opener (its first prompt: token ids or a text), `turns` turns
    each, answered by the reference server at `url`; conversations run side by side,
    turns in order. A text conversation grows by texts (the answer's, the message's)."""

    def one(index: int) -> Conversation:
        opener, out = openers[index], []
        prompt: tuple[int, ...] | str = opener if isinstance(opener, str) else tuple(opener)
        for turn in range(turns):
            expected, meta = expected_answer(url, prompt, max_new_tokens)
            out.append(Turn(prompt, expected, meta))
            if isinstance(prompt, str):
                prompt = prompt + str(meta["text"]) + follow_up_text(index, turn)
            else:
                prompt = prompt + expected.tokens + tuple(follow_up(index, turn))
        return out

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, range(len(openers))))


def replay(
    url: str, conversations: Sequence[Conversation], *, concurrency: int = 8
) -> list[list[Reply]]:
    """Each conversation's turns asked of the server under test in order (conversations
    side by side), greedy, each judged against the reference."""

    def ask(turn: Turn) -> Reply:
        response = requests.post(
            f"{url}/generate",
            json={
                **(
                    {"text": turn.prompt}
                    if isinstance(turn.prompt, str)
                    else {"input_ids": list(turn.prompt)}
                ),
                "sampling_params": {
                    "temperature": 0,
                    "max_new_tokens": len(turn.expected.tokens),
                },
            },
            timeout=REQUEST_TIMEOUT_S,
        )
        response.raise_for_status()
        body = response.json()
        tokens = tuple(int(t) for t in body["output_ids"])
        return Reply(turn.expected.judge(tokens), tokens, body["meta_info"])

    def one(conversation: Conversation) -> list[Reply]:
        return [ask(turn) for turn in conversation]

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        return list(pool.map(one, conversations))


def wrong_turns(replies: Sequence[Sequence[Reply]]) -> list[tuple[int, int, str]]:
    """(conversation, turn, verdict) of every turn that is neither ok nor a near tie."""
    return [
        (c, t, r.verdict)
        for c, turns in enumerate(replies)
        for t, r in enumerate(turns)
        if r.verdict not in ("ok", "near_tie")
    ]
