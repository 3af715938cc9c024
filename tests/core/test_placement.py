"""Choosing the prefill server that gives a request its first token soonest (direct
mode, pure): queued tokens, plus what it must compute given the prefix it caches, at its
measured rate."""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_pd.core.dispatch import PrefillerLoad
from sgl_pd.core.placement import (
    BLOCK_TOKENS,
    MIN_MEASURED_TOKENS,
    HeldTails,
    PromptKey,
    RateEstimate,
    SentPrefixes,
    choose_prefiller,
    prefix_blocks,
)

LONG = list(range(1000, 1000 + 8 * BLOCK_TOKENS))  # a long shared prefix: 8 blocks


def _choose(loads, prompt, prefixes, rates=None, **kw):  # type: ignore[no-untyped-def]
    chosen = choose_prefiller(loads, prompt, prefixes, {} if rates is None else rates, **kw)
    return None if chosen is None else chosen.addr


def test_a_repeat_of_a_long_prefix_goes_where_it_was_computed() -> None:
    loads = {"a:1": PrefillerLoad(True, 0), "b:1": PrefillerLoad(True, 0)}
    prefixes = SentPrefixes()
    prefixes.record("b:1", PromptKey.of_ids([*LONG, 1, 2, 3]).blocks)
    follow_up = PromptKey.of_ids([*LONG, 7, 8, 9, 10])
    for turn in range(4):  # not a tie any more: every turn picks b
        assert _choose(loads, follow_up, prefixes, turn=turn) == "b:1"
    chosen = choose_prefiller(loads, follow_up, prefixes, {})
    assert chosen is not None and chosen.cached_tokens == len(LONG)
    assert chosen.computed_tokens == 4


def test_a_busy_server_loses_even_with_the_prefix() -> None:
    """Cached tokens save their computation, not the queue in front of them."""
    prefixes = SentPrefixes()
    prefixes.record("b:1", PromptKey.of_ids(LONG).blocks)
    loads = {"a:1": PrefillerLoad(True, 0), "b:1": PrefillerLoad(True, 10 * len(LONG))}
    assert _choose(loads, PromptKey.of_ids([*LONG, 5]), prefixes) == "a:1"


def test_a_fresh_prompt_goes_to_the_least_loaded_and_ties_take_turns() -> None:
    prefixes = SentPrefixes()
    loads = {
        "a:1": PrefillerLoad(True, 500),
        "b:1": PrefillerLoad(True, 100),
        "c:1": PrefillerLoad(False, 0),  # down: never chosen
    }
    fresh = PromptKey.of_ids(list(range(300)))
    assert _choose(loads, fresh, prefixes) == "b:1"
    assert _choose(loads, fresh, prefixes, exclude=["b:1"]) == "a:1"
    assert _choose(loads, fresh, prefixes, exclude=["a:1", "b:1"]) is None
    even = {"a:1": PrefillerLoad(True, 0), "b:1": PrefillerLoad(True, 0)}
    assert {_choose(even, fresh, prefixes, turn=t) for t in range(4)} == {"a:1", "b:1"}


def test_a_measured_slow_server_gets_less() -> None:
    prefixes = SentPrefixes()
    loads = {"a:1": PrefillerLoad(True, 0), "b:1": PrefillerLoad(True, 0)}
    rates = {"a:1": RateEstimate(), "b:1": RateEstimate()}
    rates["a:1"].observe(1.0, 1000)  # 1 ms per token
    rates["b:1"].observe(0.1, 1000)  # 0.1 ms per token
    loads["b:1"] = PrefillerLoad(True, 5000)  # busier, but ten times faster
    assert _choose(loads, PromptKey.of_ids(list(range(1000))), prefixes, rates) == "b:1"


def test_a_prefix_shares_blocks_only_when_everything_before_matches() -> None:
    a = prefix_blocks([1] * BLOCK_TOKENS + [2] * BLOCK_TOKENS)
    b = prefix_blocks([1] * BLOCK_TOKENS + [3] * BLOCK_TOKENS)
    c = prefix_blocks([9] + [1] * (BLOCK_TOKENS - 1) + [2] * BLOCK_TOKENS)
    assert a[0] == b[0] and a[1] != b[1]
    assert c[0] != a[0] and c[1] != a[1]  # block 1's tokens equal, its prefix not
    assert prefix_blocks([1] * (BLOCK_TOKENS - 1)) == []  # no whole block


@given(
    st.lists(st.integers(0, 2**32 - 1), max_size=300),
    st.integers(1, 70),
    st.one_of(st.none(), st.integers(-(2**40), -1), st.integers(2**32, 2**40)),
)
def test_each_block_is_named_by_every_token_up_to_its_end(
    tokens: list[int], block_tokens: int, out_of_range: int | None
) -> None:
    """The names are the chained hash of each token as 4 bytes, little-endian - as a
    token-by-token loop computes them; a token past the last whole block is not read
    (a prompt's partial tail may hold anything), one inside a whole block outside
    [0, 2**32) raises OverflowError."""
    h, expected = hashlib.blake2b(digest_size=16), []
    for i, token in enumerate(tokens[: len(tokens) - len(tokens) % block_tokens]):
        h.update(token.to_bytes(4, "little"))
        if (i + 1) % block_tokens == 0:
            expected.append(h.copy().digest())
    assert prefix_blocks(tokens, block_tokens) == expected
    assert prefix_blocks(tuple(tokens), block_tokens) == expected
    assert prefix_blocks(bytes(t % 256 for t in tokens), block_tokens) == prefix_blocks(
        [t % 256 for t in tokens], block_tokens
    )
    if out_of_range is not None:
        whole = len(tokens) - len(tokens) % block_tokens
        past_the_blocks = [*tokens[:whole], out_of_range]
        if block_tokens > 1:
            assert prefix_blocks(past_the_blocks, block_tokens) == expected
        with pytest.raises(OverflowError):
            prefix_blocks([out_of_range, *tokens], 1)


def test_a_prompt_whose_logprobs_are_asked_is_served_from_a_cache_up_to_their_start() -> None:
    prefixes = SentPrefixes()
    prefixes.record("b:1", PromptKey.of_ids(LONG).blocks)
    assert PromptKey.of_ids([*LONG, 1]).cached_tokens(prefixes, "b:1") == len(LONG)
    assert PromptKey.of_ids([*LONG, 1], reusable=100).cached_tokens(prefixes, "b:1") == 100
    assert PromptKey.of_ids([*LONG, 1], reusable=0).cached_tokens(prefixes, "b:1") == 0
    text = PromptKey.of_text("You are a helpful assistant. " * 40, 4, reusable=10)
    prefixes.record("b:1", text.blocks)
    assert text.cached_tokens(prefixes, "b:1") == 10


def test_text_prompts_share_prefixes_too() -> None:
    prefixes = SentPrefixes()
    history = "You are a helpful assistant. " * 40
    prefixes.record("b:1", PromptKey.of_text(history + "First question?", 4).blocks)
    follow_up = PromptKey.of_text(history + "Second question?", 4)
    assert follow_up.cached_tokens(prefixes, "b:1") >= BLOCK_TOKENS
    assert follow_up.cached_tokens(prefixes, "a:1") == 0


def test_what_a_server_is_remembered_to_hold_is_bounded_and_forgotten_on_restart() -> None:
    prefixes = SentPrefixes(max_blocks=4)
    first = PromptKey.of_ids(list(range(3 * BLOCK_TOKENS)))
    second = PromptKey.of_ids(list(range(10_000, 10_000 + 3 * BLOCK_TOKENS)))
    prefixes.record("b:1", first.blocks)
    prefixes.record("b:1", second.blocks)
    assert first.cached_tokens(prefixes, "b:1") == 0  # its first block was evicted
    assert second.cached_tokens(prefixes, "b:1") == 3 * BLOCK_TOKENS
    prefixes.forget("b:1")
    assert second.cached_tokens(prefixes, "b:1") == 0


def test_rate_measurements_over_a_few_tokens_are_ignored() -> None:
    rate = RateEstimate()
    prior = rate.s_per_token
    rate.observe(5.0, MIN_MEASURED_TOKENS - 1)
    assert rate.s_per_token == prior and not rate.measured


@given(
    st.dictionaries(
        st.sampled_from(["a:1", "b:2", "c:3", "d:4"]),
        st.builds(PrefillerLoad, st.booleans(), st.integers(0, 10_000)),
    ),
    st.integers(0, 10),
    st.integers(1, 4 * BLOCK_TOKENS),
)
def test_the_choice_is_never_predicted_slower_than_another_available_server(  # type: ignore[no-untyped-def]
    loads, turn, prompt_tokens
) -> None:
    prompt = PromptKey.of_ids(list(range(prompt_tokens)))
    prefixes = SentPrefixes()
    prefixes.record("b:2", prompt.blocks)
    rates: dict[str, RateEstimate] = {}
    chosen = choose_prefiller(loads, prompt, prefixes, rates, turn=turn)
    up = [a for a, load in loads.items() if load.available]
    if not up:
        assert chosen is None
        return
    assert chosen is not None and chosen.addr in up
    others = [choose_prefiller(loads, prompt, prefixes, rates, exclude=[a for a in up if a != o])
              for o in up]  # fmt: skip
    assert chosen.seconds == min(o.seconds for o in others if o is not None)


def test_a_server_not_measured_yet_is_taken_as_fast_as_the_measured_ones() -> None:
    """The one that served the conversation's first turn has a measured rate (with
    every overhead of a first token in it); the other, none yet: the prefix still wins."""
    prefixes = SentPrefixes()
    prompt = PromptKey.of_ids([*LONG, 1, 2, 3])
    prefixes.record("a:1", PromptKey.of_ids(LONG).blocks)
    rates = {"a:1": RateEstimate()}
    rates["a:1"].observe(2.0, len(LONG))  # 4 ms per token, overheads included
    loads = {"a:1": PrefillerLoad(True, 0), "b:1": PrefillerLoad(True, 0)}
    assert _choose(loads, prompt, prefixes, rates) == "a:1"


def _local(prompt: int, cached: int, loads=None, **kw):  # type: ignore[no-untyped-def]
    from sgl_pd.core.placement import prefill_locally

    loads = {"a:1": PrefillerLoad(True, 0)} if loads is None else loads
    kw = {"max_tokens": 256, "saturated_tokens": 1000, **kw}
    return prefill_locally(prompt, cached, loads=loads, **kw)


def test_a_follow_up_whose_prefix_the_decoder_holds_is_prefilled_there() -> None:
    assert _local(2000, 1900) == "cached_prefix"  # 100 new tokens
    assert _local(300, 100) == "cached_prefix"  # a third cached: still worth it
    assert _local(300, 60) is None  # mostly fresh: the prefill server's work
    assert _local(5000, 4700) is None  # 300 uncached: over the limit
    assert _local(2000, 1900, max_tokens=0) is None  # off


def test_short_fresh_prompts_stay_local_only_when_no_prefill_server_can_take_them_soon() -> None:
    assert _local(100, 0) is None
    busy = {"a:1": PrefillerLoad(True, 1500), "b:1": PrefillerLoad(True, 1000)}
    assert _local(100, 0, busy) == "saturated"
    one_free = {**busy, "c:1": PrefillerLoad(True, 10)}
    assert _local(100, 0, one_free) is None
    down = {"a:1": PrefillerLoad(False, 0)}
    assert _local(100, 0, down) == "unavailable"
    assert _local(100, 0, {}) == "unavailable"
    assert _local(400, 0, down) is None  # long prompts never: the client hears why


def test_direct_rooms_are_told_apart_from_router_rooms() -> None:
    from sgl_pd.core.placement import direct_room, is_direct_room

    for bits in (0, 1, (1 << 63) - 1, 0x123456789ABCDEF):
        room = direct_room(bits)
        assert 0 <= room < 1 << 63 and is_direct_room(room)
    router_rooms = [0x123456789ABCDEF0 >> 1, 7, (1 << 63) - 1]
    assert not any(is_direct_room(r) for r in router_rooms)


def _served(conversation: PromptKey) -> tuple[HeldTails, Callable[[PromptKey], int]]:
    """A decoder that served `conversation`: its tails, and the tokens of a prompt it
    holds (its whole blocks as the placement knows them, then its tail)."""
    held, sent = HeldTails(), SentPrefixes()
    held.record(conversation)
    sent.record("here", conversation.blocks)

    def tokens_held(prompt: PromptKey) -> int:
        return held.held_tokens(prompt, sent.cached_blocks("here", prompt.blocks))

    return held, tokens_held


def test_the_tokens_held_past_the_whole_blocks_are_known_to_the_token() -> None:
    conversation = PromptKey.of_ids([*LONG, 1, 2, 3, 4, 5])  # 8 blocks and 5 tokens
    held, tokens_held = _served(conversation)

    assert tokens_held(PromptKey.of_ids([*LONG, 1, 2, 3, 4, 5, 6, 7])) == len(LONG) + 5
    assert tokens_held(PromptKey.of_ids([*LONG, 1, 2, 9, 4, 5, 6])) == len(LONG) + 2
    # a follow-up past its own next whole block: the tail is compared inside that block
    longer = PromptKey.of_ids([*LONG, 1, 2, 3, 4, 5, *range(BLOCK_TOKENS)])
    assert len(longer.blocks) == 9 and tokens_held(longer) == len(LONG) + 5
    # the latest tail of a block is kept; a prompt of no held block: its leading tokens
    held.record(PromptKey.of_ids([*LONG, 1, 2, 7]))
    assert tokens_held(PromptKey.of_ids([*LONG, 1, 2, 3])) == len(LONG) + 2
    held.record(PromptKey.of_ids([40, 41, 42]))
    assert held.held_tokens(PromptKey.of_ids([40, 41, 43]), 0) == 2
    assert held.held_tokens(PromptKey.of_text("x" * 400, 4), 0) == 0  # (text: no tokens)
    bounded = HeldTails(max_tails=1)  # (a tail a block: the conversation's last kept)
    bounded.record(conversation)
    bounded.record(PromptKey.of_ids([40, 41, 42]))  # (the older tail forgotten)
    assert bounded.held_tokens(PromptKey.of_ids([*LONG, 1, 2]), 8) == len(LONG)


def test_each_turn_builds_the_tails_of_its_new_blocks_alone() -> None:
    """A follow-up turn served re-marks its conversation's earlier tails recent without
    building them again (a block's name covers the whole block after it), and builds
    those of its new blocks; a block whose next block changed gets the new tail."""
    turn = [*LONG, 1, 2, 3]  # 8 whole blocks and a partial tail
    held = HeldTails()
    held.record(PromptKey.of_ids(turn))
    before = dict(held._tails)
    longer = [*turn, *range(5000, 5000 + BLOCK_TOKENS)]  # block 8 whole now, a new tail
    held.record(PromptKey.of_ids(longer))
    after = held._tails
    blocks = PromptKey.of_ids(longer).blocks
    for key in (b"", *blocks[:7]):  # tails that are whole next blocks: kept as they were
        assert after[key] is before[key]
    assert after[blocks[7]] is not before[blocks[7]]  # was the partial tail [1, 2, 3]
    assert list(after[blocks[7]][1]) == longer[8 * BLOCK_TOKENS : 9 * BLOCK_TOKENS]
    assert list(after[blocks[8]][1]) == longer[9 * BLOCK_TOKENS :]
    # another conversation's tail at the start, then this one served again: its own
    held.record(PromptKey.of_ids([40, 41, 42]))
    assert held.held_tokens(PromptKey.of_ids(longer[:10]), 0) == 0
    held.record(PromptKey.of_ids(longer))
    assert held.held_tokens(PromptKey.of_ids(longer[:10]), 0) == 10
    assert held.held_tokens(PromptKey.of_ids([*longer, 9]), len(blocks)) == len(longer)


def test_a_prompt_ending_inside_a_served_conversation_is_held_to_the_token() -> None:
    """A stream sending its prompt again, or a retry: the prompt is the start of a
    conversation served here, and ends inside one of its blocks (which, partial, is not
    a block of the prompt). All of it is held - judged at its last 36 tokens the
    decoder would send out a request it keeps."""
    held, tokens_held = _served(PromptKey.of_ids([*LONG, 1, 2, 3, 4, 5]))  # 8 blocks, 5 tokens

    assert tokens_held(PromptKey.of_ids(LONG[:100])) == 100
    assert tokens_held(PromptKey.of_ids([*LONG[:100], -1])) == 100
    assert tokens_held(PromptKey.of_ids(LONG[:30])) == 30  # (no whole block)
    # a later conversation going on differently from a shared block is the one kept there
    held.record(PromptKey.of_ids([*LONG[:64], 7, 7, 7]))
    assert tokens_held(PromptKey.of_ids(LONG[:100])) == 64
