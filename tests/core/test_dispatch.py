"""Choosing a prefill server in direct mode (pure)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_pd.core.dispatch import PrefillerLoad, choose_prefiller, parse_bootstrap_addresses


def test_the_least_outstanding_available_server_is_chosen() -> None:
    loads = {
        "a:1": PrefillerLoad(True, 500),
        "b:1": PrefillerLoad(True, 100),
        "c:1": PrefillerLoad(False, 0),  # down: never chosen
    }
    assert choose_prefiller(loads) == "b:1"
    assert choose_prefiller(loads, exclude=["b:1"]) == "a:1"
    assert choose_prefiller(loads, exclude=["a:1", "b:1"]) is None
    assert choose_prefiller({}) is None


def test_ties_take_turns() -> None:
    loads = {"a:1": PrefillerLoad(True, 0), "b:1": PrefillerLoad(True, 0)}
    assert {choose_prefiller(loads, turn=t) for t in range(4)} == {"a:1", "b:1"}


@given(
    st.dictionaries(
        st.sampled_from(["a:1", "b:2", "c:3", "d:4"]),
        st.builds(PrefillerLoad, st.booleans(), st.integers(0, 10_000)),
    ),
    st.integers(0, 10),
)
def test_the_choice_is_never_worse_than_another_available_server(loads, turn) -> None:  # type: ignore[no-untyped-def]
    chosen = choose_prefiller(loads, turn=turn)
    up = [a for a, load in loads.items() if load.available]
    if not up:
        assert chosen is None
    else:
        assert chosen in up
        assert loads[chosen].outstanding_tokens == min(loads[a].outstanding_tokens for a in up)


def test_bootstrap_addresses_parse() -> None:
    assert parse_bootstrap_addresses("10.0.0.1:8998, 10.0.0.2:8998\n10.0.0.1:8998") == (
        "10.0.0.1:8998",
        "10.0.0.2:8998",
    )
    assert parse_bootstrap_addresses("[::1]:8998") == ("[::1]:8998",)
    for bad in ("10.0.0.1", "host:", ":8998", "host:99999", "host:x"):
        with pytest.raises(ValueError, match="bootstrap address"):
            parse_bootstrap_addresses(bad)
