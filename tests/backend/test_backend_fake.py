"""The backend's request state machines against the in-memory transfer engine: pages are
released only after the writers stopped, a slow decoder delays only its own requests,
and a lost peer fails exactly what it touched."""

from __future__ import annotations

import time

import numpy as np
import pytest

from sgl_pd.core.page_ids import PageIds
from sgl_pd.core.states import DecodeState, PrefillState
from sgl_pd.core.wire import AbortAck, AbortReason

from .pd_fakes import LAYOUT, Rig, wait_state


def _acks(rig: Rig, room: int) -> list[AbortAck]:
    return [m for _, m in rig.sent if isinstance(m, AbortAck) and m.request_id == room]


def _wait(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_a_request_arrives_byte_for_byte_and_counts_complete() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    src, dst = list(range(10, 20)), list(range(30, 40))
    rig.request(d, 5, dst, slot=1)
    rig.prefill_all(5, src)
    wait_state(d, 5, DecodeState.COMPLETE)
    for s, t in zip(src, dst, strict=True):
        assert d.memory.page(t) == rig.prefill_memory.page(s)
    d.messenger.hand_off(5)
    assert d.messenger.poll(5) == (DecodeState.HANDED_OFF, None)
    _wait(lambda: rig.prefill.state(5) == (PrefillState.DONE, True, None))
    rig.prefill.writers.close()


def test_the_decoder_counts_each_remote_prefill_in_flight_until_it_ends() -> None:
    """What a new remote prefill would queue behind (`RemoteCost`): a request's tokens
    from its ask until it handed off, or until SGLang let go of it."""
    rig = Rig()
    d = rig.add_decoder("decode-a")
    remote = d.messenger.remote_cost
    page = LAYOUT.page_size
    rig.request(d, 5, list(range(30, 40)), slot=1)
    rig.request(d, 6, list(range(40, 44)), slot=2)
    rig.request(d, 7, list(range(44, 46)), slot=3, held_tokens=page, kv_tokens=3 * page)
    assert remote.in_flight_tokens == (10 + 4 + 2) * page
    rig.clock.advance(0.25)  # (the prefill takes a while: it is learnt)
    rig.prefill_all(5, list(range(10, 20)))
    wait_state(d, 5, DecodeState.COMPLETE)
    d.messenger.hand_off(5)
    assert remote.in_flight_tokens == 6 * page and remote.learnt == 1
    d.messenger.forget(6)  # SGLang let go of it
    d.messenger.fail(7, "the client went away")  # its prefill is told to stop
    assert remote.in_flight_tokens == 0 and remote.learnt == 1
    rig.prefill.writers.close()


@pytest.mark.parametrize("streamer_lags", [False, True])
def test_a_draft_layer_streams_at_the_send_and_the_metadata_waits_for_it(
    streamer_lags: bool,
) -> None:
    """Layer by layer with a speculative draft layer: the target's layers go as the
    forward runs, the draft's at SGLang's send (it runs after the target), and every
    layer of every chunk arrives byte for byte before the request counts complete."""
    rig = Rig(layerwise=True, draft_layers=1)
    d = rig.add_decoder("decode-a")
    src, dst = list(range(10, 20)), list(range(30, 40))
    rig.request(d, 5, dst, slot=1)
    rig.prefill_layerwise(5, src, streamer_lags=streamer_lags)
    wait_state(d, 5, DecodeState.COMPLETE)
    for s, t in zip(src, dst, strict=True):
        assert d.memory.page(t) == rig.prefill_memory.page(s)
    rig.prefill.writers.close()


def test_the_metadata_is_not_due_before_the_last_chunks_draft_layers_are_queued() -> None:
    rig = Rig(layerwise=True, draft_layers=1)
    d = rig.add_decoder("decode-a")
    rig.request(d, 6, [1, 2], slot=2)
    rig.prefill.track(6)
    rig.prefill.expect(6, 2, aux_index=0)
    chunk = rig.prefill.notice_chunk(6, PageIds.ready(np.arange(2)), 2, True)
    assert chunk is not None
    rig.prefill.write_layers([chunk], range(3))
    rig.prefill.forward_done([chunk])  # the target's layers: all queued
    assert rig.prefill.rooms.take_metadata_due(6) == []  # no send yet: no draft KV
    writes = rig.prefill.rooms.submit_chunk(6, np.arange(2), 2)
    assert [(c.index, layers) for c, layers in writes] == [(0, range(3, 4))]
    assert rig.prefill.rooms.take_metadata_due(6) == []  # not queued yet
    rig.prefill.rooms.writes_queued(6, writes)
    assert len(rig.prefill.rooms.take_metadata_due(6)) == 1
    rig.prefill.writers.close()


def test_an_abort_is_acked_only_after_the_write_in_flight_ended() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.prefill_engine.gate.clear()  # hold the first data batch in flight
    rig.request(d, 9, list(range(30, 42)), slot=2)
    rig.prefill_all(9, list(range(10, 22)), chunk=4)
    assert rig.prefill_engine.waiting.wait(5)
    d.messenger.fail(9, "client went away", AbortReason.CLIENT)
    time.sleep(0.05)
    assert _acks(rig, 9) == []  # a write is still in flight: no ack, pages stay held
    assert not d.messenger.is_release_safe(9, 1)
    state, drained, _ = rig.prefill.state(9)  # type: ignore[misc]
    assert state is PrefillState.ABORTED and not drained  # SGLang sees Transferring
    rig.prefill_engine.gate.set()
    _wait(lambda: bool(_acks(rig, 9)))
    assert d.messenger.is_release_safe(9, 1)
    assert rig.prefill.state(9) == (PrefillState.ABORTED, True, "decoder aborted: client")
    assert rig.prefill_engine.data_batches == 1  # nothing started after the abort
    rig.prefill.writers.close()


def test_a_slow_decoder_delays_only_its_own_requests() -> None:
    rig = Rig()
    slow, fast = rig.add_decoder("decode-slow"), rig.add_decoder("decode-fast")
    rig.prefill_engine.hold_peer = slow.engine.session_id
    rig.prefill_engine.gate.clear()
    rig.request(slow, 1, list(range(30, 34)), slot=1)
    rig.prefill_all(1, list(range(10, 14)))
    assert rig.prefill_engine.waiting.wait(5)  # the slow decoder's writer is stuck
    rig.request(fast, 2, list(range(40, 44)), slot=1)
    rig.prefill_all(2, list(range(14, 18)))
    wait_state(fast, 2, DecodeState.COMPLETE)  # while the slow one is still held
    assert slow.messenger.poll(1)[0] is DecodeState.REQUESTED
    rig.prefill_engine.gate.set()
    wait_state(slow, 1, DecodeState.COMPLETE)
    rig.prefill.writers.close()


def test_a_lost_prefill_rank_fails_its_requests_and_releases_their_pages() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.request(d, 3, list(range(30, 34)), slot=3)
    assert set(d.messenger.active_peers()) == {"prefill-0"}
    d.messenger.peer_lost("prefill-0", "peer prefill-0 did not answer heartbeats", gone=True)
    state, error = d.messenger.poll(3)
    assert state is DecodeState.FAILED and "heartbeats" in (error or "")
    assert d.messenger.is_release_safe(3, 1)
    assert d.messenger.active_peers() == {}
    rig.prefill.writers.close()


def test_a_silent_but_living_prefill_rank_keeps_the_pages_until_it_acks() -> None:
    """Heartbeats can go unanswered under load: the request fails at once, but its pages
    stay held until the rank acks the Abort (it may still be writing)."""
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.prefill_engine.gate.clear()
    rig.request(d, 12, list(range(30, 42)), slot=6)
    rig.prefill_all(12, list(range(10, 22)))
    assert rig.prefill_engine.waiting.wait(5)  # a write is in flight
    d.messenger.peer_lost("prefill-0", "peer prefill-0 did not answer heartbeats", gone=False)
    assert d.messenger.poll(12)[0] is DecodeState.FAILED  # the client hears now
    assert not d.messenger.is_release_safe(12, 1)  # but the pages are not free yet
    d.messenger.fail(12, "peer prefill-0 did not answer heartbeats")  # what the receiver does
    assert not d.messenger.is_release_safe(12, 1)
    rig.prefill_engine.gate.set()
    _wait(lambda: d.messenger.is_release_safe(12, 1))
    rig.prefill.writers.close()


def test_a_lost_decoder_stops_the_writes_into_it() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.request(d, 4, list(range(30, 34)), slot=4)
    rig.prefill.track(4)
    assert set(rig.prefill.active_peers()) == {"decode-a"}
    rig.prefill.peer_lost("decode-a", "peer decode-a did not answer heartbeats", gone=False)
    state, drained, error = rig.prefill.state(4)  # type: ignore[misc]
    assert state is PrefillState.FAILED and drained and "heartbeats" in (error or "")
    rig.prefill.expect(4, 4, aux_index=0)
    rig.prefill.submit_chunk(4, __import__("numpy").arange(4), 4)
    time.sleep(0.05)
    assert rig.prefill_engine.data_batches == 0
    rig.prefill.writers.close()


def test_an_abort_for_an_unknown_request_is_acked_at_once() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    from sgl_pd.core.wire import Abort

    abort = Abort(request_id=77, reason=AbortReason.ERROR, decoder_instance=7, reply_to="decode-a")
    rig.prefill.on_abort(abort)
    assert len(_acks(rig, 77)) == 1 and d is not None
    # the router's copy of the request comes later: it fails at once, it does not wait
    rig.prefill.track(77)
    state, drained, _ = rig.prefill.state(77)  # type: ignore[misc]
    assert state is PrefillState.ABORTED and drained
    rig.prefill.writers.close()


def test_a_request_aborted_before_its_pages_were_asked_for_is_dropped_by_the_prefiller() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.prefill.track(8)  # the router's copy; the decoder never sends a TransferRequest
    d.messenger.abort_unrequested(8, ["prefill-0"], "client went away", AbortReason.CLIENT)
    state, drained, _ = rig.prefill.state(8)  # type: ignore[misc]
    assert state is PrefillState.ABORTED and drained
    assert _acks(rig, 8) == []  # nothing was in flight and nobody waits for an ack
    rig.prefill.writers.close()


def test_requests_no_sender_claimed_are_swept_and_timeouts_fire() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.request(d, 6, list(range(30, 34)), slot=5)  # the router's copy never reaches prefill
    assert len(rig.prefill.rooms) == 1
    rig.clock.advance(31.0)  # past the prefill's timeout: READY -> TIMED_OUT
    rig.prefill.housekeeping()
    state, drained, _ = rig.prefill.state(6)  # type: ignore[misc]
    assert state is PrefillState.TIMED_OUT and drained
    rig.clock.advance(61.0)
    rig.prefill.housekeeping()
    assert len(rig.prefill.rooms) == 0
    d.messenger.housekeeping()
    state_d, error = d.messenger.poll(6)  # the prefill's timeout reached the decoder first
    assert state_d is DecodeState.FAILED and "no progress for 31.0 s (ready)" in (error or "")
    rig.prefill.writers.close()
