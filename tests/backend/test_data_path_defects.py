"""Data-path defects, each reproduced against the backend over the in-memory engine: an
early send waits for the forward that writes its pages, a page a queued write names is
never reused before the write ended, a failed batch keeps its request undrained while
its writes may land, requests SGLang drops itself neither leak nor leave decoders
waiting, losing one decode rank tells the others, and deadlines bound stalls, not long
transfers that keep moving."""

from __future__ import annotations

import threading
import time

import msgspec
import numpy as np
import pytest

from sgl_pd.backend.prefill.drain import FAILED_BATCH_QUARANTINE_S
from sgl_pd.backend.prefill.retention import UNOWNED_GRACE_S
from sgl_pd.core.page_ids import PageIds
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.states import DecodeState, PrefillState
from sgl_pd.core.wire import Abort, AbortAck, AbortReason, ErrorMsg, TransferRequest
from sgl_pd.transfer.engine import Writes
from sgl_pd.transfer.errors import TransferFailed
from sgl_pd.transfer.fake import FakeFabric, FakeTransferEngine

from .pd_fakes import GatedEngine, Rig, wait_state


def _wait(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def _errors(rig: Rig, inbox: str, room: int) -> list[ErrorMsg]:
    return [
        m for to, m in rig.sent if to == inbox and isinstance(m, ErrorMsg) and m.request_id == room
    ]


def _acks(rig: Rig, room: int) -> list[AbortAck]:
    return [m for _, m in rig.sent if isinstance(m, AbortAck) and m.request_id == room]


# -- 1: SGLang's early send under the overlap scheduler ----------------------------------


class _ForwardEvent:
    """SGLang's `_early_send_wait_event`: the previous forward, still writing the
    prefix pages on the forward stream, completes when `done` is set."""

    def __init__(self) -> None:
        self.done = threading.Event()

    def synchronize(self) -> None:
        assert self.done.wait(10)


def test_an_early_send_is_written_only_after_the_forward_writing_its_pages() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.request(d, 12, list(range(30, 34)), slot=7)
    rig.prefill.track(12)
    rig.prefill.expect(12, 4, aux_index=7)
    forward = _ForwardEvent()
    rig.prefill.submit_chunk(12, np.arange(10, 14), 4, ready=forward)
    time.sleep(0.3)  # the writer would have written by now
    assert rig.prefill.rooms.rooms_of([12])[0].bytes_sent == 0
    forward.done.set()
    wait_state(d, 12, DecodeState.COMPLETE)
    rig.prefill.writers.close()


# -- 3: pages a queued write names stay pinned ---------------------------------------------


def test_a_page_freed_while_a_write_is_queued_is_held_until_the_write_ended() -> None:
    """The radix cache frees a request's duplicate prefix while its layer jobs still name
    those pages: they must not reach SGLang's free list before the writes ended."""
    rig = Rig(layerwise=True)
    d = rig.add_decoder("decode-a")
    rig.prefill_engine.gate.clear()  # the writer lags
    rig.request(d, 5, list(range(30, 34)), slot=1)
    rig.prefill.track(5)
    rig.prefill.expect(5, 4, aux_index=1)
    chunk = rig.prefill.notice_chunk(5, PageIds.ready(np.arange(10, 14)), 4, True)
    assert chunk is not None
    rig.prefill.write_layers([chunk], range(4))
    assert rig.prefill_engine.waiting.wait(5)
    pins = rig.prefill.rooms.pins
    now, held = pins.split(np.array([10, 11, 50]))  # SGLang frees two of them and another
    assert now.tolist() == [False, False, True] and held.tolist() == [True, True, False]
    assert pins.take_releasable() == [] and pins.held == 2
    rig.prefill.forward_done([chunk])
    rig.prefill.submit_chunk(5, np.arange(10, 14), 4)
    rig.prefill_engine.gate.set()
    wait_state(d, 5, DecodeState.COMPLETE)
    _wait(lambda: pins.held == 0)
    assert sorted(pins.take_releasable()) == [10, 11]
    assert not pins.active  # every pin went with the request
    rig.prefill.writers.close()


def test_pins_go_with_failed_and_aborted_requests_once_drained() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.prefill_engine.gate.clear()
    rig.request(d, 9, list(range(30, 38)), slot=2)
    rig.prefill_all(9, list(range(10, 18)), chunk=4)
    assert rig.prefill_engine.waiting.wait(5)
    d.messenger.fail(9, "client went away", AbortReason.CLIENT)
    assert rig.prefill.rooms.pins.owners == 1  # a write still reads them
    rig.prefill_engine.gate.set()
    _wait(lambda: rig.prefill.rooms.pins.owners == 0)
    rig.prefill.writers.close()


# -- 2: a failed batch may still land ------------------------------------------------------


class PartlyFailingEngine(GatedEngine):
    """Mooncake's behaviour on a failed batch: the first data batch reports failure at
    once while half of its writes are still posted; they land when `late` is set."""

    def __init__(self, fabric: FakeFabric) -> None:
        super().__init__(fabric)
        self.late = threading.Event()
        self.landed = threading.Event()
        self._failed = False

    def write(self, peer: str, writes: Writes) -> None:
        if writes.total_bytes > 8 * len(writes) and not self._failed:
            self._failed = True
            half = len(writes) // 2
            rest = Writes.of(writes.src[half:], writes.dst[half:], writes.nbytes[half:])

            def land_late() -> None:
                self.late.wait(10)
                FakeTransferEngine.write(self, peer, rest)
                self.landed.set()

            threading.Thread(target=land_late, daemon=True).start()
            raise TransferFailed(peer, len(writes), writes.total_bytes, "one task failed")
        super().write(peer, writes)


def test_a_failed_batch_keeps_the_request_undrained_while_its_writes_may_land() -> None:
    rig = Rig(engine_type=PartlyFailingEngine)
    engine = rig.prefill_engine
    assert isinstance(engine, PartlyFailingEngine)
    d = rig.add_decoder("decode-a")
    rig.request(d, 4, list(range(30, 34)), slot=4)
    rig.prefill_all(4, list(range(10, 14)))
    _wait(lambda: d.messenger.poll(4)[0] is DecodeState.FAILED)
    state, drained, _ = rig.prefill.state(4)  # type: ignore[misc]
    assert state is PrefillState.FAILED and not drained  # SGLang keeps the source pages
    d.messenger.fail(4, "prefill failed")
    rig.prefill.housekeeping()
    assert _acks(rig, 4) == [] and not d.messenger.is_release_safe(4, 1)
    engine.late.set()
    assert engine.landed.wait(5)  # ... and this is why the pages had to wait
    rig.clock.advance(FAILED_BATCH_QUARANTINE_S + 1)
    rig.prefill.housekeeping()
    assert _acks(rig, 4) and d.messenger.is_release_safe(4, 1)
    assert rig.prefill.state(4)[1]  # type: ignore[index]
    rig.prefill.writers.close()


def test_a_batch_that_posted_nothing_drains_at_once() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    failing = rig.prefill_engine
    original = failing.write

    def refuse(peer: str, writes: Writes) -> None:
        if writes.total_bytes > 8 * len(writes):
            raise TransferFailed(peer, len(writes), writes.total_bytes, "no", may_still_land=False)
        original(peer, writes)

    failing.write = refuse  # type: ignore[method-assign]
    rig.request(d, 3, list(range(30, 34)), slot=3)
    rig.prefill_all(3, list(range(10, 14)))
    _wait(lambda: rig.prefill.state(3) is not None and rig.prefill.state(3)[1])  # type: ignore[index]
    rig.prefill.writers.close()


# -- 4: requests SGLang drops itself --------------------------------------------------------


def test_sglangs_own_abort_tells_the_decoder_and_the_request_does_not_leak() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.request(d, 7, list(range(30, 34)), slot=5)
    rig.prefill.track(7)
    rig.prefill.abort(7, "aborted by the prefill scheduler")  # SGLang never polls again
    assert _errors(rig, "decode-a", 7), "the decoder was not told"
    assert d.messenger.poll(7)[0] is DecodeState.FAILED
    assert len(rig.prefill.rooms) == 1
    rig.clock.advance(UNOWNED_GRACE_S + 1)
    rig.prefill.housekeeping()
    assert len(rig.prefill.rooms) == 0 and not rig.prefill.rooms.pins.active
    rig.prefill.writers.close()


def test_a_request_forgotten_while_its_writes_run_stays_until_they_ended() -> None:
    """A TP rank's poll said Failed, SGLang concluded the request on every rank and
    cleared it here while this rank still writes: pins and the room outlive the clear."""
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.prefill_engine.gate.clear()
    rig.request(d, 8, list(range(30, 34)), slot=6)
    rig.prefill_all(8, list(range(10, 14)))
    assert rig.prefill_engine.waiting.wait(5)
    rig.prefill.forget(8)
    assert rig.prefill.rooms.pins.owners == 1 and len(rig.prefill.rooms) == 1
    rig.prefill_engine.gate.set()
    _wait(lambda: rig.prefill.rooms.pins.owners == 0)
    rig.clock.advance(UNOWNED_GRACE_S + 1)
    rig.prefill.housekeeping()
    assert len(rig.prefill.rooms) == 0
    rig.prefill.writers.close()


# -- 7: one lost decode rank of a request ---------------------------------------------------


def test_losing_one_decode_rank_tells_the_requests_other_decode_ranks() -> None:
    rig = Rig()
    a, b = rig.add_decoder("decode-a"), rig.add_decoder("decode-b")
    rig.request(a, 6, list(range(30, 34)), slot=1)
    rig.request(b, 6, list(range(40, 44)), slot=1)
    rig.prefill.track(6)
    rig.prefill.peer_lost("decode-a", "peer decode-a is gone", gone=True)
    assert _errors(rig, "decode-b", 6), "the surviving decode rank would wait its timeout"
    assert b.messenger.poll(6)[0] is DecodeState.FAILED
    rig.prefill.writers.close()


# -- 8: deadlines bound stalls --------------------------------------------------------------


def test_a_long_transfer_that_keeps_moving_does_not_time_out() -> None:
    rig = Rig()  # transfer timeout 30 s on both sides
    d = rig.add_decoder("decode-a")
    rig.request(d, 2, list(range(30, 42)), slot=2)
    rig.prefill.track(2)
    rig.prefill.expect(2, 12, aux_index=2)
    sent = 0
    for start in range(0, 12, 4):  # three chunks, 20 s apart: 60 s in all
        rig.prefill.submit_chunk(2, np.arange(10 + start, 14 + start), 4)
        _wait(lambda sent=sent: rig.prefill.rooms.rooms_of([2])[0].bytes_sent > sent)  # landed
        sent = rig.prefill.rooms.rooms_of([2])[0].bytes_sent
        _wait(lambda: rig.prefill.state(2)[1])  # type: ignore[index]
        d.messenger.poll(2)  # the decoder sees it arrive
        rig.clock.advance(20.0)
        rig.prefill.housekeeping()
        d.messenger.housekeeping()
        assert rig.prefill.state(2)[2] is None  # type: ignore[index]
    wait_state(d, 2, DecodeState.COMPLETE)
    rig.clock.advance(31.0)  # a stall past the timeout still fails
    rig.request(d, 3, list(range(50, 54)), slot=3)
    rig.prefill.track(3)
    rig.prefill.expect(3, 4, aux_index=3)
    rig.clock.advance(31.0)
    rig.prefill.housekeeping()
    d.messenger.housekeeping()
    assert "no progress" in (rig.prefill.state(3)[2] or "")  # type: ignore[index]
    assert "no progress" in (d.messenger.poll(3)[1] or "")
    rig.prefill.writers.close()


# -- a writer that finds its process (nearly) frozen ----------------------------------------


def test_a_write_job_found_frozen_fails_its_request_instead_of_vanishing() -> None:
    """The prefill process stops for about the hang timeout and a writer runs before the
    liveness thread noticed (or the freeze fell inside the liveness thread's own loop,
    which then never notices): the job must not vanish with the request still healthy -
    its count would never complete and both sides would wait their whole timeout."""
    from sgl_pd.core.clock import ManualClock
    from sgl_pd.core.liveness import FreezeWatch

    clock = ManualClock()
    rig = Rig(clock=clock, freeze=FreezeWatch(clock, hang_timeout_s=20.0))
    d = rig.add_decoder("decode-a")
    rig.request(d, 21, list(range(30, 34)), slot=5)
    rig.clock.advance(19.0)  # no liveness beat for 19 s: a near-freeze
    rig.prefill_all(21, list(range(10, 14)))
    wait_state(d, 21, DecodeState.FAILED)
    state, _, error = rig.prefill.state(21) or (None, None, None)
    assert state is PrefillState.FAILED and "did not run" in (error or "")
    assert "did not run" in _errors(rig, "decode-a", 21)[0].message
    rig.prefill.writers.close()


# -- a bootstrap room reused while its earlier request is being released -------------------


def test_a_room_reused_while_its_pages_are_released_keeps_the_old_release_intact() -> None:
    """A request ends early and waits for its prefill rank's drain ack; a new request
    arrives with the same bootstrap room. Taking the room would let the old ack count
    for the new request (whose pages could then be freed under its writes) and leave the
    old pages waiting for an ack that went elsewhere. The new one is refused instead."""
    from sgl_pd.core.errors import DuplicateRequest

    rig = Rig()
    d = rig.add_decoder("decode-a")
    old_receiver, new_receiver = object(), object()
    rig.prefill_engine.gate.clear()  # the old request's writes stay in flight
    d.messenger.request(
        31, [rig.prefill_registration], d.registration, np.arange(30, 34), 3,
        owner=old_receiver,
    )  # fmt: skip
    rig.prefill_all(31, list(range(10, 14)))
    assert rig.prefill_engine.waiting.wait(5)
    d.messenger.fail(31, "aborted by the client", AbortReason.CLIENT)
    assert not d.messenger.is_release_safe(31, 1)
    with pytest.raises(DuplicateRequest, match="fresh room"):
        d.messenger.request(
            31, [rig.prefill_registration], d.registration, np.arange(40, 44), 4,
            owner=new_receiver,
        )  # fmt: skip
    d.messenger.forget(31, owner=new_receiver)  # SGLang clears the refused receiver
    rig.prefill_engine.gate.set()
    _wait(lambda: bool(_acks(rig, 31)))
    assert d.messenger.is_release_safe(31, 1)  # the old request's ack reached it
    d.messenger.forget(31, owner=old_receiver)
    rig.prefill.writers.close()


# -- orderings that resent control messages make possible ----------------------------------


def _tp2_request(rig: Rig, rank: int, instance: int, room: int) -> TransferRequest:
    base = rig.decoders.get("decode-base") or rig.add_decoder("decode-base")
    registration = msgspec.structs.replace(
        base.registration,
        rank=rank,
        scheme=ShardingScheme(2),
        instance=instance,
        inbox=f"decode-{rank}",
    )
    return TransferRequest(
        request_id=room, decoder=registration, dst_pages=(30, 31), metadata_slot=1,
        completion_slot=1,
    )  # fmt: skip


def test_an_abort_that_overtakes_its_ranks_transfer_request_is_acked() -> None:
    """A TP2 decoder: rank 1's TransferRequest is being resent when the request is
    aborted, and rank 1's Abort arrives first. It is acked (this rank never wrote to it,
    and refuses the copy when it comes), not refused - else rank 1's pages would wait
    for SGLang's deferred-release timeout."""
    rig = Rig()
    rig.prefill.track(40)
    rig.prefill.on_transfer_request(_tp2_request(rig, 0, 100, 40))
    for rank, instance in ((0, 100), (1, 101)):
        rig.prefill.on_abort(
            Abort(
                request_id=40, reason=AbortReason.CLIENT, decoder_instance=instance,
                reply_to=f"decode-{rank}",
            )
        )  # fmt: skip
    rig.prefill.on_transfer_request(_tp2_request(rig, 1, 101, 40))  # the late copy
    acked = {inbox for inbox, m in rig.sent if isinstance(m, AbortAck)}
    assert acked == {"decode-0", "decode-1"}
    assert _errors(rig, "decode-1", 40)  # the late copy is refused
    rig.prefill.writers.close()


def test_an_abort_of_a_stranger_instance_stops_nothing() -> None:
    """Once every decode rank of the request asked, an abort from any other instance is
    refused: only the owners can stop a request."""
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.request(d, 41, list(range(30, 34)), slot=1)
    rig.prefill.on_abort(
        Abort(request_id=41, reason=AbortReason.CLIENT, decoder_instance=999, reply_to="x")
    )
    assert rig.prefill.state(41)[0] is PrefillState.READY  # type: ignore[index]
    assert not [m for to, m in rig.sent if to == "x"]
    rig.prefill.writers.close()


def test_an_aborting_decoder_withdraws_its_transfer_request_first() -> None:
    """A resent copy of an aborted request's TransferRequest must never reach the prefill
    rank after its Abort: it could find the request forgotten there (acked, its pages
    freed) and have it written into them. The decoder withdraws it before the Abort."""
    rig = Rig()
    d = rig.add_decoder("decode-a")
    order: list[str] = []
    d.messenger._withdraw = lambda inbox, room: order.append(f"withdraw {inbox} {room}")
    send = d.messenger._send
    d.messenger._send = lambda inbox, m: (
        order.append(f"{type(m).__name__} {inbox}") or send(inbox, m)
    )
    rig.request(d, 42, list(range(30, 34)), slot=2)
    d.messenger.fail(42, "client went away", AbortReason.CLIENT)
    assert order == [
        "TransferRequest prefill-0",
        "withdraw prefill-0 42",
        "Abort prefill-0",
    ]
    rig.prefill.writers.close()


def test_a_copy_of_a_transfer_request_changes_nothing() -> None:
    """A duplicate that outlived the receiver's memory of it is a no-op: the destination
    (and its count of groups written) stays as it was."""
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.request(d, 43, list(range(30, 34)), slot=3)
    rig.prefill_all(43, list(range(10, 14)))
    wait_state(d, 43, DecodeState.COMPLETE)
    room = rig.prefill.rooms.rooms_of([43])[0]
    destination, groups = room.destinations[0], room.destinations[0].groups_done
    copy = next(m for _, m in rig.sent if isinstance(m, TransferRequest) and m.request_id == 43)
    rig.prefill.on_transfer_request(copy)
    assert room.destinations[0] is destination and destination.groups_done == groups
    assert not _errors(rig, "decode-a", 43)
    rig.prefill.writers.close()
