"""Multi-turn workloads in token ids of the bundled model, for measuring a decoder's
prefix cache: scripted conversations, a trace in Mooncake's public format, and probe
prompts. Every request has an exact length (the client sends `ignore_eos`).

- `build_conversations`: a shared system prompt, then per conversation one user message
  per turn; turn t's prompt is turn t-1's prompt, its answer and the new message. Message
  lengths are drawn so that no two prompts share a length, so a prefill's timing line
  (which gives the prompt's length) names its turn (`Conversations.turn_of`).
- `load_trace`: a Mooncake trace (JSONL rows: `timestamp` ms, `input_length`,
  `output_length` tokens, `hash_ids` of 512-token blocks) as requests, lengths and block
  size scaled; one block id is the same token ids wherever it appears, so requests that
  share hash ids share prefixes. `synthetic_trace` writes a small one.
- `probe_requests`: prompts of distinct lengths, sent one at a time.

Streaming them and timing the answers is `sgl_pd.cluster.streaming`'s job.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from sgl_pd.cluster.prompts import long_prompt_ids
from sgl_pd.errors import ConfigError

TRACE_BLOCK_TOKENS = 512  # Mooncake's trace hashes prompts in blocks of this many tokens
# the first token id of every counting text each kind of request is cut from, far apart
# so that no two kinds share a prefix (beyond the tokenizer's BOS)
SYSTEM_START, MESSAGE_START, PROBE_START, WARM_START, TRACE_START = (
    1, 10_000, 500_000, 90_000, 1_000_000
)  # fmt: skip


@dataclass(frozen=True)
class Request:
    """One greedy generation of exactly `max_new_tokens` tokens."""

    key: str  # "c3t1" (conversation 3, turn 1), "trace7", "probe0", "warm2"
    ids: tuple[int, ...]  # the prompt's token ids
    max_new_tokens: int
    arrival_s: float = 0.0  # trace replay: seconds after the replay's start


def message_ids(num_tokens: int, start: int) -> tuple[int, ...]:
    """`num_tokens` ids of a counting text from the number `start`, without the leading
    BOS (a piece to append to a prompt)."""
    return tuple(long_prompt_ids(num_tokens + 1, start)[1:])


@dataclass(frozen=True)
class Conversations:
    """Scripted conversations; their answers come from the server that answers them."""

    system: tuple[int, ...]  # shared first tokens of every prompt (BOS included)
    messages: tuple[tuple[tuple[int, ...], ...], ...]  # [conversation][turn] user ids
    output_tokens: int  # every answer's length

    def turn_of(self) -> dict[int, tuple[int, int]]:
        """Prompt length (tokens) -> (conversation, turn); every length is one prompt's."""
        out = {}
        for c, turns in enumerate(self.messages):
            length = len(self.system)
            for t, message in enumerate(turns):
                length += len(message) + (self.output_tokens if t else 0)
                out[length] = (c, t)
        return out

    def unique_tokens(self) -> int:
        """Tokens a decoder allocates for all of them under a new cache namespace: the
        system prompt once, then every message and every answer."""
        per_turn = sum(len(m) + self.output_tokens for turns in self.messages for m in turns)
        return len(self.system) + per_turn


def build_conversations(
    count: int, turns: int, system_tokens: int, message_range: Sequence[int], output: int, seed: int
) -> Conversations:
    """`count` conversations of `turns` turns: a `system_tokens` system prompt, messages
    of `message_range` (min, max) tokens, answers of `output` tokens, no two prompts of
    one length. Raises ConfigError when the range is too narrow for distinct lengths."""
    rng = random.Random(seed)
    lo, hi = message_range
    taken: set[int] = set()
    messages = []
    for c in range(count):
        for _ in range(1000):  # redraw a conversation whose prompt lengths collide
            sizes = [rng.randint(lo, hi) for _ in range(turns)]
            lengths = {system_tokens + sum(sizes[: t + 1]) + t * output for t in range(turns)}
            if not lengths & taken:
                break
        else:
            raise ConfigError(f"no distinct prompt lengths left: widen --message-tokens {lo} {hi}")
        taken |= lengths
        messages.append(
            tuple(
                message_ids(n, MESSAGE_START + 1000 * (c * turns + t)) for t, n in enumerate(sizes)
            )
        )
    return Conversations(
        tuple(long_prompt_ids(system_tokens, SYSTEM_START)), tuple(messages), output
    )


def synthetic_trace(path: Path, count: int, seed: int) -> Path:
    """Writes `count` rows of a trace in Mooncake's format to `path` and returns it:
    sessions that grow by one or two blocks a turn over a shared first block (the system
    prompt), Poisson arrivals ~2.5 requests/s, answers of 64, 128 or 256 tokens."""
    rng = random.Random(seed)
    sessions: list[list[int]] = []
    next_block, now_ms = 1, 0.0
    with path.open("w") as f:
        for _ in range(count):
            if not sessions or rng.random() < 0.4:
                sessions.append([0])  # a new session: the shared block, then its own
            blocks = rng.choice(sessions)
            added = rng.randint(1, 2)
            blocks += range(next_block, next_block + added)
            next_block += added
            row = {
                "timestamp": int(now_ms),
                "input_length": len(blocks) * TRACE_BLOCK_TOKENS - rng.randrange(256),
                "output_length": rng.choice([64, 128, 256]),
                "hash_ids": list(blocks),
            }
            f.write(json.dumps(row) + "\n")
            now_ms += rng.expovariate(1 / 400)
    return path


def load_trace(path: Path, scale: float, limit: int) -> list[Request]:
    """The first `limit` requests of the trace at `path`, keyed "trace0", ...: lengths and
    block size times `scale` (at least 2 prompt tokens, 1 answer token, 1 token a block),
    arrivals in seconds after the first row's. Block id h is always the same ids (a
    counting text of its own, apart from the conversations'). Raises ConfigError when the
    file has no requests."""
    block = max(1, round(TRACE_BLOCK_TOKENS * scale))
    blocks: dict[int, tuple[int, ...]] = {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()][:limit]
    if not rows:
        raise ConfigError(f"{path}: no requests")
    t0 = rows[0]["timestamp"]
    out = []
    for i, row in enumerate(rows):
        ids = [0]  # BOS, as the tokenizer starts every prompt
        for h in row["hash_ids"]:
            ids += blocks.setdefault(h, message_ids(block, TRACE_START + h * block))
        length = min(len(ids), max(2, round(row["input_length"] * scale)))
        arrival = (row["timestamp"] - t0) / 1e3
        out.append(
            Request(
                f"trace{i}",
                tuple(ids[:length]),
                max(1, round(row["output_length"] * scale)),
                arrival,
            )
        )
    return out


def probe_requests(sizes: Sequence[int]) -> list[Request]:
    """One 4-token request per distinct length in `sizes` (tokens), shortest first, keyed
    "probe0", ...: a timing line names its probe by length."""
    return [
        Request(f"probe{i}", tuple(long_prompt_ids(n, PROBE_START + 1000 * i)), 4)
        for i, n in enumerate(sorted(set(sizes)))
    ]


def warmup_requests(count: int = 4) -> list[Request]:
    """`count` 4-token requests of 64, 128, ... tokens sharing a prefix, keyed "warm0", ...:
    they open connections and meet new batch shapes before anything is measured."""
    return [
        Request(f"warm{i}", tuple(long_prompt_ids(64 * (i + 1), WARM_START)), 4)
        for i in range(count)
    ]
