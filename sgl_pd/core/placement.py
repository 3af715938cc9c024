"""Which prefill server a decoder's request will get its first token from soonest (direct
mode): the one with the least predicted prefill time - the prompt tokens queued there,
plus the tokens it would have to compute for this prompt given the prefix it already
caches, at its measured rate.

What a prefill server caches is known from what this decoder sent it (`SentPrefixes`):
each prompt is cut into blocks of `block_tokens`, each block named by a hash of the whole
prefix up to its end, so a prompt's cached part is its longest run of leading blocks
sent there before. The model forgets the oldest blocks beyond a bound, as the server's
radix cache evicts; it cannot see what other decoders sent, nor evictions under memory
pressure, so a prediction may be optimistic - a wrong guess costs one prefill, never a
wrong answer.

A server's rate is measured from the requests it served (`RateEstimate`): seconds from
submission to the first token over the tokens predicted to compute, smoothed. Pure: the
standard library only.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from sgl_pd.core.dispatch import PrefillerLoad

BLOCK_TOKENS = 64  # prefix granularity of the model (SGLang's radix cache is finer)
MAX_BLOCKS_PER_SERVER = 1 << 16  # ~4M prompt tokens remembered per prefill server
# seconds per prompt token assumed before a server served a request: every server alike,
# so the first choices go by queued and cached tokens alone
PRIOR_S_PER_TOKEN = 1e-4
RATE_SMOOTHING = 0.2  # weight of the newest measurement
MIN_MEASURED_TOKENS = 32  # a measurement over fewer tokens is mostly overhead: ignored


def prefix_blocks(token_ids: Sequence[int], block_tokens: int = BLOCK_TOKENS) -> list[bytes]:
    """The names of the prompt's whole leading blocks: block i's hash covers tokens
    [0, (i + 1) * block_tokens), so two prompts share block i only if they share all of
    it and everything before. Each token is hashed as 4 bytes, little-endian: converted
    at C speed (`array`: a 32k-token prompt in well under a millisecond, where a Python
    loop over its tokens took 9 ms of the HTTP process), OverflowError for a token of a
    whole block outside [0, 2**32) (TypeError for one not an integer)."""
    whole = token_ids[: len(token_ids) - len(token_ids) % block_tokens]
    if isinstance(whole, (bytes, bytearray)):
        whole = list(whole)  # (a text prompt's bytes, each a unit, not raw words)
    units = array(_UINT32, whole)
    if sys.byteorder != "little":
        units.byteswap()
    data = units.tobytes()
    names = []
    h = hashlib.blake2b(digest_size=16)
    step = 4 * block_tokens
    for start in range(0, len(data), step):
        h.update(data[start : start + step])
        names.append(h.copy().digest())
    return names


# the array typecode of a 4-byte unsigned int (C's unsigned int, or long where that is 4)
_UINT32 = next(code for code in ("I", "L") if array(code).itemsize == 4)


class SentPrefixes:
    """Per prefill server, the prefix blocks this decoder sent it (oldest forgotten first)."""

    def __init__(self, max_blocks: int = MAX_BLOCKS_PER_SERVER) -> None:
        self._max_blocks = max_blocks
        self._sent: dict[str, OrderedDict[bytes, None]] = {}

    def cached_blocks(self, addr: str, blocks: Sequence[bytes]) -> int:
        """How many of the prompt's leading blocks `addr` is expected to hold."""
        sent = self._sent.get(addr)
        run = 0
        while sent and run < len(blocks) and blocks[run] in sent:
            run += 1
        return run

    def record(self, addr: str, blocks: Sequence[bytes]) -> None:
        """`addr` prefills a prompt of these blocks: it will hold them."""
        sent = self._sent.setdefault(addr, OrderedDict())
        for name in blocks:
            sent.pop(name, None)
            sent[name] = None
        while len(sent) > self._max_blocks:
            sent.popitem(last=False)

    def forget(self, addr: str) -> None:
        """`addr` restarted or left: its cache is gone."""
        self._sent.pop(addr, None)


class HeldTails:
    """What a decoder's prefix cache holds to the token after each block of the
    conversations it served (the blocks say whole blocks only): after each block, the
    conversation's tokens up to its next block boundary - the next block, or past the
    last one its tail. Keyed by that block (the latest conversation through it kept;
    oldest forgotten first). So a prompt is held to the token both where it goes on
    with a conversation (a follow-up turn) and where it ends inside one (a retry, or a
    stream sending its prompt again). Kept as 64-bit ints (up to `BLOCK_TOKENS` of them:
    about 0.8 KiB an entry with its key and place in the table, 50 MiB at the default
    bound - which is one entry per block served, about 4M tokens - where tuples of
    Python ints would take three times that)."""

    def __init__(self, max_tails: int = MAX_BLOCKS_PER_SERVER) -> None:
        self._max_tails = max_tails
        # after a block: the name of the whole block that follows (b"" for a partial
        # tail) and its tokens
        self._tails: OrderedDict[bytes, tuple[bytes, array[int]]] = OrderedDict()

    def record(self, conversation: PromptKey) -> None:
        """`conversation` was served: each of its blocks' tails is its now. A tail that
        is the whole next block, as kept already, is the same tokens (the block's name
        covers them) and is only marked recent: each turn of a long conversation builds
        its new blocks' tails alone, not every block's again."""
        if not conversation.ids:
            return  # (text: no tokens to compare)
        blocks = conversation.blocks
        for i in range(len(blocks) + 1):
            key = blocks[i - 1] if i else b""
            following = blocks[i] if i < len(blocks) else b""
            kept = self._tails.get(key)
            if kept is None or not following or kept[0] != following:
                start = i * BLOCK_TOKENS
                tail = array("q", conversation.ids[start : start + BLOCK_TOKENS])
                self._tails[key] = (following, tail)
            self._tails.move_to_end(key)
        while len(self._tails) > self._max_tails:
            self._tails.popitem(last=False)

    def held_tokens(self, prompt: PromptKey, blocks_held: int) -> int:
        """Of `prompt`, whose first `blocks_held` whole blocks are held, the tokens
        held: those blocks, and as many of its tokens after them as a conversation
        served through the last of them had there."""
        start = blocks_held * BLOCK_TOKENS
        kept = self._tails.get(prompt.blocks[blocks_held - 1] if blocks_held else b"")
        tail = kept[1] if kept is not None else array("q")
        common = 0
        for held, token in zip(tail, prompt.ids[start:], strict=False):
            if held != token:
                break
            common += 1
        return start + common


@dataclass
class RateEstimate:
    """A prefill server's seconds per computed prompt token, smoothed."""

    s_per_token: float = PRIOR_S_PER_TOKEN
    measured: bool = False

    def observe(self, seconds: float, tokens: int) -> None:
        if tokens < MIN_MEASURED_TOKENS or seconds <= 0:
            return
        sample = seconds / tokens
        if not self.measured:
            self.s_per_token, self.measured = sample, True
        else:
            self.s_per_token += RATE_SMOOTHING * (sample - self.s_per_token)


@dataclass(frozen=True)
class Prediction:
    """Why a server was chosen: its predicted seconds to the first token, and parts."""

    addr: str
    seconds: float
    queued_tokens: int
    cached_tokens: int
    computed_tokens: int  # the prompt's tokens it would compute


def predict(
    addr: str, prompt_tokens: int, queued_tokens: int, cached_tokens: int, rate: RateEstimate
) -> Prediction:
    computed = max(0, prompt_tokens - cached_tokens)
    seconds = (max(0, queued_tokens) + computed) * rate.s_per_token
    return Prediction(addr, seconds, queued_tokens, cached_tokens, computed)


def fastest(predictions: Sequence[Prediction], turn: int = 0) -> Prediction | None:
    """The prediction with the fewest seconds; exact ties rotate by `turn` (equal servers
    share the load)."""
    if not predictions:
        return None
    best = min(p.seconds for p in predictions)
    tied = sorted((p for p in predictions if p.seconds == best), key=lambda p: p.addr)
    return tied[turn % len(tied)]


@dataclass(frozen=True)
class PromptKey:
    """A prompt as the placement sees it: its prefix blocks over `units` (token ids, or
    the UTF-8 bytes of a text prompt not tokenized yet), its size in tokens, and its
    token ids where it came as ids (empty for text), and how much of it any cache may
    serve (`reusable`): SGLang computes every prompt token from a request's
    `logprob_start_len` on, whatever its cache holds (their logprobs are asked for)."""

    blocks: tuple[bytes, ...]
    tokens: int
    ids: tuple[int, ...] = ()
    reusable: int | None = None  # leading tokens a cache may serve; None: no bound

    @classmethod
    def of_ids(cls, ids: Sequence[int], reusable: int | None = None) -> PromptKey:
        return cls(tuple(prefix_blocks(ids)), len(ids), tuple(ids), reusable)

    @classmethod
    def of_text(cls, text: str, chars_per_token: int, reusable: int | None = None) -> PromptKey:
        data = text.encode()
        blocks = prefix_blocks(data, BLOCK_TOKENS * chars_per_token)
        return cls(tuple(blocks), len(data) // chars_per_token + 1, reusable=reusable)

    def cached_tokens(self, prefixes: SentPrefixes, addr: str) -> int:
        """The prompt tokens `addr` is expected to serve from its cache (a block is
        about `BLOCK_TOKENS` tokens either way)."""
        held = prefixes.cached_blocks(addr, self.blocks) * BLOCK_TOKENS
        return self.served_of(min(self.tokens, held))

    def served_of(self, held: int) -> int:
        """Of `held` leading tokens a cache holds, those it serves this prompt."""
        return held if self.reusable is None else max(0, min(held, self.reusable))


def choose_prefiller(
    loads: Mapping[str, PrefillerLoad],
    prompt: PromptKey,
    prefixes: SentPrefixes,
    rates: MutableMapping[str, RateEstimate],
    *,
    exclude: Sequence[str] = (),
    turn: int = 0,
) -> Prediction | None:
    """The available prefill server predicted to give `prompt` its first token soonest,
    or None when none is available; `exclude`: addresses that just refused it."""
    measured = [r.s_per_token for r in rates.values() if r.measured]
    # a server not measured yet is taken to be as fast as the measured ones on average:
    # the prior alone would make it look faster than any that has served a request
    typical = RateEstimate(sum(measured) / len(measured)) if measured else RateEstimate()
    predictions = [
        predict(
            addr,
            prompt.tokens,
            load.outstanding_tokens,
            prompt.cached_tokens(prefixes, addr),
            rate if (rate := rates.setdefault(addr, RateEstimate())).measured else typical,
        )
        for addr, load in sorted(loads.items())
        if load.available and addr not in exclude
    ]
    return fastest(predictions, turn)


# A decoder prefills a prompt itself only when it holds at least this part of it (the
# rest, its uncached suffix, is then at most 70%): a fresh prompt is the prefill
# servers' work, unless none of them can take it soon.
LOCAL_MIN_CACHED_FRACTION = 0.3
LOCAL_REASONS = ("cached_prefix", "saturated", "unavailable")


def prefill_locally(
    prompt_tokens: int,
    cached_tokens: int,
    *,
    max_tokens: int,
    loads: Mapping[str, PrefillerLoad],
    saturated_tokens: int,
) -> str | None:
    """Why the decoder should prefill this prompt itself (one of `LOCAL_REASONS`), or
    None when a prefill server should. Only a suffix of at most `max_tokens` uncached
    tokens (0 = never) is prefilled locally: when the decoder holds the rest of the
    prompt (`cached_prefix`), or whatever it holds when every prefill server has at
    least `saturated_tokens` queued (`saturated`) or none is available (`unavailable`)."""
    uncached = max(0, prompt_tokens - cached_tokens)
    if max_tokens <= 0 or uncached > max_tokens:
        return None
    if cached_tokens > 0 and cached_tokens >= LOCAL_MIN_CACHED_FRACTION * prompt_tokens:
        return "cached_prefix"
    available = [load for load in loads.values() if load.available]
    if not available:
        return "unavailable"
    if all(load.outstanding_tokens >= saturated_tokens for load in available):
        return "saturated"
    return None


# The low 16 bits of every bootstrap room a decoder makes for its own direct-mode
# requests: its scheduler then leaves their placement to the decision already taken
# (a router's random room carries them by chance once in 65536: not prefilled locally).
DIRECT_ROOM_TAG = 0x5D16


def direct_room(random_bits: int) -> int:
    """A bootstrap room for a direct-mode request, from 63 random bits."""
    return (random_bits & ~0xFFFF & ((1 << 63) - 1)) | DIRECT_ROOM_TAG


def is_direct_room(room: int) -> bool:
    return room & 0xFFFF == DIRECT_ROOM_TAG
