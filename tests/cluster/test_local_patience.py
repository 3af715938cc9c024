"""The local cluster tooling's waits and router settings, without starting SGLang: one
`Patience` factor, the router argv against the router's own parser, and readiness
probes against a small HTTP server in this process."""

from __future__ import annotations

import http.server
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from sgl_pd.cluster import local
from sgl_pd.cluster.local import PATIENCE_ENV, Patience, local_patience, router_argv, serving_pd
from sgl_pd.cluster.processes import ManagedProcess, ServerStartError, managed
from sgl_pd.errors import ConfigError


@pytest.fixture
def fresh_patience_cache() -> Iterator[None]:
    local_patience.cache_clear()
    yield
    local_patience.cache_clear()


def test_default_patience_is_generous() -> None:
    p = Patience()
    assert p.server_ready_s >= 300 and p.router_ready_s >= 120
    assert p.health_check_timeout_s >= 30  # above SGLang's own 20 s /health verdict
    assert p.health_failure_threshold >= 10


def test_servers_with_more_scheduler_processes_get_longer_to_start() -> None:
    one, two = Patience(), Patience(2.0)
    assert one.servers_ready_s(1) == one.servers_ready_s(3) == one.server_ready_s
    assert one.servers_ready_s(5) == one.server_ready_s + 2 * 60
    assert two.servers_ready_s(5) == 2 * one.servers_ready_s(5)


def test_one_factor_scales_every_wait() -> None:
    one, three = Patience(), Patience(3.0)
    assert three.server_ready_s == 3 * one.server_ready_s
    assert three.router_ready_s == 3 * one.router_ready_s
    assert three.probe_timeout_s == 3 * one.probe_timeout_s
    assert three.health_check_timeout_s == 3 * one.health_check_timeout_s
    assert three.health_failure_threshold == 3 * one.health_failure_threshold
    assert three.seconds(30.0) == 90.0
    assert Patience(0.01).health_failure_threshold >= 1  # whole counts, never zero


@pytest.mark.parametrize(
    ("text", "factor"), [(None, 1.0), ("", 1.0), ("2.5", 2.5), (" 4 ", 4.0), ("1e1", 10.0)]
)
def test_patience_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, text: str | None, factor: float
) -> None:
    if text is None:
        monkeypatch.delenv(PATIENCE_ENV, raising=False)
    else:
        monkeypatch.setenv(PATIENCE_ENV, text)
    assert Patience.from_environment() == Patience(factor)


@pytest.mark.parametrize("text", ["slow", "0", "-1", "nan", "inf"])
def test_a_bad_patience_names_the_variable(monkeypatch: pytest.MonkeyPatch, text: str) -> None:
    monkeypatch.setenv(PATIENCE_ENV, text)
    with pytest.raises(ConfigError, match=PATIENCE_ENV):
        Patience.from_environment()


@pytest.mark.usefixtures("fresh_patience_cache")
def test_the_environment_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(PATIENCE_ENV, "2")
    assert local_patience() == Patience(2.0)
    monkeypatch.setenv(PATIENCE_ENV, "5")
    assert local_patience() == Patience(2.0)


def test_router_argv_parses_with_the_routers_parser_and_carries_the_settings() -> None:
    launch_router = pytest.importorskip("sglang_router.launch_router")
    patience = Patience(2.0)
    argv = router_argv(
        8000, 29001, "http://127.0.0.1:30000", 8998, "http://127.0.0.1:30001", patience=patience
    )
    assert argv[:3] == [sys.executable, "-m", "sglang_router.launch_router"]
    args = launch_router.parse_router_args(argv[3:])
    assert args.pd_disaggregation
    assert args.prefill_urls == [("http://127.0.0.1:30000", 8998)]
    assert args.decode_urls == ["http://127.0.0.1:30001"]
    assert (args.port, args.prometheus_port) == (8000, 29001)
    assert args.health_check_timeout_secs == patience.health_check_timeout_s == 60
    assert args.health_failure_threshold == patience.health_failure_threshold == 40
    assert args.health_check_interval_secs == 1 and args.health_success_threshold == 1
    assert args.disable_circuit_breaker
    assert not args.disable_retries
    assert args.decode_policy == "round_robin"
    cache_aware = router_argv(
        8000, 29001, "http://127.0.0.1:30000", 8998, "http://127.0.0.1:30001",
        decode_policy="cache_aware",
    )  # fmt: skip
    assert launch_router.parse_router_args(cache_aware[3:]).decode_policy == "cache_aware"
    no_retries = router_argv(
        8000, 29001, "http://127.0.0.1:30000", 8998, "http://127.0.0.1:30001", retries=False
    )
    assert launch_router.parse_router_args(no_retries[3:]).disable_retries


@dataclass
class FakeProcess:
    """Stands in for a ManagedProcess: records the readiness budgets it was given."""

    name: str
    argv: list[str] = field(default_factory=list)  # what scheduler_ranks reads
    waits: list[tuple[str, float, float]] = field(default_factory=list)
    events: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.events.append("start")

    def wait_http_ready(self, url: str, timeout_s: float, *, probe_timeout_s: float) -> None:
        self.waits.append((url, timeout_s, probe_timeout_s))

    def running(self) -> bool:
        return "stop" not in self.events

    def terminate(self) -> None:
        self.events.append("stop")

    def kill_group(self) -> None:
        pass


def test_serving_pd_takes_every_budget_from_patience() -> None:
    patience = Patience(1.5)
    prefill, decode, router = FakeProcess("prefill"), FakeProcess("decode"), FakeProcess("router")
    with serving_pd(
        prefill,
        "http://p",
        decode,
        "http://d",
        router,
        "http://r",
        patience=patience,  # type: ignore[arg-type]
    ):
        pass
    server = (patience.server_ready_s, patience.probe_timeout_s)
    assert prefill.waits == [("http://p/health", *server)]
    assert decode.waits == [("http://d/health", *server)]
    assert router.waits == [
        ("http://r/readiness", patience.router_ready_s, patience.probe_timeout_s)
    ]
    assert all(p.events == ["start", "stop"] for p in (prefill, decode, router))


class _SlowHealth(http.server.BaseHTTPRequestHandler):
    delay_s = 0.0  # seconds before each answer, like SGLang's /health (>= 1 s)

    def do_GET(self) -> None:
        time.sleep(self.delay_s)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def slow_health() -> Iterator[str]:
    handler = type("Handler", (_SlowHealth,), {"delay_s": 1.0})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, name="test-slow-health", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5.0)


def _sleeper(tmp_path: Path) -> ManagedProcess:
    argv = [sys.executable, "-c", "import time; time.sleep(60)"]
    return ManagedProcess("sleeper", argv, tmp_path / "sleeper.log")


def test_a_probe_waits_as_long_as_it_is_allowed(slow_health: str, tmp_path: Path) -> None:
    process = _sleeper(tmp_path)
    with managed([process]):
        process.start()
        process.wait_http_ready(slow_health, timeout_s=10.0, probe_timeout_s=5.0)
        with pytest.raises(ServerStartError, match="not ready"):
            process.wait_http_ready(slow_health, timeout_s=1.5, probe_timeout_s=0.2)


def test_module_keeps_no_fixed_readiness_budget() -> None:
    assert not hasattr(local, "READY_TIMEOUT_S")  # every budget comes from Patience
