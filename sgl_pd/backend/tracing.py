"""Request timelines as OpenTelemetry spans (with SGLang's ``--enable-trace``) and as one
DEBUG line per request on logger ``sgl_pd.trace`` (with or without it).

Spans are made once a request ends, from its stamps (`core.timeline`), with explicit
start and end times: nothing is held open across the writer, inbox and scheduler
threads, and a request that never ends costs no span.

Where a span goes: SGLang's scheduler process initialises the tracer provider and
exporter (``process_tracing_init``) before it builds our KV manager, so spans go to the
global provider. The parent is SGLang's own span of the request when this process saw
it (`remember_request`, a hook on the queues the request enters: its context travels
with the request into the scheduler), so that a trace viewer shows our stages inside
SGLang's request; the two servers then share a trace when the client or router sends a
``traceparent``. Otherwise (no SGLang context) the parent is derived from the bootstrap
room (`core.timeline.room_trace_ids`): both sides' roots land in one trace, children of
a parent span no process reports. Every root carries the room as an attribute, which
finds both sides in either case.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from typing import Any

from sgl_pd.core.timeline import Timeline, room_trace_ids

logger = logging.getLogger("sgl_pd.trace")

TRACE_LINE_PREFIX = "sgl_pd timeline:"
PLACEMENT_SPAN = "sgl_pd.placement"  # where a request's prefill runs, and why
# SGLang request contexts kept for rooms whose timeline has not ended yet: requests in
# flight on one scheduler are far fewer; the oldest go first (a request dropped on a path
# that never emits must not hold memory)
MAX_REMEMBERED = 4096

_contexts: OrderedDict[int, Any] = OrderedDict()
_contexts_lock = threading.Lock()


def remember_request(queue: Any, req: Any, *args: Any, **kw: Any) -> None:
    """BEFORE hook of ``PrefillBootstrapQueue.add`` and ``DecodePreallocQueue.add``:
    keeps the request's SGLang trace context by bootstrap room, when it is traced."""
    ctx = getattr(getattr(req, "time_stats", None), "trace_ctx", None)
    room = getattr(req, "bootstrap_room", None)
    if room is None or not getattr(ctx, "tracing_enable", False):
        return
    parent = getattr(ctx, "root_span_context", None)
    if parent is None:
        return
    with _contexts_lock:
        _contexts[int(room)] = parent
        while len(_contexts) > MAX_REMEMBERED:
            _contexts.popitem(last=False)


def _take_context(room: int) -> Any:
    with _contexts_lock:
        return _contexts.pop(room, None)


def _room_parent(room: int) -> Any:
    """The parent of a request's spans when no SGLang context of it is known: derived
    from its bootstrap room, so both sides' spans land in one trace."""
    from opentelemetry import trace
    from opentelemetry.trace import SpanContext, TraceFlags

    trace_id, span_id = room_trace_ids(room)
    remote = SpanContext(
        trace_id, span_id, is_remote=True, trace_flags=TraceFlags(TraceFlags.SAMPLED)
    )
    return trace.set_span_in_context(trace.NonRecordingSpan(remote))


def placement_span(
    request_trace: Any, room: int, attrs: dict[str, Any], provider: Any = None
) -> None:
    """A span inside SGLang's span of the request (`request_trace`: SGLang's trace
    context of it; the room's derived parent when it is not traced) that says where its
    prefill runs and why: `attrs` (`sgl_pd.` prefixed). Never raises."""
    try:
        from opentelemetry import trace

        tracer = (provider or trace.get_tracer_provider()).get_tracer("sgl_pd")
        parent = None
        if getattr(request_trace, "tracing_enable", False):
            parent = getattr(request_trace, "root_span_context", None)
        span = tracer.start_span(
            PLACEMENT_SPAN,
            context=parent if parent is not None else _room_parent(room),
            attributes={
                "sgl_pd.bootstrap_room": str(room),
                **{f"sgl_pd.{k}": v for k, v in attrs.items()},
            },
        )
        span.end()
    except Exception:  # a tracing bug must never fail a request
        logger.exception("request %d: placement span not emitted", room)


class RequestTracing:
    """Emits timelines of one rank. `enabled`: SGLang's ``--enable-trace``;
    `provider`: an OpenTelemetry tracer provider (the global one unless a test passes
    its own)."""

    def __init__(self, enabled: bool, provider: Any = None) -> None:
        self._tracer: Any = None
        if enabled:
            from opentelemetry import trace

            self._tracer = (provider or trace.get_tracer_provider()).get_tracer("sgl_pd")
        # ns to add to a monotonic stamp for epoch time: the stamps are time.monotonic()
        # (SystemClock) seconds, spans want wall-clock ns comparable across hosts
        self._offset_ns = time.time_ns() - time.monotonic_ns()

    @property
    def wanted(self) -> bool:
        """Whether a timeline would go anywhere: the messengers build none otherwise."""
        return self._tracer is not None or logger.isEnabledFor(logging.DEBUG)

    def emit(self, timeline: Timeline) -> None:
        if logger.isEnabledFor(logging.DEBUG):
            logger.debug("%s %s", TRACE_LINE_PREFIX, timeline.log_fields())
        if self._tracer is not None:
            try:
                self._spans(timeline)
            except Exception:  # a tracing bug must never fail a request
                logger.exception("request %d: spans not emitted", timeline.room)

    def _ns(self, monotonic_s: float) -> int:
        return round(monotonic_s * 1e9) + self._offset_ns

    def _spans(self, timeline: Timeline) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        parent = _take_context(timeline.room)
        if parent is None:
            parent = _room_parent(timeline.room)
        attrs = {
            "sgl_pd.role": timeline.role,
            "sgl_pd.bootstrap_room": str(timeline.room),  # 63 bits: a string stays exact
            "sgl_pd.rank": timeline.rank,
            **dict(timeline.root.attrs),
        }
        root = self._tracer.start_span(
            timeline.root.name,
            context=parent,
            start_time=self._ns(timeline.root.start_s),
            attributes=attrs,
        )
        if timeline.error is not None:
            root.set_status(Status(StatusCode.ERROR, timeline.error[:500]))
        inside = trace.set_span_in_context(root)
        for stage in timeline.children:
            span = self._tracer.start_span(
                stage.name,
                context=inside,
                start_time=self._ns(stage.start_s),
                attributes=dict(stage.attrs),
            )
            span.end(end_time=self._ns(stage.end_s))
        root.end(end_time=self._ns(timeline.root.end_s))
