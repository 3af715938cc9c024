"""Inboxes and links over real ZMQ on 127.0.0.1."""

from __future__ import annotations

import queue
import threading
import time

import pytest
import zmq
from messenger_helpers import CODEC_HASH, HOST, free_port

from sgl_pd.core.wire import Abort, AbortReason, FrameCodec, Heartbeat, Message
from sgl_pd.messenger import (
    BindError,
    Inbox,
    Link,
    LinkPool,
    MessengerClosed,
    PeerUnreachable,
    RegistryServer,
)


def _drain(q: queue.Queue[Message], n: int, timeout_s: float = 5.0) -> list[Message]:
    end = time.monotonic() + timeout_s
    out = []
    while len(out) < n:
        out.append(q.get(timeout=max(0.0, end - time.monotonic())))
    return out


def test_inbox_gets_every_message_of_several_links() -> None:
    got: queue.Queue[Message] = queue.Queue()
    with Inbox(HOST, FrameCodec(CODEC_HASH), got.put, "d0") as inbox:
        assert inbox.endpoint.startswith(f"tcp://{HOST}:")
        ctx = zmq.Context()
        links = [Link(inbox.endpoint, FrameCodec(CODEC_HASH), context=ctx) for _ in range(3)]
        try:

            def blast(i: int) -> None:
                for seq in range(20):
                    links[i].send(Heartbeat(sender=f"tcp://p{i}:1", seq=seq, time_s=0.0))

            senders = [threading.Thread(target=blast, args=(i,)) for i in range(3)]
            for t in senders:
                t.start()
            for t in senders:
                t.join(10)
            msgs = _drain(got, 60)
        finally:
            for link in links:
                link.close()
            ctx.term()
    assert {(m.sender, m.seq) for m in msgs if isinstance(m, Heartbeat)} == {
        (f"tcp://p{i}:1", s) for i in range(3) for s in range(20)
    }
    assert inbox.bad_frames == 0


def test_inbox_drops_and_counts_bad_frames_and_survives_handler_errors() -> None:
    got: queue.Queue[Message] = queue.Queue()

    def handle(msg: Message) -> None:
        if isinstance(msg, Abort):
            raise RuntimeError("handler bug")
        got.put(msg)

    ok = Heartbeat(sender="tcp://p0:1", seq=7, time_s=1.5)
    with Inbox(HOST, FrameCodec(CODEC_HASH), handle, "d0") as inbox:
        ctx = zmq.Context()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        try:
            raw.connect(inbox.endpoint)
            raw.send(b"not a frame")
            raw.send(FrameCodec(CODEC_HASH ^ 1).encode(ok))  # another model
            raw.send_multipart([FrameCodec(CODEC_HASH).encode(ok)] * 2)  # two frames
            raw.send(
                FrameCodec(CODEC_HASH).encode(
                    Abort(request_id=1, reason=AbortReason.CLIENT, decoder_instance=1)
                )
            )
            raw.send(FrameCodec(CODEC_HASH).encode(ok))
            assert _drain(got, 1) == [ok]
        finally:
            raw.close(linger=0)
            ctx.term()
        assert inbox.bad_frames == 3
        assert inbox.handler_errors == 1


def test_link_to_nothing_fails_fast_and_closed_link_refuses() -> None:
    link = Link(f"tcp://{HOST}:{free_port()}", FrameCodec(CODEC_HASH), send_timeout_s=0.2)
    try:
        start = time.monotonic()
        with pytest.raises(PeerUnreachable, match="unreachable"):
            link.send(Heartbeat(sender="tcp://d0:1", seq=0, time_s=0.0))
        assert time.monotonic() - start < 0.2 + 2.0
    finally:
        link.close()
    with pytest.raises(MessengerClosed):
        link.send(Heartbeat(sender="tcp://d0:1", seq=1, time_s=0.0))


def test_pool_notices_a_dead_peer_and_reaches_its_successor() -> None:
    got: queue.Queue[Message] = queue.Queue()
    hb = Heartbeat(sender="tcp://d0:1", seq=0, time_s=0.0)
    with LinkPool(CODEC_HASH, send_timeout_s=0.2) as pool:
        first = Inbox(HOST, FrameCodec(CODEC_HASH), got.put, "p0")
        try:
            pool.send(first.endpoint, hb)
            assert _drain(got, 1) == [hb]
        finally:
            first.close()
        # IMMEDIATE: once ZMQ sees the connection gone, sends fail instead of queueing.
        with pytest.raises(PeerUnreachable):
            for _ in range(50):
                pool.send(first.endpoint, hb)
                time.sleep(0.05)
        pool.drop(first.endpoint)
        assert pool.endpoints() == []
        with Inbox(HOST, FrameCodec(CODEC_HASH), got.put, "p0") as second:
            pool.send(second.endpoint, hb)
            assert _drain(got, 1) == [hb]
    with pytest.raises(MessengerClosed):
        pool.get(second.endpoint)


def test_inbox_bind_errors_are_typed_and_close_frees_the_port() -> None:
    with pytest.raises(BindError):
        Inbox("203.0.113.7", FrameCodec(CODEC_HASH), lambda m: None, "x")
    inbox = Inbox(HOST, FrameCodec(CODEC_HASH), lambda m: None, "x")
    inbox.close()
    port = int(inbox.endpoint.rsplit(":", 1)[1])
    with RegistryServer(HOST, port):  # binds the very port again
        pass
