"""Transfer metrics in SGLang's Prometheus ``/metrics`` (when ``--enable-metrics``).

SGLang runs prometheus_client in multiprocess mode (its scheduler processes write to
``PROMETHEUS_MULTIPROC_DIR``), so metrics created here in a scheduler process appear in
the HTTP server's ``/metrics`` like SGLang's own.

Every series is per scheduler rank and summed by the exposition: a TP8 server observes a
request on each rank that takes part in it, so ratios (failures per request) and
quantiles read the same at any TP size, while plain counts scale with the ranks. Labels
are bounded: `role` (prefill, decode), `cause` (`FailureCause`), `kind` (how a peer was
lost), `event` (what happened to a guarded control message).
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

from sgl_pd.core.failures import FailureCause

# seconds: from a fraction of a millisecond (a layer's KV over RDMA) to the transfer timeout
_SECONDS = (
    0.0005,
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    120.0,
)
# bytes: one rank's KV of a short prompt (64 KiB) to a 128k-token DeepSeek-R1 prompt
_BYTES = tuple(float(1 << shift) for shift in range(16, 38, 2))  # 64 KiB .. 64 GiB, x4

LIVENESS_KINDS = ("gone", "hung", "frozen")  # refused connections, silence, this process
CONTROL_EVENTS = ("resent", "given_up", "duplicate", "injected_drop")


class TransferMetrics:
    """Counters, gauges and histograms of one role; a no-op object when metrics are off.

    `registry`: where the metrics are registered (prometheus_client's default, which
    SGLang's multiprocess collector reads, unless a test passes its own).
    """

    def __init__(self, enabled: bool, role: str, registry: Any = None) -> None:
        self._enabled = enabled
        if not enabled:
            return
        from prometheus_client import REGISTRY, Counter, Gauge, Histogram

        reg = REGISTRY if registry is None else registry
        labels = {"role": role}

        def counter(name: str, doc: str) -> Any:
            return Counter(name, doc, ["role"], registry=reg).labels(**labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(name, doc, ["role"], buckets=buckets, registry=reg).labels(**labels)

        def gauge(name: str, doc: str) -> Any:
            # summed over the live scheduler processes of the server (its ranks)
            return Gauge(name, doc, ["role"], multiprocess_mode="livesum", registry=reg).labels(
                **labels
            )

        self._bytes = counter("sgl_pd_transfer_bytes", "KV and metadata bytes moved")
        self._pages = counter(
            "sgl_pd_transfer_pages", "KV pages moved (per request, logical pages)"
        )
        self._requests = counter("sgl_pd_transfer_requests", "Requests whose KV transfer completed")
        failures = Counter(
            "sgl_pd_transfer_failures",
            "Requests whose KV transfer failed on this side, by cause",
            ["role", "cause"],
            registry=reg,
        )
        # every cause exported from the start, so that rate() sees a failure's first rise
        self._failures = {c: failures.labels(role=role, cause=c.value) for c in FailureCause}
        losses = Counter(
            "sgl_pd_liveness_losses",
            "Peers declared lost by liveness (gone: connections refused; hung: silent past "
            "--pd-hang-timeout), and freezes of this process past it",
            ["role", "kind"],
            registry=reg,
        )
        self._losses = {k: losses.labels(role=role, kind=k) for k in LIVENESS_KINDS}
        self._seconds = histogram(
            "sgl_pd_transfer_seconds",
            "Per-request KV transfer time (prefill: first write to last completion; "
            "decode: pages requested to complete KV), seconds",
            _SECONDS,
        )
        self._exposed = histogram(
            "sgl_pd_exposed_transfer_seconds",
            "Prefill: the request's last forward's end to the decoder holding its KV and "
            "metadata (the transfer time the prefill did not hide), seconds",
            _SECONDS,
        )
        self._bootstrap = histogram(
            "sgl_pd_bootstrap_wait_seconds",
            "Prefill: request seen to every decode rank's pages known; decode: request "
            "seen to the prefiller's ranks known, seconds",
            _SECONDS,
        )
        self._kv_wait = histogram(
            "sgl_pd_decode_kv_wait_seconds",
            "Decode: pages allocated and requested to the request's complete KV, seconds",
            _SECONDS,
        )
        self._request_bytes = histogram(
            "sgl_pd_request_kv_bytes",
            "Prefill: KV and metadata bytes one rank wrote for one request",
            _BYTES,
        )
        self._held_tokens = counter(
            "sgl_pd_decode_prefix_tokens",
            "Decode: prompt tokens of completed requests whose KV the decoder held in its "
            "prefix cache (--disaggregation-decode-enable-radix-cache): not transferred",
        )
        self._received_tokens = counter(
            "sgl_pd_decode_received_tokens",
            "Decode: prompt tokens of completed requests whose KV was transferred",
        )
        self._bytes_not_sent = counter(
            "sgl_pd_kv_bytes_not_sent",
            "Decode: KV bytes of held prefix tokens this rank did not have to receive",
        )
        control = Counter(
            "sgl_pd_control_messages",
            "Guarded control messages by event (resent: sent again, unacknowledged;"
            " given_up: dropped unacknowledged; duplicate: a copy received and ignored;"
            " injected_drop: dropped on purpose by --pd-inject-control-drop-rate)",
            ["role", "event"],
            registry=reg,
        )
        self._control = {e: control.labels(role=role, event=e) for e in CONTROL_EVENTS}
        self._control_seen = dict.fromkeys(CONTROL_EVENTS, 0)
        self._role = role
        self._tables = TableEntries(True, role, registry=reg)
        self._rooms = gauge(
            "sgl_pd_rooms",
            "Requests this server's ranks hold transfer state for (live, or draining)",
        )
        self._in_flight = gauge(
            "sgl_pd_writes_in_flight",
            "Prefill: KV write jobs running; decode: requests whose KV is still arriving",
        )
        self._staging = gauge(
            "sgl_pd_staging_bytes",
            "Bytes of re-layout staging held (prefill: gather blocks being written; "
            "decode: receive blocks of requests in transfer)",
        )

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

    def prefill_done(self, exposed_s: float | None, bootstrap_s: float | None, nbytes: int) -> None:
        """A prefill rank finished a request's writes; waits in seconds, None if unknown."""
        if not self._enabled:
            return
        if exposed_s is not None:
            self._exposed.observe(max(exposed_s, 0.0))
        if bootstrap_s is not None:
            self._bootstrap.observe(max(bootstrap_s, 0.0))
        self._request_bytes.observe(nbytes)

    def decode_prefix(self, held_tokens: int, received_tokens: int, bytes_not_sent: int) -> None:
        """A completed request's prompt on a decode rank: tokens held vs transferred."""
        if self._enabled:
            self._held_tokens.inc(held_tokens)
            self._received_tokens.inc(received_tokens)
            self._bytes_not_sent.inc(bytes_not_sent)

    def decode_done(self, kv_wait_s: float) -> None:
        if self._enabled:
            self._kv_wait.observe(kv_wait_s)

    def bootstrap_waited(self, seconds: float) -> None:
        if self._enabled:
            self._bootstrap.observe(seconds)

    def add_failure(self, cause: FailureCause) -> None:
        if self._enabled:
            self._failures[cause].inc()

    def peer_lost(self, kind: str) -> None:
        """`kind`: one of `LIVENESS_KINDS`."""
        if self._enabled:
            self._losses[kind].inc()

    def control_totals(self, totals: dict[str, int]) -> None:
        """Running totals of `CONTROL_EVENTS` (the reliable sender's and receiver's
        counts): the counters advance by what is new since the last call."""
        if not self._enabled:
            return
        for event, total in totals.items():
            new = total - self._control_seen[event]
            if new > 0:
                self._control[event].inc(new)
                self._control_seen[event] = total

    def set_tables(self, sizes: dict[str, int]) -> None:
        """Each of sgl_pd's tables' entries now (`tables()` of the role's messenger)."""
        if self._enabled:
            self._tables.set(sizes)

    def set_live(self, rooms: int, in_flight: int, staging_bytes: int = 0) -> None:
        if self._enabled:
            self._rooms.set(rooms)
            self._in_flight.set(in_flight)
            self._staging.set(staging_bytes)


class TableEntries:
    """`sgl_pd_table_entries{role, table}` as one process sets it: a scheduler rank's
    tables (`TransferMetrics.set_tables`) or an HTTP front-end's (direct mode's
    submissions in flight, the router flow's skip notices), summed over the server's
    live processes. A no-op object when metrics are off."""

    def __init__(self, enabled: bool, role: str, registry: Any = None) -> None:
        self._role = role
        self._gauge: Any = None
        if enabled:
            from prometheus_client import REGISTRY

            self._gauge = _table_gauge(REGISTRY if registry is None else registry)

    def set(self, sizes: dict[str, int]) -> None:
        if self._gauge is not None:
            for table, size in sizes.items():
                self._gauge.labels(role=self._role, table=table).set(size)


# registry -> its gauge: a scheduler rank and an HTTP front-end in one process (tests) share it
_TABLE_GAUGES: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_TABLE_GAUGES_LOCK = threading.Lock()


def _table_gauge(registry: Any) -> Any:
    from prometheus_client import Gauge

    with _TABLE_GAUGES_LOCK:
        gauge = _TABLE_GAUGES.get(registry)
        if gauge is None:
            gauge = _TABLE_GAUGES[registry] = Gauge(
                "sgl_pd_table_entries",
                "Entries of sgl_pd's own tables (rooms, request states, page pins, control"
                " messages awaiting acknowledgment, deliveries remembered, direct mode's"
                " submissions, skip notices, ...), summed over the server's processes: each"
                " returns to 0 once traffic stops",
                ["role", "table"],
                multiprocess_mode="livesum",
                registry=registry,
            )
        return gauge


PLACEMENT_REASONS = ("cached_prefix", "load")  # why a prefill server was chosen
# why a request placed for local prefill was not
SENT_OUT_REASONS = ("slower", "itl_slo", "no_room", "unadmitted", "queue_full")
LOCAL_STEP_KINDS = ("mixed", "unmixed")


class PlacementMetrics:
    """A decoder's placement of requests: in direct mode (its HTTP process) the prefill
    servers it chose, and why - `cached_prefix` when the chosen one was predicted to hold
    part of the prompt, `load` when only its queue and rate decided; in both flows the
    requests it prefilled itself (the router flow's in its scheduler ranks). A no-op
    object when metrics are off."""

    def __init__(self, enabled: bool, registry: Any = None) -> None:
        self._counter: Any = None
        self._cached: Any = None
        self._local: Any = None
        self._sent_out: Any = None
        self._steps: Any = None
        if not enabled:
            return
        from prometheus_client import REGISTRY, Counter

        from sgl_pd.core.placement import LOCAL_REASONS

        reg = REGISTRY if registry is None else registry

        def labelled(name: str, doc: str, label: str, values: tuple[str, ...]) -> Any:
            counter = Counter(name, doc, [label], registry=reg)
            for value in values:  # every series from the start, so rate() sees its first rise
                counter.labels(**{label: value})
            return counter

        self._local = labelled(
            "sgl_pd_local_prefills",
            "Requests a decoder prefilled itself, by why: cached_prefix (it held most of the"
            " prompt; the router flow counts it in each scheduler rank, direct mode in the"
            " HTTP process), saturated or unavailable (direct mode: its prefill servers)",
            "reason",
            LOCAL_REASONS,
        )
        self._sent_out = labelled(
            "sgl_pd_local_prefills_sent_out",
            "Requests placed for local prefill that a decoder sent to a prefill server after"
            " all (counted in its scheduler), by why: slower (their first token was"
            " predicted sooner remote), itl_slo (no local step, mixed into the running"
            " streams' decode or alone, could carry them within the ITL SLO), no_room (no"
            " request slot or memory for them: the transfer queues come first), unadmitted"
            " (no decode step admitted them within a few steps), queue_full (the local queue"
            " held --max-queued-requests)",
            "why",
            SENT_OUT_REASONS,
        )
        self._steps = labelled(
            "sgl_pd_local_prefill_steps",
            "Local prefill steps a decoder ran (counted in its first scheduler rank), by kind:"
            " mixed (the running streams decoded in the same forward) or unmixed (the local"
            " tokens alone, then the streams' decode step: where mixing costs the streams"
            " more, or SGLang does not mix logprob requests)",
            "kind",
            LOCAL_STEP_KINDS,
        )
        self._counter = labelled(
            "sgl_pd_prefill_placements",
            "Requests a decoder handed to a prefill server (direct mode), by why that one",
            "reason",
            PLACEMENT_REASONS,
        )
        self._cached = Counter(
            "sgl_pd_prefill_placement_cached_tokens",
            "Prompt tokens the chosen prefill server was predicted to hold already",
            registry=reg,
        )

    def local(self, reason: str) -> None:
        if self._local is not None:
            self._local.labels(reason=reason).inc()

    def sent_out(self, why: str) -> None:
        """`why`: one of `SENT_OUT_REASONS`."""
        if self._sent_out is not None:
            self._sent_out.labels(why=why).inc()

    def stepped(self, mixed: bool) -> None:
        if self._steps is not None:
            self._steps.labels(kind="mixed" if mixed else "unmixed").inc()

    def placed(self, cached_tokens: int) -> None:
        if self._counter is None:
            return
        self._counter.labels(reason="cached_prefix" if cached_tokens else "load").inc()
        self._cached.inc(cached_tokens)
