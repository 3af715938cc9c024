"""The transfer metrics with prometheus_client in-process: names and labels follow
Prometheus' conventions, every failure is counted once under its cause on the side where
it arose, and per-request histograms count each completed request once."""

from __future__ import annotations

import re
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from sgl_pd.backend.failure_cause import cause_of, cause_of_abort, cause_of_code
from sgl_pd.backend.metrics import LIVENESS_KINDS, TransferMetrics
from sgl_pd.core.errors import CorruptFrame, DuplicateCompletion, LayoutMismatch, PlanError
from sgl_pd.core.failures import FailureCause
from sgl_pd.core.states import DecodeState, PrefillState
from sgl_pd.core.wire import AbortReason, ErrorCode
from sgl_pd.messenger.errors import BootstrapError
from sgl_pd.messenger.errors import PeerUnreachable as InboxUnreachable
from sgl_pd.transfer.errors import InvalidWrites, PeerUnreachable, TransferFailed

from .pd_fakes import Rig, wait_state

_C = FailureCause


def _value(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def _failures(rig: Rig, role: str, cause: FailureCause) -> float:
    return _value(
        rig.registries[role], "sgl_pd_transfer_failures_total", role=role, cause=cause.value
    )


def _all_failures(rig: Rig, role: str) -> dict[str, float]:
    return {c.value: _failures(rig, role, c) for c in FailureCause}


def _wait(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


# -- names, labels ---------------------------------------------------------------------


def test_names_and_labels_follow_prometheus_conventions() -> None:
    registry = CollectorRegistry()
    TransferMetrics(True, "prefill", registry)
    text = generate_latest(registry).decode()
    types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    types = {k: v for k, v in types.items() if not k.endswith("_created")}  # client's own
    assert types == {
        "sgl_pd_transfer_bytes_total": "counter",
        "sgl_pd_transfer_pages_total": "counter",
        "sgl_pd_transfer_requests_total": "counter",
        "sgl_pd_transfer_failures_total": "counter",
        "sgl_pd_liveness_losses_total": "counter",
        "sgl_pd_control_messages_total": "counter",
        "sgl_pd_decode_prefix_tokens_total": "counter",
        "sgl_pd_decode_received_tokens_total": "counter",
        "sgl_pd_kv_bytes_not_sent_total": "counter",
        "sgl_pd_transfer_seconds": "histogram",
        "sgl_pd_exposed_transfer_seconds": "histogram",
        "sgl_pd_bootstrap_wait_seconds": "histogram",
        "sgl_pd_decode_kv_wait_seconds": "histogram",
        "sgl_pd_request_kv_bytes": "histogram",
        "sgl_pd_rooms": "gauge",
        "sgl_pd_writes_in_flight": "gauge",
        "sgl_pd_staging_bytes": "gauge",
        "sgl_pd_table_entries": "gauge",
    }
    for name, kind in types.items():
        if kind == "histogram":  # a unit as the suffix
            assert name.endswith(("_seconds", "_bytes")), name
        assert (kind == "counter") == name.endswith("_total"), name
    # bounded labels: role everywhere, cause and kind only from their closed sets
    labels = set(re.findall(r"(\w+)=\"", text))
    assert labels <= {"role", "cause", "kind", "event", "le"}  # (table: once set, below)
    causes = set(re.findall(r'cause="(\w+)"', text))
    assert causes == {c.value for c in FailureCause}  # all exported at 0 from the start
    assert set(re.findall(r'kind="(\w+)"', text)) == set(LIVENESS_KINDS)
    assert re.search(r'^sgl_pd_transfer_failures_total\{cause="abort",role="prefill"\} 0.0$',
                     text, re.M)  # fmt: skip


def test_a_disabled_object_registers_and_records_nothing() -> None:
    metrics = TransferMetrics(False, "decode")
    metrics.add_failure(FailureCause.ABORT)
    metrics.prefill_done(0.1, 0.1, 10)
    metrics.peer_lost("gone")


def test_observations_land_in_their_series() -> None:
    registry = CollectorRegistry()
    metrics = TransferMetrics(True, "decode", registry)
    metrics.decode_done(0.02)
    metrics.bootstrap_waited(0.5)
    metrics.add_failure(FailureCause.TIMEOUT)
    metrics.add_failure(FailureCause.TIMEOUT)
    metrics.peer_lost("hung")
    metrics.set_live(3, 2, 4096)
    assert _value(registry, "sgl_pd_decode_kv_wait_seconds_count", role="decode") == 1
    assert _value(registry, "sgl_pd_decode_kv_wait_seconds_sum", role="decode") == 0.02
    assert _value(registry, "sgl_pd_bootstrap_wait_seconds_count", role="decode") == 1
    failures = "sgl_pd_transfer_failures_total"
    assert _value(registry, failures, role="decode", cause="timeout") == 2
    assert _value(registry, failures, role="decode", cause="abort") == 0
    assert _value(registry, "sgl_pd_liveness_losses_total", role="decode", kind="hung") == 1
    assert _value(registry, "sgl_pd_rooms", role="decode") == 3
    assert _value(registry, "sgl_pd_staging_bytes", role="decode") == 4096
    assert _value(registry, "sgl_pd_writes_in_flight", role="decode") == 2


# -- failure causes ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("error", "cause"),
    [
        (TransferFailed("peer", 3, 4096, "injected failure"), _C.WRITE_FAILURE),
        (InvalidWrites("unregistered source"), _C.WRITE_FAILURE),
        (DuplicateCompletion("twice"), _C.WRITE_FAILURE),
        (PeerUnreachable("10.0.0.2:15000", "refused"), _C.PEER_LOST),
        (InboxUnreachable("tcp://10.0.0.2:9000", "timed out"), _C.PEER_LOST),
        (TimeoutError("no answer"), _C.TIMEOUT),
        (LayoutMismatch("hash"), _C.REFUSED),
        (CorruptFrame("magic"), _C.REFUSED),
        (PlanError("pages too short"), _C.REFUSED),
        (BootstrapError("registry said no"), _C.REFUSED),
        (RuntimeError("a bug"), _C.WRITE_FAILURE),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, BaseException) else v.value,
)
def test_errors_map_to_their_cause(error: BaseException, cause: FailureCause) -> None:
    assert cause_of(error) is cause


def test_every_error_code_and_abort_reason_has_a_cause() -> None:
    assert {cause_of_code(c) for c in ErrorCode} == {_C.REFUSED, _C.WRITE_FAILURE}
    assert cause_of_code(ErrorCode.TRANSFER_FAILED) is _C.WRITE_FAILURE
    assert cause_of_code(ErrorCode.NOT_OWNER) is _C.REFUSED
    assert cause_of_abort(AbortReason.CLIENT) is _C.ABORT
    assert cause_of_abort(AbortReason.TIMEOUT) is _C.TIMEOUT
    assert {cause_of_abort(r) for r in AbortReason} <= set(FailureCause)


# -- at the call sites (in-memory engine) ------------------------------------------------


def test_n_requests_count_n_in_every_per_request_histogram() -> None:
    rig = Rig(metered=True)
    d = rig.add_decoder("decode-a")
    n = 5
    for i in range(n):
        room = 100 + i
        rig.request(d, room, list(range(30 + 4 * i, 34 + 4 * i)), slot=i + 1)
        rig.prefill_all(room, list(range(10 + 4 * i, 14 + 4 * i)))
        wait_state(d, room, DecodeState.COMPLETE)
        _wait(lambda r=room: rig.prefill.state(r) == (PrefillState.DONE, True, None))
    p, dec = rig.registries["prefill"], rig.registries["decode"]
    for name in (
        "sgl_pd_exposed_transfer_seconds_count",
        "sgl_pd_bootstrap_wait_seconds_count",
        "sgl_pd_request_kv_bytes_count",
        "sgl_pd_transfer_seconds_count",
    ):
        assert _value(p, name, role="prefill") == n, name
    assert _value(dec, "sgl_pd_decode_kv_wait_seconds_count", role="decode") == n
    assert _value(dec, "sgl_pd_transfer_seconds_count", role="decode") == n
    # decode's histograms that belong to the prefill side stay empty, and the reverse
    assert _value(dec, "sgl_pd_exposed_transfer_seconds_count", role="decode") == 0
    assert _value(p, "sgl_pd_decode_kv_wait_seconds_count", role="prefill") == 0
    sent = _value(p, "sgl_pd_transfer_bytes_total", role="prefill")
    assert _value(p, "sgl_pd_request_kv_bytes_sum", role="prefill") == sent > 0
    assert sum(_all_failures(rig, "prefill").values()) == 0
    assert sum(_all_failures(rig, "decode").values()) == 0
    rig.prefill.writers.close()


def test_a_failed_write_counts_one_write_failure_on_each_side() -> None:
    rig = Rig(metered=True)
    d = rig.add_decoder("decode-a")
    rig.prefill_engine.fail_next(1)
    rig.request(d, 7, list(range(30, 34)), slot=1)
    rig.prefill_all(7, list(range(10, 14)))
    wait_state(d, 7, DecodeState.FAILED)
    d.messenger.fail(7, "transfer failed")  # what the receiver does next: not counted again
    for role in ("prefill", "decode"):
        assert _all_failures(rig, role) == {**dict.fromkeys(_all_failures(rig, role), 0.0),
                                            "write_failure": 1.0}, role  # fmt: skip
    rig.prefill.writers.close()


def test_a_client_abort_counts_one_abort_at_the_decoder_only() -> None:
    rig = Rig(metered=True)
    d = rig.add_decoder("decode-a")
    rig.prefill_engine.gate.clear()
    rig.request(d, 9, list(range(30, 42)), slot=2)
    rig.prefill_all(9, list(range(10, 22)))
    assert rig.prefill_engine.waiting.wait(5)
    d.messenger.fail(9, "client went away", AbortReason.CLIENT)
    d.messenger.fail(9, "client went away", AbortReason.CLIENT)  # a second call: no count
    rig.prefill_engine.gate.set()
    assert _failures(rig, "decode", _C.ABORT) == 1
    assert sum(_all_failures(rig, "decode").values()) == 1
    assert sum(_all_failures(rig, "prefill").values()) == 0  # the decoder's doing
    rig.prefill.writers.close()


def test_lost_peers_count_peer_lost_on_the_side_that_lost_them() -> None:
    rig = Rig(metered=True)
    d = rig.add_decoder("decode-a")
    rig.request(d, 3, list(range(30, 34)), slot=3)
    d.messenger.peer_lost("prefill-0", "peer prefill-0 is gone", gone=True)
    assert _failures(rig, "decode", _C.PEER_LOST) == 1
    rig.request(d, 4, list(range(40, 44)), slot=4)
    rig.prefill.track(4)
    rig.prefill.peer_lost("decode-a", "peer decode-a hung", gone=False)
    assert _failures(rig, "prefill", _C.PEER_LOST) == 2  # rooms 3 and 4 went to decode-a
    rig.prefill.writers.close()


def test_timeouts_count_once_on_each_side() -> None:
    rig = Rig(metered=True)
    d = rig.add_decoder("decode-a")
    rig.request(d, 6, list(range(30, 34)), slot=5)  # the router's copy never reaches prefill
    rig.clock.advance(31.0)  # past both sides' 30 s timeouts
    rig.prefill.housekeeping()
    d.messenger.housekeeping()
    d.messenger.housekeeping()
    assert d.messenger.poll(6)[0] in (DecodeState.FAILED, DecodeState.TIMED_OUT)
    assert _failures(rig, "prefill", _C.TIMEOUT) == 1
    # the prefill's timeout reached the decoder first, as an error it reports
    assert sum(_all_failures(rig, "decode").values()) == 1
    rig.prefill.writers.close()


def test_a_refused_request_counts_refused_on_both_sides() -> None:
    rig = Rig(metered=True)
    d = rig.add_decoder("decode-a")
    rig.request(d, 11, list(range(30, 34)), slot=6)
    other = rig.add_decoder("decode-b")  # another instance (its own registry) asks for it
    rig.request(other, 11, list(range(30, 34)), slot=6)
    assert _failures(rig, "prefill", _C.REFUSED) == 1
    assert _failures(rig, "decode", _C.REFUSED) == 1  # decode-b heard why
    rig.prefill.writers.close()


def test_the_prefill_side_counts_its_own_abort() -> None:
    rig = Rig(metered=True)
    d = rig.add_decoder("decode-a")
    rig.request(d, 12, list(range(30, 34)), slot=7)
    rig.prefill.track(12)
    rig.prefill.abort(12, "aborted by SGLang")
    assert _failures(rig, "prefill", _C.ABORT) == 1
    rig.prefill.writers.close()


def test_control_message_counters_follow_running_totals() -> None:
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry()
    metrics = TransferMetrics(True, "decode", registry)
    metrics.control_totals({"resent": 3, "duplicate": 1})
    metrics.control_totals({"resent": 5, "duplicate": 1, "injected_drop": 2})
    assert _value(registry, "sgl_pd_control_messages_total", role="decode", event="resent") == 5
    assert _value(registry, "sgl_pd_control_messages_total", role="decode", event="duplicate") == 1
    assert (
        _value(registry, "sgl_pd_control_messages_total", role="decode", event="injected_drop") == 2
    )


def test_placements_count_why_their_prefill_server_was_chosen() -> None:
    from sgl_pd.backend.metrics import PlacementMetrics

    registry = CollectorRegistry()
    placements = PlacementMetrics(True, registry)
    placements.placed(0)
    placements.placed(384)
    placements.placed(128)
    counts = {
        reason: _value(registry, "sgl_pd_prefill_placements_total", reason=reason)
        for reason in ("cached_prefix", "load")
    }
    assert counts == {"cached_prefix": 2.0, "load": 1.0}
    assert _value(registry, "sgl_pd_prefill_placement_cached_tokens_total") == 512.0
    PlacementMetrics(False).placed(5)  # off: nothing registered, nothing raised


def test_local_prefills_count_why_the_decoder_kept_them() -> None:
    from sgl_pd.backend.metrics import PlacementMetrics
    from sgl_pd.core.placement import LOCAL_REASONS

    registry = CollectorRegistry()
    placements = PlacementMetrics(True, registry)
    placements.local("cached_prefix")
    placements.local("cached_prefix")
    placements.local("unavailable")
    counts = {
        reason: _value(registry, "sgl_pd_local_prefills_total", reason=reason)
        for reason in LOCAL_REASONS
    }
    assert counts == {"cached_prefix": 2.0, "saturated": 0.0, "unavailable": 1.0}
    PlacementMetrics(False).local("saturated")  # off: nothing registered, nothing raised


def test_local_steps_count_whether_they_mixed_the_streams_in() -> None:
    from sgl_pd.backend.metrics import LOCAL_STEP_KINDS, PlacementMetrics

    registry = CollectorRegistry()
    placements = PlacementMetrics(True, registry)
    placements.stepped(mixed=True)
    placements.stepped(mixed=False)
    placements.stepped(mixed=False)
    counts = {
        kind: _value(registry, "sgl_pd_local_prefill_steps_total", kind=kind)
        for kind in LOCAL_STEP_KINDS
    }
    assert counts == {"mixed": 1.0, "unmixed": 2.0}
    PlacementMetrics(False).stepped(mixed=True)  # off: nothing registered, nothing raised


def test_table_entries_are_exported_per_table() -> None:
    registry = CollectorRegistry()
    metrics = TransferMetrics(True, "decode", registry)
    metrics.set_tables({"tracks": 3, "control_pending": 0})
    metrics.set_tables({"tracks": 1, "control_pending": 2})
    assert _value(registry, "sgl_pd_table_entries", role="decode", table="tracks") == 1.0
    assert _value(registry, "sgl_pd_table_entries", role="decode", table="control_pending") == 2.0
    TransferMetrics(False, "decode").set_tables({"tracks": 1})  # off: nothing raised
