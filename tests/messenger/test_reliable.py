"""Control messages whose loss matters are sent until acknowledged and handed on once: a
peer unreachable for a while (paused past ZMQ's own heartbeat, under the hang timeout)
still gets each of them, duplicates never reach a handler twice, and nothing is resent
to a peer declared lost or past the give-up bound."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from sgl_pd.core.bounds import TimingBounds
from sgl_pd.core.clock import ManualClock
from sgl_pd.core.wire import (
    Abort,
    AbortAck,
    AbortReason,
    ChunkNotice,
    Delivered,
    Guarded,
    Message,
    Sequenced,
)
from sgl_pd.messenger.reliable import ControlFaults, ReliableReceiver, ReliableSender

BOUNDS = TimingBounds(hang_timeout_s=20.0, transfer_timeout_s=120.0)
PREFILL, DECODE = "tcp://prefill:1", "tcp://decode:2"


@dataclass
class Network:
    """Outboxes of two ranks over a network that drops what goes to a paused rank."""

    paused: set[str] = field(default_factory=set)
    handled: dict[str, list[Guarded]] = field(default_factory=dict)
    clock: ManualClock = field(default_factory=ManualClock)

    def __post_init__(self) -> None:
        self.senders: dict[str, ReliableSender] = {}
        self.receivers: dict[str, ReliableReceiver] = {}
        for me, instance in ((PREFILL, 11), (DECODE, 22)):
            outbox = _Outbox(self, me)
            self.senders[me] = ReliableSender(
                outbox,
                me,
                instance,
                BOUNDS,
                self.clock,
                start_thread=False,  # type: ignore[arg-type]
            )
            self.receivers[me] = ReliableReceiver(outbox, me, BOUNDS, self.clock)  # type: ignore[arg-type]
            self.handled[me] = []

    def deliver(self, to: str, message: Message) -> None:
        if to not in self.receivers:
            return  # (an answer to a rank outside this network)
        if to in self.paused:
            return  # ZMQ dropped it: no connection, or the connection broke
        if isinstance(message, Sequenced):
            guarded = self.receivers[to].accept(message)
            if guarded is not None:
                self.handled[to].append(guarded)
        elif isinstance(message, Delivered):
            self.senders[to].on_delivered(message)

    def run(self, seconds: float, step_s: float = 0.05) -> None:
        for _ in range(int(seconds / step_s)):
            self.clock.advance(step_s)
            for sender in self.senders.values():
                sender.resend_due()


@dataclass
class _Outbox:
    network: Network
    me: str

    def send(self, endpoint: str, message: Message) -> bool:
        self.network.deliver(endpoint, message)
        return True


def _last_notice(room: int) -> ChunkNotice:
    return ChunkNotice(
        request_id=room, chunk_index=3, token_start=0, token_stop=64, page_ids=(1, 2),
        is_last=True, prefill_instance=11, num_chunks=4,
    )  # fmt: skip


def test_a_notice_sent_while_the_decoder_is_paused_arrives_when_it_resumes() -> None:
    """A decoder stopped 12 s (past ZMQ's 10 s heartbeat, under the 20 s hang timeout)
    still gets the notice that seals its request's count, once."""
    net = Network()
    net.paused.add(DECODE)
    net.senders[PREFILL].send(DECODE, _last_notice(5))
    net.run(12.0)
    assert net.handled[DECODE] == []
    net.paused.clear()
    net.run(BOUNDS.resend_max_interval_s + 0.1)
    assert net.handled[DECODE] == [_last_notice(5)]
    assert net.senders[PREFILL].pending == 0  # acknowledged: no more resends
    net.run(10.0)
    assert net.handled[DECODE] == [_last_notice(5)]


def test_a_lost_acknowledgement_brings_a_copy_that_is_not_handled_twice() -> None:
    net = Network()
    abort = Abort(request_id=9, reason=AbortReason.CLIENT, decoder_instance=22, reply_to=DECODE)
    net.paused.add(DECODE)  # the Delivered going back is lost, the Abort got through
    net.senders[DECODE].send(PREFILL, abort)
    net.run(3.0)
    net.paused.clear()
    net.run(3.0)
    receiver = net.receivers[PREFILL]
    assert net.handled[PREFILL] == [abort]
    assert receiver.duplicates >= 1
    assert net.senders[DECODE].pending == 0


def test_resends_back_off_and_stop_at_the_give_up_bound() -> None:
    net = Network()
    net.paused.add(PREFILL)
    sender = net.senders[DECODE]
    sender.send(PREFILL, AbortAck(request_id=1, prefill_rank=0, prefill_instance=1))
    net.run(10.0)
    # first after resend_interval_s, doubling to resend_max_interval_s: a handful in 10 s
    assert 4 <= sender.resent <= 10.0 / BOUNDS.resend_max_interval_s + 4
    net.run(BOUNDS.give_up_s)
    assert sender.pending == 0 and sender.given_up == 1
    resent = sender.resent
    net.run(5.0)
    assert sender.resent == resent


def test_nothing_is_resent_to_a_peer_declared_lost() -> None:
    net = Network()
    net.paused.add(PREFILL)
    sender = net.senders[DECODE]
    sender.send(PREFILL, AbortAck(request_id=1, prefill_rank=0, prefill_instance=1))
    assert sender.forget_peer(PREFILL) == 1
    net.run(5.0)
    assert sender.resent == 0


def test_only_the_addressee_acknowledges_a_message() -> None:
    """Another rank naming our sequence number does not stop the resends."""
    net = Network()
    net.paused.add(PREFILL)
    sender = net.senders[DECODE]
    sender.send(PREFILL, AbortAck(request_id=1, prefill_rank=0, prefill_instance=1))
    sender.on_delivered(Delivered(receiver="tcp://stranger:3", instance=22, seqs=(1,)))
    sender.on_delivered(Delivered(receiver=PREFILL, instance=21, seqs=(1,)))  # old process
    assert sender.pending == 1
    sender.on_delivered(Delivered(receiver=PREFILL, instance=22, seqs=(1,)))
    assert sender.pending == 0


def test_dropped_frames_delay_messages_but_lose_none() -> None:
    """A third of all envelopes and acknowledgements dropped: every message is handled
    exactly once, and nothing is left pending."""
    net = Network()
    for me in (PREFILL, DECODE):
        net.senders[me].faults = ControlFaults(0.3, seed=1)
        net.receivers[me].faults = ControlFaults(0.3, seed=2)
    sent = [AbortAck(request_id=i, prefill_rank=0, prefill_instance=1) for i in range(200)]
    for message in sent:
        net.senders[PREFILL].send(DECODE, message)
    net.run(60.0)
    handled = sorted(net.handled[DECODE], key=lambda m: m.request_id or 0)
    assert handled == sent  # each once (a resent message may overtake others)
    assert net.senders[PREFILL].pending == 0
    assert net.senders[PREFILL].faults.dropped > 30


def test_the_receiver_remembers_longer_than_any_sender_resends() -> None:
    net = Network()
    assert net.receivers[DECODE].window_s > BOUNDS.give_up_s


def test_a_drop_rate_of_one_or_more_is_refused() -> None:
    with pytest.raises(ValueError, match="drop rate"):
        ControlFaults(1.0)


def test_a_withdrawn_message_never_follows_what_was_sent_after_it() -> None:
    """A TransferRequest lost on its way is being resent when its request is aborted:
    withdrawn, no copy of it reaches the prefill rank after the Abort does."""
    from sgl_pd.core.wire import TransferRequest

    net = Network()
    net.paused.add(PREFILL)
    sender = net.senders[DECODE]
    request = AbortAck(request_id=7, prefill_rank=0, prefill_instance=1)  # (stands for it)
    sender.send(PREFILL, request)
    net.run(1.0)
    assert sender.withdraw(PREFILL, lambda m: m.request_id == 7) == 1
    abort = Abort(request_id=7, reason=AbortReason.CLIENT, decoder_instance=22)
    sender.send(PREFILL, abort)
    net.paused.clear()
    net.run(5.0)
    assert net.handled[PREFILL] == [abort]
    assert sender.withdraw(PREFILL, lambda m: isinstance(m, TransferRequest)) == 0


def test_ranks_that_number_alike_are_told_apart() -> None:
    """Two ranks of one server whose instance ids and sequence numbers coincide (SGLang
    seeds `random` alike in every rank): each one's message is handed on."""
    net = Network()
    outbox = _Outbox(net, "tcp://decode-rank1:3")
    twin = ReliableSender(outbox, "tcp://decode-rank1:3", 22, BOUNDS, net.clock, start_thread=False)  # type: ignore[arg-type]
    first = AbortAck(request_id=1, prefill_rank=0, prefill_instance=1)
    second = AbortAck(request_id=2, prefill_rank=0, prefill_instance=1)
    net.senders[DECODE].send(PREFILL, first)
    twin.send(PREFILL, second)
    assert net.handled[PREFILL] == [first, second]


def test_deliveries_are_forgotten_once_traffic_stopped_a_window_ago() -> None:
    """What a soak checks: the receiver's memory of deliveries returns to empty at idle,
    without another message arriving to prune it."""
    net = Network()
    for room in range(5):
        net.senders[PREFILL].send(DECODE, _last_notice(room))
    receiver = net.receivers[DECODE]
    assert receiver.remembered() == 5
    net.clock.advance(receiver.window_s + 1.0)
    assert receiver.remembered() == 0
