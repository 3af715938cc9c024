"""Who may act on a request: only the peers that own it. A member of the cluster that sends
messages about another's request (by mistake or on purpose) changes nothing, and what
strangers can make a rank remember is bounded."""

from __future__ import annotations

import pytest

from sgl_pd.backend.prefill import retention
from sgl_pd.core.errors import InvalidMessage
from sgl_pd.core.states import DecodeState, PrefillState
from sgl_pd.core.wire import (
    Abort,
    AbortAck,
    AbortReason,
    ChunkNotice,
    ErrorCode,
    ErrorMsg,
    TransferRequest,
)

from .pd_fakes import Rig, wait_state

PREFILL_INSTANCE = 1  # the rig's prefill rank


def _errors(rig: Rig, room: int) -> list[ErrorMsg]:
    return [m for _, m in rig.sent if isinstance(m, ErrorMsg) and m.request_id == room]


def _last_notice(room: int, chunks: int, sender: int) -> ChunkNotice:
    """`sender` says the request had `chunks` chunks in all."""
    return ChunkNotice(
        request_id=room,
        chunk_index=chunks - 1,
        token_start=0,
        token_stop=1,
        page_ids=(),
        is_last=True,
        prefill_instance=sender,
        num_chunks=chunks,
    )


def test_an_abort_from_a_decoder_that_did_not_ask_is_refused() -> None:
    rig = Rig()
    owner = rig.add_decoder("decode-a")
    other = rig.add_decoder("decode-b")
    rig.request(owner, 5, list(range(30, 40)), slot=1)
    forged = Abort(
        request_id=5,
        reason=AbortReason.CLIENT,
        decoder_instance=other.registration.instance,
        reply_to="decode-b",
    )
    rig.prefill.on_abort(forged)
    assert rig.prefill.state(5) == (PrefillState.READY, True, None)
    assert not [m for _, m in rig.sent if isinstance(m, AbortAck)]
    rig.prefill_all(5, list(range(10, 20)))
    wait_state(owner, 5, DecodeState.COMPLETE)  # the victim is served all the same
    rig.prefill.writers.close()


def test_the_owner_can_abort() -> None:
    rig = Rig()
    owner = rig.add_decoder("decode-a")
    rig.request(owner, 6, list(range(30, 40)), slot=1)
    rig.prefill.on_abort(
        Abort(
            request_id=6,
            reason=AbortReason.CLIENT,
            decoder_instance=owner.registration.instance,
            reply_to="decode-a",
        )
    )
    state, drained, _ = rig.prefill.state(6)  # type: ignore[misc]
    assert state is PrefillState.ABORTED and drained
    rig.prefill.writers.close()


def test_a_second_instance_cannot_take_over_a_decode_rank_of_a_request() -> None:
    rig = Rig()
    owner = rig.add_decoder("decode-a")
    other = rig.add_decoder("decode-b")  # same rank 0, another instance
    rig.request(owner, 7, list(range(30, 40)), slot=1)
    rig.request(other, 7, list(range(50, 60)), slot=2)
    (refusal,) = [m for inbox, m in rig.sent if isinstance(m, ErrorMsg) and inbox == "decode-b"]
    assert "another instance" in refusal.message
    rig.prefill_all(7, list(range(10, 20)))
    wait_state(owner, 7, DecodeState.COMPLETE)
    for s, t in zip(range(10, 20), range(30, 40), strict=True):
        assert owner.memory.page(t) == rig.prefill_memory.page(s)
    rig.prefill.writers.close()


def test_a_decoder_ignores_reports_from_prefill_ranks_it_did_not_ask() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    rig.request(d, 8, list(range(30, 40)), slot=1)
    stranger = PREFILL_INSTANCE + 1000
    d.messenger.on_error(
        ErrorMsg(request_id=8, code=ErrorCode.INTERNAL, message="x", sender_instance=stranger)
    )
    d.messenger.on_error(ErrorMsg(request_id=8, code=ErrorCode.INTERNAL, message="x"))
    d.messenger.on_chunk_notice(_last_notice(8, chunks=100, sender=stranger))
    d.messenger.on_abort_ack(AbortAck(request_id=8, prefill_rank=0, prefill_instance=stranger))
    assert d.messenger.poll(8) == (DecodeState.REQUESTED, None)
    rig.prefill_all(8, list(range(10, 20)))
    wait_state(d, 8, DecodeState.COMPLETE)
    # ... while the rank it asked is heard
    d2 = rig.add_decoder("decode-c")
    rig.request(d2, 9, list(range(30, 40)), slot=2)
    d2.messenger.on_error(
        ErrorMsg(
            request_id=9, code=ErrorCode.INTERNAL, message="x", sender_instance=PREFILL_INSTANCE
        )
    )
    assert d2.messenger.poll(9)[0] is DecodeState.FAILED
    rig.prefill.writers.close()


def test_an_early_notice_from_a_stranger_does_not_seal_a_later_request() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    d.messenger.on_chunk_notice(_last_notice(4, chunks=1, sender=PREFILL_INSTANCE + 5))
    rig.request(d, 4, list(range(30, 42)), slot=1)
    rig.prefill_all(4, list(range(10, 22)), chunk=4)  # three chunks, not one
    wait_state(d, 4, DecodeState.COMPLETE)
    for s, t in zip(range(10, 22), range(30, 42), strict=True):
        assert d.memory.page(t) == rig.prefill_memory.page(s)
    rig.prefill.writers.close()


def test_requests_nobody_prefills_are_bounded(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A decoder (or a flood of forged requests) cannot make a prefill rank hold more
    than MAX_UNOWNED_ROOMS requests that its SGLang never received."""
    monkeypatch.setattr(retention, "MAX_UNOWNED_ROOMS", 8)
    rig = Rig()
    d = rig.add_decoder("decode-a")
    for room in range(20):
        rig.request(d, 100 + room, [room], slot=room % 4)
    assert len(rig.prefill.rooms) == 8
    assert all("wait for their prefill" in m.message for m in _errors(rig, 119))
    # forged aborts of unknown requests leave no more records either
    for room in range(20):
        rig.prefill.on_abort(
            Abort(request_id=500 + room, reason=AbortReason.CLIENT, decoder_instance=99)
        )
    assert len(rig.prefill.rooms) == 8
    # requests SGLang knows are never refused
    rig.prefill.track(999)
    rig.request(d, 999, [1, 2], slot=3)
    assert rig.prefill.state(999)[0] is PrefillState.READY  # type: ignore[index]
    rig.prefill.writers.close()


def test_a_request_outside_the_decoders_pool_cannot_be_built() -> None:
    rig = Rig()
    d = rig.add_decoder("decode-a")
    with pytest.raises(InvalidMessage, match="outside"):
        TransferRequest(
            request_id=1,
            decoder=d.registration,
            dst_pages=(d.registration.num_pages,),
            metadata_slot=0,
            completion_slot=0,
        )
    rig.prefill.writers.close()
