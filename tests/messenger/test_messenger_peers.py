"""The decode side's directory: real registries for the wire paths, a fake client (no ZMQ
involved) with a manual clock for the retry bookkeeping."""

from __future__ import annotations

import threading
import time

import pytest
from messenger_helpers import CODEC_HASH, HOST, free_port, register_msg, registration

from sgl_pd.core.clock import ManualClock
from sgl_pd.core.errors import LayoutMismatch
from sgl_pd.core.wire import FrameCodec
from sgl_pd.messenger import (
    BootstrapError,
    BootstrapTimeout,
    InvalidAddress,
    MessengerClosed,
    PeerDirectory,
    RegistryClient,
    RegistryServer,
)
from sgl_pd.messenger.peers import TABLE_MAX_AGE_S


def test_restarted_rank_is_seen_after_invalidate() -> None:
    with (
        RegistryServer(HOST, 0) as server,
        RegistryClient("prefill") as prefill,
        PeerDirectory(CODEC_HASH, retry_interval_s=0.05) as peers,
    ):
        for rank in range(2):
            prefill.register(server.address, register_msg(rank, 2, instance=1))
        table = peers.wait(server.address, timeout_s=10.0)
        assert [s.rank for s in table.shards] == [0, 1]
        assert {s.instance for s in table.shards} == {1}
        assert peers.lookup(server.address) is table

        restarted = register_msg(1, 2, instance=2, inbox=f"tcp://{HOST}:19999")
        prefill.register(server.address, restarted)
        assert peers.lookup(server.address) is table  # cached until told otherwise, or old
        peers.invalidate(server.address)
        table = peers.wait(server.address, timeout_s=10.0)
        assert table.shards[1].instance == 2
        assert table.shards[1].inbox == f"tcp://{HOST}:19999"


def test_a_prefill_restarted_while_idle_is_found_by_the_next_request() -> None:
    clock = ManualClock()
    with (
        RegistryServer(HOST, 0) as server,
        RegistryClient("prefill") as prefill,
        PeerDirectory(CODEC_HASH, clock=clock, retry_interval_s=0.05) as peers,
    ):
        for rank in range(2):
            prefill.register(server.address, register_msg(rank, 2, instance=1))
        old = peers.wait(server.address, timeout_s=10.0)
        assert {s.instance for s in old.shards} == {1}

        # The server restarts while this decoder sends it nothing: no liveness check sees
        # it, nobody invalidates. A restart takes longer than a table is trusted.
        new_inboxes = [f"tcp://{HOST}:{free_port()}" for _ in range(2)]
        for rank in range(2):
            prefill.register(
                server.address, register_msg(rank, 2, instance=2, inbox=new_inboxes[rank])
            )
        clock.advance(TABLE_MAX_AGE_S)

        first = peers.lookup(server.address)  # the receiver's init, then its polls
        assert first is None
        table = peers.wait(server.address, timeout_s=10.0)
        assert {s.instance for s in table.shards} == {2}
        assert [s.inbox for s in table.shards] == new_inboxes


def test_layout_mismatch_surfaces_from_the_directory() -> None:
    with (
        RegistryServer(HOST, 0) as server,
        RegistryClient("prefill") as prefill,
        PeerDirectory(CODEC_HASH ^ 1) as peers,
    ):
        prefill.register(server.address, register_msg(0, 1, instance=1))
        with pytest.raises(LayoutMismatch, match=f"rank 0 at {server.address}"):
            peers.wait(server.address, timeout_s=10.0)
        assert isinstance(peers.failure(server.address), LayoutMismatch)
        assert peers.lookup(server.address) is None  # within the back-off: no new query


def test_unreachable_server_fails_with_a_timeout() -> None:
    addr = f"{HOST}:{free_port()}"
    with PeerDirectory(CODEC_HASH, query_timeout_s=0.5) as peers:
        assert peers.lookup(addr) is None
        assert peers.failure(addr) is None  # still asking
        start = time.monotonic()
        with pytest.raises(BootstrapTimeout, match=addr):
            peers.wait(addr, timeout_s=10.0)
        assert time.monotonic() - start < 0.5 + 2.0
        with pytest.raises(InvalidAddress):
            peers.lookup("nowhere")
    with pytest.raises(MessengerClosed):
        peers.lookup(addr)


class FakeClient:
    """Answers queries from a script; each call waits for `go` so tests can hold it."""

    def __init__(self) -> None:
        self.calls = 0
        self.answers: list[list[bytes] | Exception] = []
        self.go = threading.Event()
        self.go.set()

    def query(
        self,
        addr: str,
        timeout_s: float = 0.0,
        retry_interval_s: float = 0.0,
        stop: threading.Event | None = None,
    ) -> list[bytes]:
        self.calls += 1
        assert self.go.wait(5.0)
        answer = self.answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer


def _settle(peers: PeerDirectory, addr: str, fake: FakeClient, calls: int) -> None:
    """Wait (real time) until the fake saw `calls` queries and the directory took the last."""
    end = time.monotonic() + 5.0
    while time.monotonic() < end:
        if fake.calls == calls and not peers.querying(addr):
            return
        time.sleep(0.005)
    raise AssertionError(f"{fake.calls} calls, wanted {calls}")


def test_backoff_single_flight_and_stale_answers() -> None:
    addr = f"{HOST}:1"
    good = [FrameCodec(CODEC_HASH).encode(registration(0, 1, instance=3))]
    fake = FakeClient()
    clock = ManualClock()
    with PeerDirectory(CODEC_HASH, client=fake, clock=clock, retry_backoff_s=5.0) as peers:
        fake.answers = [BootstrapTimeout("down"), good]
        fake.go.clear()
        for _ in range(5):
            assert peers.lookup(addr) is None
        fake.go.set()
        _settle(peers, addr, fake, 1)  # five lookups, one query
        assert isinstance(peers.failure(addr), BootstrapTimeout)

        clock.advance(4.9)
        assert peers.lookup(addr) is None
        _settle(peers, addr, fake, 1)  # inside the back-off: not asked again
        clock.advance(0.2)
        assert peers.lookup(addr) is None
        _settle(peers, addr, fake, 2)
        table = peers.lookup(addr)
        assert table is not None and table.shards[0].instance == 3
        assert peers.failure(addr) is None

        # An answer to a query begun before invalidate() may predate a restart: dropped.
        peers.invalidate(addr)
        fake.answers = [good, [FrameCodec(CODEC_HASH).encode(registration(0, 1, instance=4))]]
        fake.go.clear()
        assert peers.lookup(addr) is None
        peers.invalidate(addr)
        fake.go.set()
        _settle(peers, addr, fake, 3)
        assert peers.lookup(addr) is None
        _settle(peers, addr, fake, 4)
        table = peers.lookup(addr)
        assert table is not None and table.shards[0].instance == 4


def test_registrations_that_do_not_fit_are_rejected() -> None:
    codec = FrameCodec(CODEC_HASH)
    fake = FakeClient()
    fake.answers = [
        [codec.encode(registration(1, 2, instance=1)), codec.encode(registration(0, 2, 1))],
        [codec.encode(registration(0, 2, instance=1))],  # says TP 2, registry says 1
    ]
    with PeerDirectory(CODEC_HASH, client=fake) as peers:
        with pytest.raises(BootstrapError, match="as rank 0 of 2"):
            peers.wait(f"{HOST}:1", timeout_s=5.0)
        with pytest.raises(BootstrapError, match="of 2"):
            peers.wait(f"{HOST}:2", timeout_s=5.0)


def test_a_table_in_use_is_refreshed_ahead_and_an_old_one_is_not_returned() -> None:
    addr = f"{HOST}:1"
    codec = FrameCodec(CODEC_HASH)
    fake = FakeClient()
    clock = ManualClock()
    with pytest.raises(ValueError, match="max age"):
        PeerDirectory(CODEC_HASH, client=fake, max_age_s=0.0)
    with PeerDirectory(CODEC_HASH, client=fake, clock=clock, max_age_s=4.0) as peers:
        fake.answers = [[codec.encode(registration(0, 1, instance=i))] for i in (1, 2, 3)]
        assert peers.wait(addr, timeout_s=5.0).shards[0].instance == 1
        _settle(peers, addr, fake, 1)

        clock.advance(1.9)
        assert peers.lookup(addr) is not None
        _settle(peers, addr, fake, 1)  # young: no query
        clock.advance(0.1)
        table = peers.lookup(addr)  # half the age: still returned, asked again meanwhile
        assert table is not None and table.shards[0].instance == 1
        _settle(peers, addr, fake, 2)
        table = peers.lookup(addr)
        assert table is not None and table.shards[0].instance == 2

        clock.advance(3.9)  # the refreshed table's age counts from its answer
        fake.go.clear()
        table = peers.lookup(addr)
        assert table is not None and table.shards[0].instance == 2
        clock.advance(0.1)
        assert peers.lookup(addr) is None  # too old, and the refresh has not answered
        fake.go.set()
        _settle(peers, addr, fake, 3)
        table = peers.lookup(addr)
        assert table is not None and table.shards[0].instance == 3
