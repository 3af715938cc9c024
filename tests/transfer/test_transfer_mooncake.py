"""Real Mooncake over TCP on 127.0.0.1 between this process and a spawned receiver."""

from __future__ import annotations

import multiprocessing as mp
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest

pytest.importorskip("mooncake.engine")

import transfer_peer

from sgl_pd.transfer import (
    BatchHandle,
    BatchStatus,
    CompletionWordWriter,
    InvalidWrites,
    PeerUnreachable,
    TransferEngine,
    TransferFailed,
    TransportConfig,
    Writes,
)
from sgl_pd.transfer.mooncake import MooncakeTransferEngine

PEER_BYTES = 4 << 20  # bytes of the receiver's registered buffer
SRC_BYTES = 4 << 20  # bytes of the sender's registered buffer
Q_TIMEOUT_S = 30.0  # seconds any queue read may wait
CONNECT_TIMEOUT_S = 1.0  # seconds the engine waits for a new peer's handshake


@dataclass
class Peer:
    session: str
    base: int  # address of the receiver's buffer
    cmd: Any
    out: Any
    proc: Any

    def ask(self, *cmd: Any) -> Any:
        self.cmd.put(cmd)
        return self.out.get(timeout=Q_TIMEOUT_S)


def _start_peer(nbytes: int = PEER_BYTES) -> Peer:
    ctx = mp.get_context("spawn")
    cmd, out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=transfer_peer.serve, args=(cmd, out, nbytes), daemon=True)
    proc.start()
    try:
        tag, session, base = out.get(timeout=Q_TIMEOUT_S)
    except BaseException:
        proc.kill()
        proc.join(5)
        raise
    assert tag == "ready"
    return Peer(session, base, cmd, out, proc)


def _stop_peer(peer: Peer) -> None:
    try:
        peer.cmd.put(("stop",))
        peer.proc.join(10)
    finally:
        if peer.proc.is_alive():
            peer.proc.kill()
            peer.proc.join(5)


@pytest.fixture(scope="module")
def peer() -> Iterator[Peer]:
    p = _start_peer()
    try:
        yield p
    finally:
        _stop_peer(p)


@dataclass
class Local:
    engine: MooncakeTransferEngine
    src: np.ndarray  # (SRC_BYTES,) uint8, registered
    base: int


@pytest.fixture(scope="module")
def local() -> Iterator[Local]:
    engine = MooncakeTransferEngine(
        TransportConfig(hostname="127.0.0.1", connect_timeout_s=CONNECT_TIMEOUT_S)
    )
    src = np.random.default_rng(0).integers(0, 256, SRC_BYTES, dtype=np.uint8)
    engine.register(int(src.ctypes.data), SRC_BYTES)
    try:
        yield Local(engine, src, int(src.ctypes.data))
    finally:
        engine.close()


def _scatter(rng: np.random.Generator, n: int, max_len: int) -> tuple[np.ndarray, ...]:
    """n writes of random sizes at shuffled, non-overlapping destination offsets."""
    sizes = rng.integers(1, max_len + 1, n)
    gaps = rng.integers(0, 64, n)
    dst = np.cumsum(gaps + sizes) - sizes  # (n,) offsets, bytes
    assert dst[-1] + sizes[-1] <= PEER_BYTES
    src = rng.integers(0, SRC_BYTES - sizes)  # (n,) offsets, bytes
    order = rng.permutation(n)
    return src[order], dst[order], sizes[order]


def _expected(local: Local, src: np.ndarray, dst: np.ndarray, sizes: np.ndarray) -> bytes:
    image = np.zeros(PEER_BYTES, dtype=np.uint8)
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist(), strict=True):
        image[d : d + n] = local.src[s : s + n]
    return image.tobytes()


def _wait(engine: MooncakeTransferEngine, handle: BatchHandle, timeout_s: float) -> BatchStatus:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = engine.poll(handle)
        if status is not BatchStatus.PENDING:
            return status
        time.sleep(0.001)
    raise AssertionError(f"batch {handle} still pending after {timeout_s} s")


@pytest.mark.parametrize("mode", ["write", "submit"])
@pytest.mark.parametrize(
    ("n", "max_len"),
    [(300, 8192), (5000, 512)],  # 5000 > the TCP cap: the batch goes in pipelined chunks
    ids=["300-writes", "5000-writes"],
)
def test_scattered_writes_arrive_exactly(
    peer: Peer, local: Local, mode: str, n: int, max_len: int
) -> None:
    rng = np.random.default_rng(n + (mode == "submit"))
    src, dst, sizes = _scatter(rng, n, max_len)
    writes = Writes.of(local.base + src, peer.base + dst, sizes)
    assert peer.ask("zero") == "ok"
    if mode == "write":
        local.engine.write(peer.session, writes)
    else:
        handle = local.engine.submit(peer.session, writes)
        assert _wait(local.engine, handle, 20.0) is BatchStatus.DONE
    assert peer.ask("read", 0, PEER_BYTES) == _expected(local, src, dst, sizes)


def test_concurrent_batches_share_the_cap(peer: Peer, local: Local) -> None:
    """Four threads, 1500 writes each: 6000 in flight would overrun Mooncake's TCP queue."""
    rng = np.random.default_rng(7)
    src, dst, sizes = _scatter(rng, 6000, 256)
    parts = [slice(i * 1500, (i + 1) * 1500) for i in range(4)]
    errors: list[BaseException] = []

    def run(part: slice) -> None:
        try:
            local.engine.write(
                peer.session,
                Writes.of(local.base + src[part], peer.base + dst[part], sizes[part]),
            )
        except BaseException as e:
            errors.append(e)

    assert peer.ask("zero") == "ok"
    threads = [threading.Thread(target=run, args=(p,), daemon=True) for p in parts]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30.0)
    assert not errors, errors
    assert peer.ask("read", 0, PEER_BYTES) == _expected(local, src, dst, sizes)


def test_uncapped_tcp_batch_overruns_mooncake(local: Local) -> None:
    """Why the cap exists: Mooncake's TCP transport fails ~2048+ writes to one peer."""
    p = _start_peer(1 << 20)
    engine = MooncakeTransferEngine(
        TransportConfig(hostname="127.0.0.1", max_inflight_writes=1 << 16)
    )
    try:
        engine.register(local.base, SRC_BYTES)
        offs = np.arange(4096, dtype=np.int64) * 64  # bytes
        with pytest.raises(TransferFailed):
            engine.write(p.session, Writes.of(local.base + offs, p.base + offs, 64))
    finally:
        engine.close()
        _stop_peer(p)


def test_empty_batch_is_a_no_op(peer: Peer, local: Local) -> None:
    assert isinstance(local.engine, TransferEngine)
    local.engine.write(peer.session, Writes.empty())
    handle = local.engine.submit(peer.session, Writes.empty())
    assert local.engine.poll(handle) is BatchStatus.DONE


def test_completion_word_arrives_after_data(peer: Peer, local: Local) -> None:
    data_bytes = 1 << 20  # one round's payload, bytes: 16 pages of 64 KiB
    word_off = PEER_BYTES - 8
    words = CompletionWordWriter(local.engine, slots=4)
    try:
        assert peer.ask("zero") == "ok"
        for rnd in range(1, 6):
            local.src[:data_bytes] = rnd  # this round's payload
            pages = np.arange(16, dtype=np.int64) * 65536
            writes = Writes.of(local.base + pages, peer.base + pages[::-1], 65536)
            peer.cmd.put(("wait_word", word_off, rnd, 0, data_bytes, 10.0))
            words.send(peer.session, writes, peer.base + word_off, rnd)
            seen, data = peer.out.get(timeout=Q_TIMEOUT_S)
            assert seen, f"round {rnd}: the completion word never arrived"
            assert data == bytes([rnd]) * data_bytes, f"round {rnd}: word before data"
        assert words.free_slots == 4
    finally:
        words.close()
        local.src[:] = np.random.default_rng(0).integers(0, 256, SRC_BYTES, dtype=np.uint8)


def test_completion_words_from_threads(peer: Peer, local: Local) -> None:
    n_threads, rounds = 3, 10
    words = CompletionWordWriter(local.engine, slots=n_threads)
    errors: list[BaseException] = []
    stop = threading.Event()

    def sender(t: int) -> None:
        # thread t owns destination [t * 64 KiB, +64 KiB) and word PEER_BYTES - 8 * (t + 1)
        try:
            for r in range(1, rounds + 1):
                if stop.is_set():
                    return
                w = Writes.single(local.base + t * 65536, peer.base + t * 65536, 65536)
                words.send(peer.session, w, peer.base + PEER_BYTES - 8 * (t + 1), r)
        except BaseException as e:
            errors.append(e)

    try:
        assert peer.ask("zero") == "ok"
        threads = [threading.Thread(target=sender, args=(t,), daemon=True) for t in range(3)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(20.0)
        assert not any(th.is_alive() for th in threads)
        assert not errors, errors
        tail = np.frombuffer(peer.ask("read", PEER_BYTES - 8 * n_threads, 8 * n_threads), "<u8")
        assert tail.tolist() == [rounds] * n_threads
        head = peer.ask("read", 0, n_threads * 65536)
        assert head == local.src[: n_threads * 65536].tobytes()
    finally:
        stop.set()
        words.close()


def test_refused_port_is_unreachable_at_once(local: Local) -> None:
    with socket.socket() as s:  # bind then close: a port with nothing listening
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    writes = Writes.single(local.base, 0x10000, 64)
    t0 = time.monotonic()
    with pytest.raises(PeerUnreachable) as info:
        local.engine.write(f"127.0.0.1:{port}", writes)
    with pytest.raises(PeerUnreachable):
        local.engine.submit(f"127.0.0.1:{port}", writes)
    assert time.monotonic() - t0 < 2 * CONNECT_TIMEOUT_S
    assert info.value.peer == f"127.0.0.1:{port}"


def test_silent_peer_times_out_without_blocking_others(peer: Peer, local: Local) -> None:
    """A peer that accepts TCP but never answers would hold Mooncake ~60 s."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # never accepted: the handshake waits for an answer
    session = f"127.0.0.1:{silent.getsockname()[1]}"
    probe_name = f"sgl-pd-probe-{session}"
    try:
        t0 = time.monotonic()
        with pytest.raises(PeerUnreachable):
            local.engine.write(session, Writes.single(local.base, 0x10000, 64))
        assert time.monotonic() - t0 < CONNECT_TIMEOUT_S + 1.0
        # the probe is still stuck in Mooncake, yet a healthy peer is served at once
        assert any(t.name == probe_name for t in threading.enumerate())
        t1 = time.monotonic()
        local.engine.write(peer.session, Writes.single(local.base, peer.base, 4096))
        assert time.monotonic() - t1 < 1.0
    finally:
        silent.close()  # resets the queued connection: the probe thread returns
    deadline = time.monotonic() + 10.0
    while any(t.name == probe_name for t in threading.enumerate()):
        assert time.monotonic() < deadline, "probe thread outlived the closed socket"
        time.sleep(0.05)


def test_destination_outside_registered_memory_fails(peer: Peer, local: Local) -> None:
    outside = Writes.of([local.base, local.base], [peer.base, peer.base + PEER_BYTES - 32], 64)
    with pytest.raises(TransferFailed) as info:
        local.engine.write(peer.session, outside)
    assert (info.value.peer, info.value.n_writes, info.value.nbytes) == (peer.session, 2, 128)
    assert "peer is alive" in info.value.reason
    handle = local.engine.submit(peer.session, outside)
    assert _wait(local.engine, handle, 20.0) is BatchStatus.FAILED
    # the engine and the peer still work afterwards
    local.engine.write(peer.session, Writes.single(local.base, peer.base, 64))


def test_source_outside_registered_memory_is_refused(peer: Peer, local: Local) -> None:
    other = np.ones(4096, dtype=np.uint8)  # never registered
    bad = Writes.of([local.base, int(other.ctypes.data)], [peer.base, peer.base + 4096], 64)
    with pytest.raises(InvalidWrites, match="1 of 2 writes"):
        local.engine.write(peer.session, bad)
    straddle = Writes.single(local.base + SRC_BYTES - 16, peer.base, 64)
    with pytest.raises(InvalidWrites):
        local.engine.submit(peer.session, straddle)


def test_dead_peer_fails_in_bounded_time(local: Local) -> None:
    p = _start_peer(1 << 16)
    try:
        local.engine.write(p.session, Writes.single(local.base, p.base, 64))
        p.proc.kill()
        p.proc.join(10)
        t0 = time.monotonic()
        with pytest.raises((TransferFailed, PeerUnreachable)):
            local.engine.write(p.session, Writes.single(local.base, p.base, 64))
        assert time.monotonic() - t0 < 5.0
        with pytest.raises(PeerUnreachable):  # failure made the gate probe again
            local.engine.write(p.session, Writes.single(local.base, p.base, 64))
    finally:
        _stop_peer(p)
