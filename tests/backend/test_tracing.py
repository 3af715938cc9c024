"""Request timelines as spans, through the OpenTelemetry SDK's in-memory exporter (what
an OTLP collector would receive), and as the debug line when tracing is off."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sgl_pd.backend.tracing import TRACE_LINE_PREFIX, RequestTracing, remember_request
from sgl_pd.core.clock import ManualClock
from sgl_pd.core.states import DecodeState, PrefillState
from sgl_pd.core.timeline import (
    BOOTSTRAP,
    CHUNK,
    HAND_OFF,
    KV_WAIT,
    REQUEST,
    TRANSFER,
    Stage,
    Timeline,
    room_trace_ids,
)
from sgl_pd.core.wire import AbortReason

from .pd_fakes import Rig, wait_state

ROOM = 5
SRC, DST = list(range(10, 20)), list(range(30, 40))  # 10 pages of 1 token
CHUNK_PAGES = 4  # -> chunks of 4, 4 and 2 pages


class TickingClock(ManualClock):
    """Every reading is 1 ms after the previous one: stamps taken in order differ."""

    def __init__(self) -> None:
        super().__init__(100.0)
        self._lock = threading.Lock()

    def monotonic(self) -> float:
        with self._lock:
            self.advance(0.001)
            return super().monotonic()


def _exporter() -> tuple[InMemorySpanExporter, TracerProvider]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter, provider


def _wait(predicate: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def _one_request(rig: Rig) -> None:
    d = rig.add_decoder("decode-a")
    rig.request(d, ROOM, DST, slot=1)
    rig.prefill_all(ROOM, SRC, chunk=CHUNK_PAGES)
    wait_state(d, ROOM, DecodeState.COMPLETE)
    d.messenger.hand_off(ROOM)
    _wait(lambda: rig.prefill.state(ROOM) == (PrefillState.DONE, True, None))


def _sides(spans: list[ReadableSpan]) -> dict[str, tuple[ReadableSpan, list[ReadableSpan]]]:
    """role -> (its root, its other spans)."""
    roots = {s.attributes["sgl_pd.role"]: s for s in spans if s.name == REQUEST}
    out = {}
    for role, root in roots.items():
        assert root.context is not None
        children = [
            s for s in spans if s.parent is not None and s.parent.span_id == root.context.span_id
        ]
        out[str(role)] = (root, children)
    return out


def test_one_request_yields_both_sides_spans_in_one_trace() -> None:
    exporter, provider = _exporter()
    rig = Rig(clock=TickingClock(), tracing=RequestTracing(True, provider))
    _one_request(rig)
    _wait(lambda: len([s for s in exporter.get_finished_spans() if s.name == REQUEST]) == 2)
    rig.prefill.writers.close()
    spans = list(exporter.get_finished_spans())

    trace_id, parent_id = room_trace_ids(ROOM)
    assert {s.context.trace_id for s in spans if s.context} == {trace_id}
    sides = _sides(spans)
    assert set(sides) == {"prefill", "decode"}
    prefill_root, prefill = sides["prefill"]
    decode_root, decode = sides["decode"]
    for root in (prefill_root, decode_root):
        assert root.parent is not None and root.parent.span_id == parent_id  # the room's
        assert root.attributes is not None
        assert root.attributes["sgl_pd.bootstrap_room"] == str(ROOM)
    # every span but the roots is a child of its side's root
    assert len(prefill) + len(decode) + 2 == len(spans)
    chunks = -(-len(SRC) // CHUNK_PAGES)
    assert Counter(s.name for s in prefill) == {BOOTSTRAP: 1, CHUNK: chunks, TRANSFER: 1}
    assert Counter(s.name for s in decode) == {BOOTSTRAP: 1, KV_WAIT: 1, HAND_OFF: 1}

    for root, children in sides.values():
        assert root.start_time is not None and root.end_time is not None
        for child in children:
            assert child.start_time is not None and child.end_time is not None
            assert root.start_time <= child.start_time <= child.end_time <= root.end_time

    def one(children: list[ReadableSpan], name: str) -> ReadableSpan:
        (span,) = [s for s in children if s.name == name]
        return span

    # each side's stages in the order they happen (ns; the clock ticks per reading)
    p_boot, p_transfer = one(prefill, BOOTSTRAP), one(prefill, TRANSFER)
    chunk_spans = sorted(
        (s for s in prefill if s.name == CHUNK), key=lambda s: s.attributes["chunk"]
    )
    assert [s.attributes["chunk"] for s in chunk_spans] == list(range(chunks))
    assert p_boot.end_time <= p_transfer.start_time == chunk_spans[0].start_time
    starts = [s.start_time for s in chunk_spans]
    assert starts == sorted(starts)
    assert max(s.end_time for s in chunk_spans) <= p_transfer.end_time
    d_boot, d_wait, d_hand = one(decode, BOOTSTRAP), one(decode, KV_WAIT), one(decode, HAND_OFF)
    assert d_boot.end_time <= d_wait.start_time < d_wait.end_time == d_hand.start_time
    # across the sides: the decoder asks for pages before the prefill rank writes them
    assert d_wait.start_time < p_transfer.start_time


def test_with_tracing_off_no_span_and_a_debug_line_per_side(
    caplog: pytest.LogCaptureFixture,
) -> None:
    exporter, provider = _exporter()
    rig = Rig(clock=TickingClock(), tracing=RequestTracing(False, provider))
    with caplog.at_level(logging.DEBUG, logger="sgl_pd.trace"):
        _one_request(rig)
        _wait(lambda: len([r for r in caplog.records if r.name == "sgl_pd.trace"]) == 2)
    rig.prefill.writers.close()
    assert exporter.get_finished_spans() == ()
    lines = {
        r.getMessage().split(" role=")[1].split()[0]: r.getMessage()
        for r in caplog.records
        if r.name == "sgl_pd.trace"
    }
    assert set(lines) == {"prefill", "decode"}
    assert all(line.startswith(TRACE_LINE_PREFIX) for line in lines.values())
    assert f"room={ROOM}" in lines["prefill"] and f"room={ROOM}" in lines["decode"]
    chunks = -(-len(SRC) // CHUNK_PAGES)
    assert lines["prefill"].count(f"{CHUNK}=") == chunks
    for name in (REQUEST, BOOTSTRAP, TRANSFER):
        assert f" {name}=" in lines["prefill"]
    for name in (REQUEST, BOOTSTRAP, KV_WAIT, HAND_OFF):
        assert f" {name}=" in lines["decode"]


def test_with_tracing_off_and_no_debug_log_nothing_is_built() -> None:
    tracing = RequestTracing(False)
    logging.getLogger("sgl_pd.trace").setLevel(logging.INFO)
    try:
        assert not tracing.wanted
    finally:
        logging.getLogger("sgl_pd.trace").setLevel(logging.NOTSET)


def test_a_failed_request_ends_its_decode_root_with_an_error() -> None:
    exporter, provider = _exporter()
    rig = Rig(clock=TickingClock(), tracing=RequestTracing(True, provider))
    d = rig.add_decoder("decode-a")
    rig.request(d, ROOM, DST, slot=1)  # the prefill never comes
    d.messenger.fail(ROOM, "client went away", AbortReason.CLIENT)
    d.messenger.forget(ROOM)
    rig.prefill.writers.close()
    (root,) = [s for s in exporter.get_finished_spans() if s.name == REQUEST]
    assert root.status.status_code is trace.StatusCode.ERROR
    names = {s.name for s in exporter.get_finished_spans()}
    assert names == {REQUEST, BOOTSTRAP}  # it stopped before its KV arrived


def test_spans_attach_under_sglangs_request_span_when_the_request_was_seen() -> None:
    """With SGLang's request context remembered (its queue hook), our root is a child of
    SGLang's request span, in its trace."""
    exporter, provider = _exporter()
    sglang_root = provider.get_tracer("sglang server").start_span("decode Req 1234")
    req = SimpleNamespace(
        bootstrap_room=ROOM,
        time_stats=SimpleNamespace(
            trace_ctx=SimpleNamespace(
                tracing_enable=True, root_span_context=trace.set_span_in_context(sglang_root)
            )
        ),
    )
    remember_request(None, req)
    timeline = Timeline("decode", ROOM, 0, Stage(REQUEST, 1.0, 2.0), (Stage(KV_WAIT, 1.5, 1.9),))
    RequestTracing(True, provider).emit(timeline)
    sglang_root.end()
    ours = {s.name: s for s in exporter.get_finished_spans()}
    assert ours[REQUEST].parent is not None
    assert ours[REQUEST].parent.span_id == sglang_root.get_span_context().span_id
    assert ours[REQUEST].context.trace_id == sglang_root.get_span_context().trace_id
    # taken once: the next timeline of the room falls back to the room's trace
    RequestTracing(True, provider).emit(timeline)
    last = [s for s in exporter.get_finished_spans() if s.name == REQUEST][-1]
    assert last.context.trace_id == room_trace_ids(ROOM)[0]


def test_the_placement_decision_is_a_span_inside_the_requests_own() -> None:
    """Where a request's prefill runs, and why, is a span of its own: inside SGLang's span
    of the request when it is traced, else under the room's derived parent."""
    from sgl_pd.backend.tracing import PLACEMENT_SPAN, placement_span

    exporter, provider = _exporter()
    tracer = provider.get_tracer("sglang")
    with tracer.start_as_current_span("sglang request") as request_span:
        request_trace = SimpleNamespace(
            tracing_enable=True, root_span_context=trace.set_span_in_context(request_span)
        )
        placement_span(
            request_trace, ROOM, {"prefill": "local", "reason": "cached_prefix"}, provider
        )
    placement_span(None, ROOM, {"prefill": "10.0.0.1:8998", "predicted_s": 0.25}, provider)
    inside, derived = [s for s in exporter.get_finished_spans() if s.name == PLACEMENT_SPAN]
    assert inside.parent is not None
    assert inside.parent.span_id == request_span.get_span_context().span_id
    assert inside.attributes is not None and inside.attributes["sgl_pd.reason"] == "cached_prefix"
    trace_id, parent_id = room_trace_ids(ROOM)
    assert derived.context.trace_id == trace_id and derived.parent.span_id == parent_id
    assert derived.attributes["sgl_pd.predicted_s"] == 0.25
    assert derived.attributes["sgl_pd.bootstrap_room"] == str(ROOM)
