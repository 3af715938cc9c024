"""What the launcher puts in a server's environment for SGLang to read."""

from __future__ import annotations

import pytest

from sgl_pd.config import SglPdConfig
from sgl_pd.core.bounds import ROUTER_POOL_IDLE_S
from sgl_pd.launch_server import KEEP_ALIVE_ENV, server_env


def test_a_server_keeps_idle_connections_longer_than_the_router(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A server that closes an idle connection as the router sends on it loses that request
    unread (bench_faults: a prefill server stopped for 5 s dropped the request the router
    had just sent it, and its decoder waited 120 s for KV)."""
    from sglang.srt.environ import envs

    for name, value in server_env({}).items():
        monkeypatch.setenv(name, value)
    keep_alive_s = envs.SGLANG_TIMEOUT_KEEP_ALIVE.get()  # as SGLang's HTTP server reads it
    assert keep_alive_s > ROUTER_POOL_IDLE_S + SglPdConfig.hang_timeout_s


def test_an_operators_own_setting_wins() -> None:
    assert server_env({KEEP_ALIVE_ENV: "9"})[KEEP_ALIVE_ENV] == "9"


def test_a_longer_hang_timeout_keeps_idle_connections_longer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    config = SglPdConfig(hang_timeout_s=60.0)
    keep_alive_s = float(server_env({}, config)[KEEP_ALIVE_ENV])
    assert keep_alive_s > ROUTER_POOL_IDLE_S + 60.0
    assert server_env({KEEP_ALIVE_ENV: "75"}, config)[KEEP_ALIVE_ENV] == "75"
    assert "keep-alive" in caplog.text  # the operator's too short a setting is named
