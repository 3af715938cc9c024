"""Transfer metrics in SGLang's Prometheus ``/metrics`` (when ``--enable-metrics``).

SGLang runs prometheus_client in multiprocess mode (its scheduler processes write to
``PROMETHEUS_MULTIPROC_DIR``), so counters created here in a scheduler process appear in
the HTTP server's ``/metrics`` like SGLang's own.
"""

from __future__ import annotations

from typing import Any


class TransferMetrics:
    """Counters and gauges for one role; a no-op object when metrics are disabled."""

    def __init__(self, enabled: bool, role: str) -> None:
        self._enabled = enabled
        if not enabled:
            return
        from prometheus_client import Counter, Gauge, Histogram

        labels = {"role": role}
        self._bytes: Any = Counter(
            "sgl_pd_transfer_bytes", "KV and metadata bytes moved", ["role"]
        ).labels(**labels)
        self._pages: Any = Counter(
            "sgl_pd_transfer_pages", "KV pages moved (per request, logical pages)", ["role"]
        ).labels(**labels)
        self._requests: Any = Counter(
            "sgl_pd_transfer_requests", "Requests whose KV transfer completed", ["role"]
        ).labels(**labels)
        self._failures: Any = Counter(
            "sgl_pd_transfer_failures", "Requests whose KV transfer failed", ["role"]
        ).labels(**labels)
        self._seconds: Any = Histogram(
            "sgl_pd_transfer_seconds",
            "Per-request KV transfer time, first write to last completion (seconds)",
            ["role"],
            buckets=(0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0, 30.0),
        ).labels(**labels)
        # summed over the live scheduler processes of the server (its ranks)
        self._rooms: Any = Gauge(
            "sgl_pd_rooms",
            "Requests this server's ranks hold transfer state for (live, or draining)",
            ["role"],
            multiprocess_mode="livesum",
        ).labels(**labels)
        self._in_flight: Any = Gauge(
            "sgl_pd_writes_in_flight",
            "Prefill: KV write jobs running; decode: requests whose KV is still arriving",
            ["role"],
            multiprocess_mode="livesum",
        ).labels(**labels)

    def add_bytes(self, nbytes: int) -> None:
        if self._enabled:
            self._bytes.inc(nbytes)

    def add_request(self, pages: int, seconds: float | None) -> None:
        if not self._enabled:
            return
        self._requests.inc()
        self._pages.inc(pages)
        if seconds is not None:
            self._seconds.observe(seconds)

    def add_failure(self) -> None:
        if self._enabled:
            self._failures.inc()

    def set_live(self, rooms: int, in_flight: int) -> None:
        if self._enabled:
            self._rooms.set(rooms)
            self._in_flight.set(in_flight)
