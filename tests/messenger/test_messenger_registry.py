"""Registry and its client over real ZMQ on 127.0.0.1: registration from threads and from
another process, NOT_READY retries, restarts, timeouts, taken ports."""

from __future__ import annotations

import json
import multiprocessing as mp
import threading
import time

import msgspec
import pytest
import zmq
from messenger_helpers import HOST, free_port, register_in_child, register_msg

from sgl_pd.core.clock import ManualClock
from sgl_pd.core.wire import (
    REGISTRY_LAYOUT_HASH,
    ErrorCode,
    ErrorMsg,
    FrameCodec,
    Heartbeat,
    RegistryQuery,
    SubmitPrefill,
)
from sgl_pd.messenger import (
    AddressInUse,
    BindError,
    BootstrapError,
    BootstrapTimeout,
    InvalidAddress,
    MessengerClosed,
    RegistryClient,
    RegistryServer,
)
from sgl_pd.messenger.submissions import SUBMISSION_MEMORY_S, RecentSubmissions


def test_ranks_from_threads_and_a_process_are_returned_by_rank() -> None:
    msgs = [register_msg(rank, 3, instance=100 + rank) for rank in range(3)]
    with RegistryServer(HOST, 0) as server, RegistryClient("test") as client:
        child = mp.get_context("spawn").Process(
            target=register_in_child, args=(server.address, msgs[1]), daemon=True
        )
        child.start()
        try:
            threads = [
                threading.Thread(target=client.register, args=(server.address, msgs[r]))
                for r in (2, 0)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(10)
            child.join(30)
            assert child.exitcode == 0
        finally:
            if child.is_alive():
                child.kill()
                child.join()
        frames = client.query(server.address, timeout_s=5.0)
    assert frames == [m.registration for m in msgs]


def test_query_retries_until_every_rank_registered() -> None:
    with RegistryServer(HOST, 0) as server, RegistryClient("test") as client:
        client.register(server.address, register_msg(0, 2, instance=1))
        with pytest.raises(BootstrapTimeout, match=r"not ready.*\[0\] of TP 2"):
            client.query(server.address, timeout_s=0.3, retry_interval_s=0.05)

        late = threading.Timer(
            0.3, client.register, args=(server.address, register_msg(1, 2, instance=2))
        )
        late.start()
        try:
            frames = client.query(server.address, timeout_s=10.0, retry_interval_s=0.05)
        finally:
            late.join()
    assert frames == [register_msg(r, 2, instance=r + 1).registration for r in range(2)]


def test_reregistration_replaces_and_a_new_tp_size_wins() -> None:
    with RegistryServer(HOST, 0) as server, RegistryClient("test") as client:
        for rank in range(2):
            client.register(server.address, register_msg(rank, 2, instance=1))
        client.register(server.address, register_msg(1, 2, instance=9))  # rank 1 restarted
        assert client.query(server.address)[1] == register_msg(1, 2, instance=9).registration
        client.register(server.address, register_msg(0, 1, instance=5))  # relaunched as TP 1
        assert client.query(server.address) == [register_msg(0, 1, instance=5).registration]


def test_nothing_listening_is_a_timeout_naming_the_address() -> None:
    addr = f"{HOST}:{free_port()}"
    with RegistryClient("test") as client:
        start = time.monotonic()
        with pytest.raises(BootstrapTimeout, match=addr):
            client.query(addr, timeout_s=1.0)
        with pytest.raises(BootstrapTimeout, match="bootstrap"):
            client.register(addr, register_msg(0, 1, instance=1), timeout_s=0.5)
        assert time.monotonic() - start < 1.5 + 2.0


def test_registry_started_late_is_found() -> None:
    port = free_port()
    with RegistryClient("test") as client:
        box: list[list[bytes]] = []
        asker = threading.Thread(
            target=lambda: box.append(client.query(f"{HOST}:{port}", timeout_s=10.0))
        )
        asker.start()
        time.sleep(0.3)
        with RegistryServer(HOST, port) as server:
            client.register(server.address, register_msg(0, 1, instance=1))
            asker.join(10)
    assert box == [[register_msg(0, 1, instance=1).registration]]


def test_taken_port_and_bad_host_are_typed() -> None:
    with RegistryServer(HOST, 0) as server, pytest.raises(AddressInUse, match=str(server.port)):
        RegistryServer(HOST, server.port)
    with pytest.raises(BindError):
        RegistryServer("203.0.113.7", 0)  # TEST-NET-3: not an address of this host
    with RegistryClient("test") as client:
        for bad in ("no-port-here", "host:0", "host:65536", ":80"):
            with pytest.raises(InvalidAddress):
                client.query(bad)


def test_close_frees_the_port() -> None:
    server = RegistryServer(HOST, 0)
    server.close()
    server.close()  # idempotent
    with RegistryServer(HOST, server.port):
        pass


def test_registry_answers_garbage_and_strangers_with_errors() -> None:
    codec = FrameCodec(REGISTRY_LAYOUT_HASH)
    with RegistryServer(HOST, 0) as server:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)
        try:
            sock.connect(f"tcp://{server.address}")
            for frame in (
                b"garbage",
                codec.encode(Heartbeat(sender="tcp://x:1", seq=1, time_s=0.0)),
            ):
                sock.send(frame)
                reply = codec.decode(sock.recv())
                assert isinstance(reply, ErrorMsg) and reply.code is ErrorCode.BAD_REQUEST
            sock.send(codec.encode(RegistryQuery(sender="raw")))
            reply = codec.decode(sock.recv())
            assert isinstance(reply, ErrorMsg) and reply.code is ErrorCode.NOT_READY
        finally:
            sock.close(linger=0)
            ctx.term()
        assert server.bad_frames == 1


def test_close_cancels_a_call_in_progress() -> None:
    client = RegistryClient("test")
    errors: list[BaseException] = []

    def ask() -> None:
        try:
            client.query(f"{HOST}:{free_port()}", timeout_s=30.0)
        except BaseException as e:
            errors.append(e)

    asker = threading.Thread(target=ask)
    asker.start()
    time.sleep(0.2)
    client.close()
    asker.join(5)
    assert not asker.is_alive()
    assert len(errors) == 1 and isinstance(errors[0], MessengerClosed)
    with pytest.raises(MessengerClosed):
        client.query(f"{HOST}:1")


def _submission(room: int) -> SubmitPrefill:
    body = json.dumps({"input_ids": [1, 2, 3], "bootstrap_room": room}).encode()
    return SubmitPrefill(request_id=room, sender="test decoder", request=body)


def test_a_submitted_prefill_reaches_the_server_once_its_ranks_registered() -> None:
    taken: list[SubmitPrefill] = []

    def take(msg: SubmitPrefill) -> tuple[ErrorCode, str] | None:
        taken.append(msg)
        return None

    with (
        RegistryServer(HOST, 0, submit=take) as server,
        RegistryClient("test", attempt_timeout_s=0.5) as client,
    ):
        # ranks still starting: the submission waits (NOT_READY), then times out
        with pytest.raises(BootstrapTimeout, match="not ready"):
            client.submit(server.address, _submission(7), timeout_s=0.3)
        client.register(server.address, register_msg(0, 1, instance=1))
        client.submit(server.address, _submission(8), timeout_s=5.0)
    assert [m.request_id for m in taken] == [8]


def test_a_refused_submission_says_why() -> None:
    def refuse(msg: SubmitPrefill) -> tuple[ErrorCode, str] | None:
        return ErrorCode.OVERLOADED, "1024 submitted requests in flight"

    with (
        RegistryServer(HOST, 0, submit=refuse) as server,
        RegistryClient("test") as client,
        RegistryServer(HOST, 0) as router_only,
    ):
        client.register(server.address, register_msg(0, 1, instance=1))
        with pytest.raises(BootstrapError, match="overloaded: 1024 submitted"):
            client.submit(server.address, _submission(9), timeout_s=5.0)
        client.register(router_only.address, register_msg(0, 1, instance=2))
        with pytest.raises(BootstrapError, match="does not take requests from decoders"):
            client.submit(router_only.address, _submission(9), timeout_s=5.0)


def test_a_resent_submission_is_handed_over_once_and_acked() -> None:
    taken: list[int] = []

    def slow_take(msg: SubmitPrefill) -> tuple[ErrorCode, str] | None:
        taken.append(msg.request_id)
        if len(taken) == 1:
            time.sleep(0.6)  # three attempts long: the client gives up on the first copy
        return None

    with (
        RegistryServer(HOST, 0, submit=slow_take) as server,
        RegistryClient("test", attempt_timeout_s=0.2) as client,
    ):
        client.register(server.address, register_msg(0, 1, instance=1))
        client.submit(server.address, _submission(7), timeout_s=5.0)
        assert server.resent_submissions >= 1  # the registry did see the room again
    assert taken == [7]


def test_a_resent_refusal_is_refused_alike_without_a_second_hand_over() -> None:
    calls: list[int] = []

    def slow_refuse(msg: SubmitPrefill) -> tuple[ErrorCode, str] | None:
        calls.append(msg.request_id)
        time.sleep(0.6)
        return ErrorCode.OVERLOADED, "1024 submitted requests in flight"

    with (
        RegistryServer(HOST, 0, submit=slow_refuse) as server,
        RegistryClient("test", attempt_timeout_s=0.2) as client,
    ):
        client.register(server.address, register_msg(0, 1, instance=1))
        with pytest.raises(BootstrapError, match="overloaded: 1024 submitted"):
            client.submit(server.address, _submission(7), timeout_s=5.0)
        assert server.resent_submissions >= 1
    assert calls == [7]


def test_a_taken_room_is_refused_to_another_request_until_forgotten() -> None:
    taken: list[bytes] = []

    def take(msg: SubmitPrefill) -> tuple[ErrorCode, str] | None:
        taken.append(msg.request)
        return None

    clock = ManualClock()
    other = SubmitPrefill(request_id=7, sender="another decoder", request=b'{"room": 7}')
    with (
        RegistryServer(HOST, 0, submit=take, clock=clock) as server,
        RegistryClient("test") as client,
    ):
        client.register(server.address, register_msg(0, 1, instance=1))
        client.submit(server.address, _submission(7), timeout_s=5.0)
        with pytest.raises(BootstrapError, match="conflict: room 7 is taken"):
            client.submit(server.address, other, timeout_s=5.0)
        clock.advance(SUBMISSION_MEMORY_S)
        # long after, the room is a new request's: handed over, as is the same body again
        client.submit(server.address, other, timeout_s=5.0)
        clock.advance(SUBMISSION_MEMORY_S)
        client.submit(server.address, _submission(7), timeout_s=5.0)
    assert taken == [_submission(7).request, other.request, _submission(7).request]


def test_each_recompute_of_a_room_is_a_hand_off_of_its_own() -> None:
    """A retracted request's KV is recomputed under its room, maybe more than once
    (even with an identical body): each attempt is handed over once, its copies answered
    as its first copy was."""
    taken: list[int] = []

    def take(msg: SubmitPrefill) -> tuple[ErrorCode, str] | None:
        taken.append(msg.attempt)
        return None

    first = _submission(7)
    again = msgspec.structs.replace(first, attempt=1)
    other_body = msgspec.structs.replace(first, attempt=2, request=b'{"room": 7, "n": 2}')
    with (
        RegistryServer(HOST, 0, submit=take) as server,
        RegistryClient("test") as client,
    ):
        client.register(server.address, register_msg(0, 1, instance=1))
        for msg in (first, again, again, other_body):
            client.submit(server.address, msg, timeout_s=5.0)
        assert server.resent_submissions == 1
    assert taken == [0, 1, 2]


def test_recent_submissions_are_bounded_by_age_and_count() -> None:
    clock = ManualClock()
    memory = RecentSubmissions(clock, memory_s=10.0, capacity=3)
    for room in range(5):
        memory.remember(_submission(room), None)
        clock.advance(1.0)
    assert len(memory) == 3  # the two oldest made room
    assert memory.recall(_submission(1)) is None
    assert memory.recall(_submission(2)) is not None
    clock.advance(7.5)  # room 2 answered 10.5 s ago, room 4 8.5 s ago
    assert memory.recall(_submission(2)) is None
    assert memory.recall(_submission(4)) is not None
    assert len(memory) == 2
    clock.advance(2.0)
    assert memory.recall(_submission(4)) is None
    assert len(memory) == 0


def test_a_resent_submission_always_finds_the_first_copys_answer() -> None:
    """A client resends only within its submit timeout: the registry remembers longer."""
    from sgl_pd.messenger.registry import SUBMIT_TIMEOUT_S

    assert SUBMISSION_MEMORY_S > 2 * SUBMIT_TIMEOUT_S


def test_a_skipped_room_is_handed_to_the_server_and_acknowledged() -> None:
    """Router flow: a decoder that prefills a room itself tells the prefill server's
    registry, which passes the room on and acknowledges; a registry without the hook
    refuses, so the decoder's log says the prefill server was not told."""
    from sgl_pd.core.wire import SkipPrefill

    skipped: list[int] = []
    with (
        RegistryServer(HOST, 0, skip=skipped.append) as server,
        RegistryServer(HOST, 0) as no_skips,
        RegistryClient("test") as client,
    ):
        client.skip(server.address, SkipPrefill(request_id=41, sender="decode-0"), timeout_s=5.0)
        client.skip(server.address, SkipPrefill(request_id=41, sender="decode-0"), timeout_s=5.0)
        with pytest.raises(BootstrapError, match="takes no skipped rooms"):
            client.skip(no_skips.address, SkipPrefill(request_id=42, sender="d"), timeout_s=5.0)
    assert skipped == [41, 41]  # a repeated notice is harmless (`SkippedRooms.skip`)
