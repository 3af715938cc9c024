"""Outboxes and heartbeats over real ZeroMQ: a send never waits for a dead peer; a peer
whose connections are refused is declared gone within a second; one that accepts
connections but does not answer is declared hung only after the hang timeout; a process
that was frozen past the hang timeout notices it."""

from __future__ import annotations

import contextlib
import queue
import socket
import threading
import time

from messenger_helpers import CODEC_HASH, HOST, free_port

from sgl_pd.backend.heartbeats import Heartbeats
from sgl_pd.core.clock import ManualClock, SystemClock
from sgl_pd.core.wire import Abort, AbortReason, FrameCodec, Heartbeat, HeartbeatAck, Message
from sgl_pd.messenger.inbox import Inbox
from sgl_pd.messenger.link import LinkPool
from sgl_pd.messenger.outbox import Outbox


def test_a_dead_peer_does_not_delay_messages_to_a_live_one() -> None:
    got: queue.Queue[Message] = queue.Queue()
    dead = f"tcp://{HOST}:{free_port()}"  # nothing listens there
    with (
        LinkPool(CODEC_HASH) as links,
        Inbox(HOST, FrameCodec(CODEC_HASH), got.put, "live") as live,
    ):
        outbox = Outbox(links, "test")
        for i in range(3):  # each would wait a whole send timeout (1 s) on its own
            assert outbox.send(
                dead, Abort(request_id=i, reason=AbortReason.ERROR, decoder_instance=1)
            )
        assert outbox.send(
            live.endpoint, Abort(request_id=99, reason=AbortReason.ERROR, decoder_instance=1)
        )
        message = got.get(timeout=10)
        assert isinstance(message, Abort) and message.request_id == 99
        assert outbox.dropped < 3  # the dead peer's messages were still waiting their turn
        outbox.close()


class _Watched:
    def __init__(self, peers: set[str], sessions: dict[str, str] | None = None) -> None:
        self.peers = peers
        self.sessions = sessions or {}
        self.lost: queue.Queue[tuple[str, bool]] = queue.Queue()
        self.why: list[str] = []
        self.freezes: queue.Queue[float] = queue.Queue()
        self.ticks = threading.Event()

    def active_peers(self) -> dict[str, str | None]:
        return {p: self.sessions.get(p) for p in self.peers}

    def peer_lost(self, inbox: str, why: str, gone: bool) -> None:
        self.peers.discard(inbox)
        self.why.append(why)
        self.lost.put((inbox, gone))

    def resumed_after_freeze(self, frozen_s: float) -> None:
        self.freezes.put(frozen_s)

    def housekeeping(self) -> None:
        self.ticks.set()


def test_a_peer_that_stops_answering_is_declared_lost() -> None:
    """Two ranks over real inboxes: B answers A's pings until B's inbox closes."""
    clock = SystemClock()
    with LinkPool(CODEC_HASH) as links:
        outbox = Outbox(links, "hb")
        a_box: list[Heartbeats] = []
        b_box: list[Heartbeats] = []

        def deliver(box: list[Heartbeats]):  # type: ignore[no-untyped-def]
            def on_message(message: Message) -> None:
                if isinstance(message, Heartbeat):
                    box[0].on_heartbeat(message)
                elif isinstance(message, HeartbeatAck):
                    box[0].on_ack(message)

            return on_message

        inbox_a = Inbox(HOST, FrameCodec(CODEC_HASH), deliver(a_box), "a")
        inbox_b = Inbox(HOST, FrameCodec(CODEC_HASH), deliver(b_box), "b")
        watched_by_a = _Watched({inbox_b.endpoint})
        a_box.append(
            Heartbeats(
                inbox_a.endpoint, outbox, watched_by_a, hang_timeout_s=30.0, clock=clock, name="a"
            )
        )
        b_box.append(  # B has requests with A too: it answers only peers it works with
            Heartbeats(
                inbox_b.endpoint,
                outbox,
                _Watched({inbox_a.endpoint}),
                hang_timeout_s=30.0,
                clock=clock,
                name="b",
            )
        )
        try:
            # B answers: after several timeouts' worth of ticks, nobody was declared lost
            for _ in range(3):
                assert watched_by_a.lost.empty()
                watched_by_a.ticks.clear()
                assert watched_by_a.ticks.wait(5)
            deadline = threading.Event()
            deadline.wait(2.5)
            assert watched_by_a.lost.empty(), "a live peer was declared lost"
            inbox_b.close()  # B's process is gone, as far as A can tell
            closed = time.monotonic()
            # nothing listens at B's port any more: proof that B can write nothing, long
            # before the hang timeout
            assert watched_by_a.lost.get(timeout=10) == (inbox_b.endpoint, True)
            assert time.monotonic() - closed < 5.0
            assert "refused" in watched_by_a.why[-1]
        finally:
            for hb in (*a_box, *b_box):
                hb.stop()
            inbox_a.close()
            inbox_b.close()
            outbox.close()


def test_a_listening_port_is_not_gone_and_a_closed_one_is() -> None:
    import socket

    from sgl_pd.messenger.probe import listener_gone

    with socket.socket() as listening:
        listening.bind((HOST, 0))
        listening.listen()
        endpoint = f"tcp://{HOST}:{listening.getsockname()[1]}"
        assert not listener_gone(endpoint)
    assert listener_gone(endpoint)


def test_pings_from_strangers_go_unanswered_and_odd_peers_do_not_stop_the_ticks() -> None:
    """Answering any ping would let a peer make this rank connect wherever it names; and a
    peer address that cannot be probed must not stop deadlines and sweeps."""
    got: queue.Queue[Message] = queue.Queue()
    with LinkPool(CODEC_HASH) as links, Inbox(HOST, FrameCodec(CODEC_HASH), got.put, "s") as me:
        outbox = Outbox(links, "hb")
        watched = _Watched({"tcp://[not-an-address"})  # never answers, cannot be probed
        beats = Heartbeats(
            "tcp://127.0.0.1:9", outbox, watched, hang_timeout_s=0.3, clock=SystemClock(), name="s"
        )
        try:
            beats.on_heartbeat(Heartbeat(sender=me.endpoint, seq=1, time_s=0.0))
            assert watched.lost.get(timeout=10)[0] == "tcp://[not-an-address"
            for _ in range(3):  # housekeeping goes on
                watched.ticks.clear()
                assert watched.ticks.wait(5)
            assert beats.unanswered == 1
            assert got.empty()  # no answer went to the stranger
        finally:
            beats.stop()
            outbox.close()


def _listening() -> socket.socket:
    """A port that accepts connections and never answers: a busy or stopped process."""
    sock = socket.socket()
    sock.bind((HOST, 0))
    sock.listen()
    return sock


def _endpoint(sock: socket.socket) -> str:
    return f"tcp://{HOST}:{sock.getsockname()[1]}"


def test_a_silent_peer_that_accepts_connections_is_hung_only_after_the_timeout() -> None:
    with LinkPool(CODEC_HASH) as links, _listening() as busy:
        outbox = Outbox(links, "hb")
        watched = _Watched({_endpoint(busy)})
        started = time.monotonic()
        beats = Heartbeats(
            "tcp://127.0.0.1:9", outbox, watched, hang_timeout_s=3.0, clock=SystemClock(),
            name="busy",
        )  # fmt: skip
        try:
            assert watched.lost.get(timeout=15) == (_endpoint(busy), False)
            assert time.monotonic() - started >= 3.0
            assert "hung" in watched.why[-1] and "--pd-hang-timeout" in watched.why[-1]
        finally:
            beats.stop()
            outbox.close()


def test_a_refused_inbox_with_a_live_transfer_listener_is_not_gone() -> None:
    """An inbox thread that died in a live process refuses connections too; its transfer
    engine may still be writing, so the peer is hung at the timeout, never gone."""
    with LinkPool(CODEC_HASH) as links, _listening() as engine:
        dead_inbox = f"tcp://{HOST}:{free_port()}"
        outbox = Outbox(links, "hb")
        session = f"{HOST}:{engine.getsockname()[1]}"
        watched = _Watched({dead_inbox}, {dead_inbox: session})
        beats = Heartbeats(
            "tcp://127.0.0.1:9", outbox, watched, hang_timeout_s=3.0, clock=SystemClock(),
            name="half",
        )  # fmt: skip
        try:
            assert watched.lost.get(timeout=15) == (dead_inbox, False)
        finally:
            beats.stop()
            outbox.close()
        engine.close()
        # both refuse now: gone
        watched = _Watched({dead_inbox}, {dead_inbox: session})
        beats = Heartbeats(
            "tcp://127.0.0.1:9", outbox, watched, hang_timeout_s=30.0, clock=SystemClock(),
            name="dead",
        )  # fmt: skip
        try:
            assert watched.lost.get(timeout=10) == (dead_inbox, True)
        finally:
            beats.stop()
            outbox.close()


def test_a_process_frozen_past_the_hang_timeout_notices_once_it_runs_again() -> None:
    clock = ManualClock()
    with LinkPool(CODEC_HASH) as links:
        outbox = Outbox(links, "hb")
        watched = _Watched(set())
        beats = Heartbeats(
            "tcp://127.0.0.1:9", outbox, watched, hang_timeout_s=5.0, clock=clock, name="f"
        )
        try:
            watched.ticks.clear()
            assert watched.ticks.wait(5)
            assert watched.freezes.empty()
            clock.advance(3.0)  # a pause well under the hang timeout is not a freeze
            watched.ticks.clear()
            assert watched.ticks.wait(5)
            assert watched.freezes.empty()
            clock.advance(7.0)  # as SIGSTOP for 7 s looks to the process once it runs
            assert watched.freezes.get(timeout=5) == 7.0
            deadline = time.monotonic() + 5
            while beats.freeze.frozen():  # writers hold off until the loop beat again
                assert time.monotonic() < deadline
                time.sleep(0.01)
            watched.ticks.clear()
            assert watched.ticks.wait(5)
            assert watched.freezes.empty()
        finally:
            beats.stop()
            outbox.close()


def test_a_slow_probe_of_an_unreachable_peer_is_not_a_freeze(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The liveness loop's own work (a probe of a partitioned host waits up to its
    budget) is not time this process did not run: with a short hang timeout, counting
    it would fail every live request of a process that never stopped."""
    from sgl_pd.backend import heartbeats

    def slow_probe(inbox: str, session: str | None) -> bool:
        time.sleep(2.0)  # a connection attempt to a host that does not answer
        return False

    class Silent(_Watched):
        def active_peers(self) -> dict[str, str | None]:
            return {"tcp://10.255.255.1:5555": None}

    monkeypatch.setattr(heartbeats, "peer_gone", slow_probe)
    with LinkPool(CODEC_HASH) as links:
        outbox = Outbox(links, "hb")
        watched = Silent(set())
        beats = Heartbeats(
            "tcp://127.0.0.1:9", outbox, watched, hang_timeout_s=2.5, clock=SystemClock(),
            name="p",
        )  # fmt: skip
        try:
            with contextlib.suppress(queue.Empty):
                frozen_s = watched.freezes.get(timeout=3.0)
                raise AssertionError(f"a process that never stopped 'froze' for {frozen_s} s")
        finally:
            beats.stop()
            outbox.close()
