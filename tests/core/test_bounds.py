"""The timing bounds the safety arguments need: derived from the operator's timeouts and
the engine's, each inequality checked."""

from __future__ import annotations

from sgl_pd.config import SglPdConfig
from sgl_pd.core.bounds import (
    DEFERRED_RELEASE_ENV,
    ENGINE_TIMEOUT_ENV,
    TimingBounds,
    engine_transfer_timeout_s,
)


def test_the_defaults_hold() -> None:
    assert (
        SglPdConfig().bounds(decode=True, environ={DEFERRED_RELEASE_ENV: "120"}).violations() == []
    )
    assert SglPdConfig().bounds(environ={}).violations() == []  # a prefill server


def test_sglangs_own_deferred_release_is_too_short_for_a_decoder() -> None:
    """SGLang's 30 s would free pages a write posted before a hang may still land in."""
    bounds = SglPdConfig().bounds(decode=True, environ={})
    assert bounds.deferred_release_s == 30.0
    (problem,) = bounds.violations()
    assert "deferred release" in problem and "hang timeout" in problem


def test_a_longer_hang_timeout_asks_for_a_longer_release() -> None:
    bounds = TimingBounds(hang_timeout_s=100.0, transfer_timeout_s=120.0, deferred_release_s=120.0)
    assert bounds.required_deferred_release_s == 100.0 + bounds.engine_transfer_timeout_s
    assert bounds.violations()
    assert bounds.staging_hold_s == bounds.required_deferred_release_s


def test_the_engine_timeout_follows_mooncakes_setting() -> None:
    assert engine_transfer_timeout_s({}) == 34.0
    assert engine_transfer_timeout_s({ENGINE_TIMEOUT_ENV: "100"}) == 104.0
    assert engine_transfer_timeout_s({ENGINE_TIMEOUT_ENV: "1"}) == 9.0  # Mooncake's floor


def test_resends_outlast_the_hang_timeout_and_come_more_often() -> None:
    for hang in (0.5, 3.0, 20.0, 300.0):
        bounds = TimingBounds(hang_timeout_s=hang, transfer_timeout_s=1.0)
        assert bounds.give_up_s > hang
        assert bounds.resend_interval_s <= bounds.resend_max_interval_s < hang
        assert bounds.freeze_limit_s < hang
        assert not [p for p in bounds.violations() if "resen" in p or "freeze" in p]


def test_a_short_keep_alive_is_named() -> None:
    bounds = TimingBounds(hang_timeout_s=20.0, transfer_timeout_s=120.0, keep_alive_s=5.0)
    assert any("keep-alive" in p for p in bounds.violations())
