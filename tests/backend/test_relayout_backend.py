"""A decode rank's receive staging: granted per request while it lasts (later requests
wait unsent, then go with their grant), never for a request larger than the area (sent
to be written one token slot at a time), and given back only when nothing can land."""

from __future__ import annotations

import numpy as np

from sgl_pd.backend.decode.messenger import DecodeMessenger
from sgl_pd.backend.metrics import TransferMetrics
from sgl_pd.backend.relayout_copies import PoolCopies
from sgl_pd.backend.staging_area import Staging, StagingArea
from sgl_pd.core.clock import ManualClock
from sgl_pd.core.regions import Region
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.wire import (
    AbortAck,
    Message,
    MetadataBuffers,
    Role,
    ShardRegistration,
    TransferRequest,
)
from sgl_pd.transfer.fake import FakeFabric, FakeTransferEngine

from .pd_fakes import AUX_ITEM, AUX_ROWS, LAYOUT, NUM_PAGES, Memory

# receive staging of a 4-page request from two TP2 ranks (one head each) into this TP1
# rank (both heads): 2 links x 8 regions x 4 pages x 8 bytes = 512 bytes
AREA_BYTES = 1024


class Decoder:
    def __init__(self, prefill_tp: int = 2) -> None:
        fabric = FakeFabric()
        self.engine = FakeTransferEngine(fabric)
        memory = Memory.make(self.engine, fill=None)
        pool = memory.pool()
        self.area = StagingArea(AREA_BYTES, "cpu", self.engine)
        self.sent: list[tuple[str, Message]] = []
        self.clock = ManualClock()
        self.messenger = DecodeMessenger(
            rank=0,
            instance=7,
            scheme=ShardingScheme(1),
            pool=pool,
            engine=self.engine,
            send_to_prefill=lambda inbox, m: self.sent.append((inbox, m)) or True,
            transfer_timeout_s=30.0,
            metrics=TransferMetrics(False, "decode"),
            clock=self.clock,
            staging=Staging(self.area, PoolCopies(pool, "cpu")),
        )
        metadata = MetadataBuffers(regions=pool.aux, row_bytes=(AUX_ITEM,), rows=AUX_ROWS)
        self.registration = ShardRegistration(
            role=Role.DECODE, rank=0, scheme=ShardingScheme(1), session=self.engine.session_id,
            inbox="decode-0", instance=7, layout=LAYOUT, num_pages=NUM_PAGES,
            kv_regions=pool.kv.regions, layer_group_size=1, metadata=metadata,
            completion=self.messenger.completion_area,
            staging=Region(self.area.base, self.area.capacity),
        )  # fmt: skip
        self.prefills = [
            ShardRegistration(
                role=Role.PREFILL,
                rank=r,
                scheme=ShardingScheme(prefill_tp),
                session=f"127.0.0.1:{9000 + r}",
                inbox=f"prefill-{r}",
                instance=100 + r,
                layout=LAYOUT,
                num_pages=NUM_PAGES,
                kv_regions=pool.kv.regions,
                layer_group_size=LAYOUT.num_layers,
            )
            for r in range(prefill_tp)
        ]

    def request(self, room: int, pages: int, slot: int, dst: np.ndarray | None = None) -> None:
        dst = np.arange(slot * 10, slot * 10 + pages) if dst is None else dst
        self.messenger.request(room, self.prefills, self.registration, dst, slot)

    def requests_sent(self, room: int) -> list[TransferRequest]:
        return [m for _, m in self.sent if isinstance(m, TransferRequest) and m.request_id == room]


def test_requests_wait_for_receive_staging_and_go_with_their_grant() -> None:
    d = Decoder()
    d.request(1, pages=4, slot=1)
    d.request(2, pages=4, slot=2)
    d.request(3, pages=4, slot=3)  # the area holds two such requests
    grants = {room: {m.staging_base for m in d.requests_sent(room)} for room in (1, 2, 3)}
    assert len(d.requests_sent(1)) == len(d.requests_sent(2)) == 2  # one per prefill rank
    assert d.requests_sent(3) == [] and d.area.used == AREA_BYTES
    assert grants[1] != grants[2] and None not in grants[1] | grants[2]
    d.messenger.poll(3)
    assert d.requests_sent(3) == []  # still full: back-pressure, not a failure

    # request 1 ends early: its staging stays held until both prefill ranks drained
    d.messenger.fail(1, "aborted by the client")
    assert not d.messenger.is_release_safe(1, 2)
    d.messenger.poll(3)
    assert d.requests_sent(3) == []
    for rank in range(2):
        d.messenger.on_abort_ack(
            AbortAck(request_id=1, prefill_rank=rank, prefill_instance=100 + rank)
        )
    assert d.messenger.is_release_safe(1, 2)
    d.messenger.forget(1)
    d.messenger.poll(3)
    (granted,) = {m.staging_base for m in d.requests_sent(3)}
    assert granted in grants[1]  # the space request 1 gave back


def test_pages_and_staging_wait_for_every_prefill_rank_asked() -> None:
    """One release rule (`decode.release`): a request asked of two prefill ranks, of
    which one acked its Abort, keeps its pages and its receive staging whatever count
    SGLang's deferred release passes (`required_acks`: 0 on a rank that holds only for
    a peer rank, 1 from an older or differently counting caller) - the other rank may
    still be writing into both."""
    d = Decoder()
    d.request(1, pages=4, slot=1)
    d.messenger.fail(1, "aborted by the client")
    d.messenger.on_abort_ack(AbortAck(request_id=1, prefill_rank=0, prefill_instance=100))
    for required_acks in (0, 1, 2):
        assert not d.messenger.is_release_safe(1, required_acks)
    assert d.area.used == 512  # its staging is held too, not orphaned
    d.messenger.on_abort_ack(AbortAck(request_id=1, prefill_rank=1, prefill_instance=101))
    assert d.messenger.is_release_safe(1, 0)
    assert d.area.used == 0  # both go back at the same moment


def test_a_provably_gone_prefill_rank_counts_as_drained() -> None:
    d = Decoder()
    d.request(1, pages=4, slot=1)
    d.messenger.peer_lost("prefill-1", "prefill-1 refuses connections", gone=True)
    d.messenger.fail(1, "peer lost")
    assert not d.messenger.is_release_safe(1, 2)  # prefill-0 may still write
    d.messenger.on_abort_ack(AbortAck(request_id=1, prefill_rank=0, prefill_instance=100))
    assert d.messenger.is_release_safe(1, 2) and d.area.used == 0


def test_staging_is_granted_in_arrival_order() -> None:
    """A request that needs more than is free waits, and a later, smaller one waits
    behind it rather than take the space first-fit (which could starve the large one)."""
    d = Decoder()
    d.request(1, pages=4, slot=1)  # 512 of the 1,024 bytes
    d.request(2, pages=8, slot=2)  # 1,024: waits
    d.request(3, pages=4, slot=3)  # 512 would fit, but request 2 came first
    assert d.requests_sent(2) == d.requests_sent(3) == []
    d.messenger.poll(3)
    assert d.requests_sent(3) == []
    d.messenger.fail(1, "aborted by the client")
    for rank in range(2):
        d.messenger.on_abort_ack(
            AbortAck(request_id=1, prefill_rank=rank, prefill_instance=100 + rank)
        )
    d.messenger.forget(1)
    d.messenger.poll(3)
    assert d.requests_sent(3) == []
    d.messenger.poll(2)
    assert len(d.requests_sent(2)) == 2


def test_decode_ranks_grant_a_prefix_of_the_same_order_and_cannot_deadlock() -> None:
    """Two decode ranks of one server see requests A (1,024 bytes) then B (512) while
    rank 0 still holds 512 bytes of an earlier request's staging. First-fit had rank 0
    grant B and rank 1 grant A: each request then waits for the other rank, and each
    rank's space for the other request - until both time out."""
    rank0, rank1 = Decoder(), Decoder()
    held = rank0.area.try_take(512)  # an earlier request, still transferring on rank 0
    for rank in (rank0, rank1):
        rank.request(10, pages=8, slot=1)  # A
        rank.request(11, pages=4, slot=2)  # B
        rank.messenger.poll(11)
    assert rank1.requests_sent(10) and not rank1.requests_sent(11)
    assert not rank0.requests_sent(10) and not rank0.requests_sent(11)  # B waits behind A
    assert held is not None
    rank0.area.give_back(held)  # the earlier request completes on rank 0
    rank0.messenger.poll(10)
    assert rank0.requests_sent(10)  # A goes on both ranks


def test_waiting_for_staging_is_not_a_stall() -> None:
    """A request queued for staging fails only when no staging came free for the
    transfer timeout; once sent, its deadline counts from the send."""
    d = Decoder()
    d.request(1, pages=8, slot=1)  # the whole area
    d.request(2, pages=8, slot=2)  # waits
    d.clock.advance(20.0)
    d.messenger.fail(1, "aborted by the client")
    for rank in range(2):
        d.messenger.on_abort_ack(
            AbortAck(request_id=1, prefill_rank=rank, prefill_instance=100 + rank)
        )
    d.messenger.forget(1)  # staging came free after 20 s of waiting
    d.clock.advance(20.0)  # 40 s since request 2 arrived, 20 s since staging moved
    d.messenger.housekeeping()
    assert d.messenger.poll(2)[1] is None
    assert len(d.requests_sent(2)) == 2  # granted and sent now
    d.clock.advance(25.0)  # 25 s since it was sent: within the 30 s
    d.messenger.housekeeping()
    assert d.messenger.poll(2)[1] is None
    d.clock.advance(10.0)
    d.messenger.housekeeping()
    assert "no progress" in (d.messenger.poll(2)[1] or "")


def test_a_request_larger_than_the_area_is_sent_without_a_grant() -> None:
    d = Decoder()
    d.request(4, pages=12, slot=1)  # 1,536 bytes of blocks
    assert {m.staging_base for m in d.requests_sent(4)} == {None}
    assert d.area.used == 0


def test_a_request_never_sent_is_safe_to_release_at_once() -> None:
    d = Decoder()
    d.request(1, pages=4, slot=1)
    d.request(2, pages=4, slot=2)
    d.request(3, pages=4, slot=3)
    d.messenger.fail(3, "aborted by the client")  # no prefill rank knows where to write
    assert d.messenger.is_release_safe(3, 2)
    d.messenger.forget(3)
    d.messenger.forget(1)  # never completed, never drained: held back, not reused yet
    assert d.area.used == AREA_BYTES


SCATTERED = np.array([3, 9, 1, 14, 6, 11, 20, 17], dtype=np.int64)  # fragmented pages


def test_fragmented_pages_ask_for_every_link_into_staging() -> None:
    """Identical TP: nothing is strided, yet a request whose pages are scattered asks
    for receive staging of every link (one write per chunk and region, not per page);
    one with a run of pages does not."""
    d = Decoder(prefill_tp=1)
    d.request(1, pages=8, slot=1, dst=SCATTERED)
    (whole,) = d.requests_sent(1)
    assert whole.stage_all and whole.staging_base is not None
    assert d.area.used == 2 * 8 * 8 * 8  # one link: 2 heads x 8 bytes, 8 regions, 8 pages
    d.request(2, pages=8, slot=2)
    (run,) = d.requests_sent(2)
    assert not run.stage_all and run.staging_base is None


def test_a_fragmented_request_goes_unstaged_rather_than_wait_for_space() -> None:
    """Staging is an optimisation for fragmented pages: with the area taken, the
    request is sent as it lies at once, not held back."""
    d = Decoder(prefill_tp=1)
    d.request(1, pages=8, slot=1, dst=SCATTERED)
    d.request(2, pages=8, slot=2, dst=SCATTERED + 30)  # the area holds one of them
    (first,), (second,) = d.requests_sent(1), d.requests_sent(2)
    assert first.stage_all and first.staging_base is not None
    assert not second.stage_all and second.staging_base is None


def test_a_fragmented_request_does_not_take_space_a_strided_one_waits_for() -> None:
    """Staging is required for a request whose heads are strided here (TP2 prefill
    into this TP1 rank: 128 bytes a page) and only an optimisation for a fragmented one
    (a TP1 prefill, 128 bytes a page too): while a required request waits for space, a
    fragmented one goes unstaged rather than take it."""
    d = Decoder(prefill_tp=2)
    identical = Decoder(prefill_tp=1).prefills  # a TP1 prefill server beside the TP2 one
    d.request(1, pages=4, slot=1)  # 512 bytes
    d.request(2, pages=3, slot=2)  # 384 bytes: 128 free
    d.request(3, pages=6, slot=3)  # 768 bytes: waits
    assert d.requests_sent(3) == []
    d.messenger.fail(1, "aborted by the client")
    for rank in range(2):
        d.messenger.on_abort_ack(
            AbortAck(request_id=1, prefill_rank=rank, prefill_instance=100 + rank)
        )
    d.messenger.forget(1)  # 640 bytes free: not yet enough for request 3
    five_runs = np.array([40, 42, 44, 46, 48], dtype=np.int64)  # 640 bytes staged whole
    d.messenger.request(4, identical, d.registration, five_runs, 4)
    (fragmented,) = d.requests_sent(4)
    assert not fragmented.stage_all and fragmented.staging_base is None
    d.messenger.fail(2, "aborted by the client")
    for rank in range(2):
        d.messenger.on_abort_ack(
            AbortAck(request_id=2, prefill_rank=rank, prefill_instance=100 + rank)
        )
    d.messenger.forget(2)
    d.messenger.poll(3)
    assert None not in {m.staging_base for m in d.requests_sent(3)}


def test_staging_areas_by_what_a_rank_can_stage() -> None:
    """Strided slices need gather areas on prefill ranks and receive areas on decode
    ranks; fragmented pages a gather area on a prefill rank (four jobs of one layer of a
    chunk) and a (smaller) receive area on a decode rank where no slice is ever strided
    (an MLA or one-head rank)."""
    from sgl_pd.backend.pool import PoolDescription
    from sgl_pd.backend.staging_area import (
        DECODE_STAGING_TOKENS,
        FRAGMENTED_STAGING_TOKENS,
        staging_bytes,
    )
    from sgl_pd.core.layout import KvLayout, PageLayout

    def pool(layout: KvLayout, heads: int) -> PoolDescription:
        return PoolDescription(layout, heads, None, 0, 1, (), (), 1)  # type: ignore[arg-type]

    mla = KvLayout.mla(
        num_layers=61, kv_lora_rank=512, rope_dim=64, page_size=64, elem_bytes=2,
        page_layout=PageLayout.NHD,
    )  # fmt: skip
    gqa = KvLayout.gqa(
        num_layers=62, num_kv_heads=8, head_dim=128, page_size=64, elem_bytes=2,
        page_layout=PageLayout.NHD,
    )  # fmt: skip
    assert staging_bytes(-1, Role.PREFILL, pool(mla, 1), 16384) == 4 * 16384 * 1152  # 75 MB
    assert staging_bytes(-1, Role.DECODE, pool(mla, 1), 16384) == (
        FRAGMENTED_STAGING_TOKENS * 61 * 1152
    )  # 288 MB
    assert staging_bytes(-1, Role.PREFILL, pool(gqa, 1), 16384) == 4 * 16384 * 2 * 256
    assert staging_bytes(-1, Role.DECODE, pool(gqa, 2), 16384) == (
        DECODE_STAGING_TOKENS * 62 * 2 * 2 * 256
    )
    assert staging_bytes(0, Role.DECODE, pool(gqa, 2), 16384) == 0  # --pd-staging-mb 0


def test_no_transfer_request_goes_out_after_the_abort() -> None:
    """A request granted by the scheduler thread is sent once that thread let go of the
    messenger's lock; an abort from another thread (the liveness thread after a freeze,
    say) landing in between must not be followed by the request - the prefill rank would
    ack the Abort, then write into pages the ack let this rank free. The abort either
    comes first (and nothing is sent) or after the request."""
    import threading

    d = Decoder()
    d.request(1, pages=4, slot=1)  # 512 bytes: granted
    d.request(2, pages=8, slot=2)  # waits for staging
    send_request = d.messenger._send_request
    granted, go_on = threading.Event(), threading.Event()

    def paused(track, message):  # type: ignore[no-untyped-def]
        granted.set()  # request 2 was granted under the lock, not yet sent
        assert go_on.wait(10)
        send_request(track, message)

    d.messenger._send_request = paused  # type: ignore[method-assign]
    d.messenger.fail(1, "aborted by the client")
    for rank in range(2):
        d.messenger.on_abort_ack(
            AbortAck(request_id=1, prefill_rank=rank, prefill_instance=100 + rank)
        )
    d.messenger.forget(1)
    poller = threading.Thread(target=d.messenger.poll, args=(2,))
    poller.start()
    assert granted.wait(10)
    aborter = threading.Thread(
        target=d.messenger.resumed_after_freeze,
        args=(25.0,),  # the liveness thread's abort
    )
    aborter.start()
    aborter.join(0.5)
    go_on.set()
    poller.join(10)
    aborter.join(10)
    about_2 = [type(m).__name__ for _, m in d.sent if getattr(m, "request_id", None) == 2]
    assert about_2 in (["TransferRequest", "TransferRequest", "Abort", "Abort"], []), about_2


def test_a_refused_duplicates_release_leaves_the_live_requests_staging() -> None:
    """SGLang asks "may the pages go?" by room only. A receiver refused its room (an
    earlier request still holds it) asks with `required_acks=0` for pages no prefill rank
    ever heard of; if the earlier request completed meanwhile (its last notice read on the
    inbox thread) but was not handed off yet, that answer must not give its staging back:
    its staged blocks still have to be scattered into its pages."""
    import pytest

    from sgl_pd.core.errors import DuplicateRequest
    from sgl_pd.core.states import DecodeState

    d = Decoder()
    d.request(1, pages=4, slot=1)
    assert d.area.used == 512
    with pytest.raises(DuplicateRequest):
        d.request(1, pages=4, slot=2)
    m = d.messenger
    assert not m.is_release_safe(1, 0)  # the earlier request is still in flight
    with m._lock:  # its writes all landed: complete, not handed off yet
        m._tracks[1].done_s = d.clock.monotonic()
        m._states.transition(1, DecodeState.TRANSFERRING)
        m._states.transition(1, DecodeState.COMPLETE)
    assert m.is_release_safe(1, 0)  # (nothing can land in the refused one's pages)
    assert d.area.used == 512
    scattered: list[int] = []
    m._grants.scatter = lambda track, offset: scattered.append(offset)  # type: ignore[method-assign]
    assert m.hand_off(1) and scattered and d.area.used == 0


def test_an_abort_decided_while_a_request_is_being_sent_follows_every_copy() -> None:
    """A failure decided on the sending thread itself, while the TransferRequest goes out
    to one prefill rank after another (an in-process peer's answer, say), queues the Abort
    after the last copy, to every rank."""
    d = Decoder()
    m = d.messenger
    send = m._send
    answered: list[int] = []

    def send_then_fail(inbox, message):  # type: ignore[no-untyped-def]
        sent = send(inbox, message)
        if isinstance(message, TransferRequest) and not answered:
            answered.append(message.request_id)
            m.fail(message.request_id, "the peer answered with a failure")
        return sent

    m._send = send_then_fail  # type: ignore[method-assign]
    d.request(1, pages=4, slot=1)
    kinds = [(inbox, type(message).__name__) for inbox, message in d.sent]
    for inbox in ("prefill-0", "prefill-1"):
        assert kinds.index((inbox, "TransferRequest")) < kinds.index((inbox, "Abort")), kinds
