"""SGLang's deferred release is held to sgl_pd's bound however the server was started:
its decode transfer queue is raised (and turned on) when the value is lower, and the
backend's start-up check reads the value that will run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from sgl_pd.backend.decode.release_bound import after_transfer_queue_init
from sgl_pd.config import SglPdConfig
from sgl_pd.core.bounds import DEFERRED_RELEASE_ENV


def _queue(timeout_s: float, enabled: bool = True) -> SimpleNamespace:
    return SimpleNamespace(
        deferred_kv_release_timeout=timeout_s, enable_deferred_kv_release=enabled
    )


def _scheduler(mode: str, backend: str = "sgl_pd") -> SimpleNamespace:
    args = SimpleNamespace(disaggregation_mode=mode, disaggregation_transfer_backend=backend)
    return SimpleNamespace(server_args=args)


def test_sglangs_default_is_raised_on_an_sgl_pd_decoder(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Started through SGLang's own launcher, the 30 s default applies: raised here."""
    monkeypatch.delenv(DEFERRED_RELEASE_ENV, raising=False)
    queue = _queue(30.0, enabled=False)
    after_transfer_queue_init(None, queue, scheduler=_scheduler("decode"))
    assert queue.enable_deferred_kv_release
    required = SglPdConfig().bounds(decode=True).required_deferred_release_s
    assert queue.deferred_kv_release_timeout >= required
    assert "raised from 30 s" in caplog.text
    # the backend's own start-up check now sees the value that will run
    assert SglPdConfig().bounds(decode=True).violations() == []


def test_a_longer_setting_is_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(DEFERRED_RELEASE_ENV, raising=False)
    queue = _queue(600.0)
    after_transfer_queue_init(None, queue, scheduler=_scheduler("decode"))
    assert queue.deferred_kv_release_timeout == 600.0


@pytest.mark.parametrize(("mode", "backend"), [("prefill", "sgl_pd"), ("decode", "mooncake")])
def test_other_servers_are_left_alone(mode: str, backend: str) -> None:
    queue = _queue(30.0)
    after_transfer_queue_init(None, queue, scheduler=_scheduler(mode, backend))
    assert queue.deferred_kv_release_timeout == 30.0


def test_without_the_hook_a_decoder_refuses_to_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The manager checks the bounds against the environment: SGLang's 30 s fails."""
    monkeypatch.setenv(DEFERRED_RELEASE_ENV, "30")
    assert SglPdConfig().bounds(decode=True).violations()
