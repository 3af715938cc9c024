"""Prefill server addresses in direct mode (pure)."""

from __future__ import annotations

import pytest

from sgl_pd.core.dispatch import parse_bootstrap_addresses


def test_bootstrap_addresses_parse() -> None:
    assert parse_bootstrap_addresses("10.0.0.1:8998, 10.0.0.2:8998\n10.0.0.1:8998") == (
        "10.0.0.1:8998",
        "10.0.0.2:8998",
    )
    assert parse_bootstrap_addresses("[::1]:8998") == ("[::1]:8998",)
    for bad in ("10.0.0.1", "host:", ":8998", "host:99999", "host:x"):
        with pytest.raises(ValueError, match="bootstrap address"):
            parse_bootstrap_addresses(bad)
