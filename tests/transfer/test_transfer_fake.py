"""The in-memory fake engine: same contract as the Mooncake one, one process."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from sgl_pd.core.clock import ManualClock
from sgl_pd.transfer import (
    BatchStatus,
    CompletionWordWriter,
    EngineClosed,
    InvalidWrites,
    PeerUnreachable,
    RegistrationError,
    TransferError,
    TransferFailed,
    UnknownBatch,
    Writes,
    write_with_completion,
)
from sgl_pd.transfer.fake import FakeFabric, FakeTransferEngine

N = 1 << 16  # bytes per test buffer


class Pair:
    def __init__(self, auto_complete: bool = True) -> None:
        self.fabric = FakeFabric()
        self.a = FakeTransferEngine(self.fabric, auto_complete=auto_complete)
        self.b = FakeTransferEngine(self.fabric)
        self.src = np.arange(N, dtype=np.uint64).astype(np.uint8)  # (N,) pattern
        self.dst = np.zeros(N, dtype=np.uint8)
        self.sa, self.da = int(self.src.ctypes.data), int(self.dst.ctypes.data)
        self.a.register(self.sa, N)
        self.b.register(self.da, N)


def test_write_copies_bytes() -> None:
    p = Pair()
    p.a.write(p.b.session_id, Writes.of([p.sa + 10, p.sa + 100], [p.da + 5000, p.da], [7, 50]))
    assert p.dst[5000:5007].tolist() == p.src[10:17].tolist()
    assert p.dst[:50].tolist() == p.src[100:150].tolist()
    assert int(p.dst[50:5000].sum()) == 0


def test_submit_stays_pending_until_delivered() -> None:
    p = Pair(auto_complete=False)
    h = p.a.submit(p.b.session_id, Writes.single(p.sa, p.da, 64))
    assert p.a.poll(h) is BatchStatus.PENDING
    assert int(p.dst[:64].sum()) == 0
    assert p.a.deliver() == 1
    assert p.a.poll(h) is BatchStatus.DONE
    assert p.dst[:64].tolist() == p.src[:64].tolist()
    with pytest.raises(UnknownBatch):  # a final status is reported once
        p.a.poll(h)


def test_destination_outside_peer_memory_fails_without_writing() -> None:
    p = Pair()
    w = Writes.of([p.sa, p.sa], [p.da, p.da + N - 8], 64)
    with pytest.raises(TransferFailed) as info:
        p.a.write(p.b.session_id, w)
    assert (info.value.n_writes, info.value.nbytes) == (2, 128)
    assert int(p.dst.sum()) == 0
    assert p.a.poll(p.a.submit(p.b.session_id, w)) is BatchStatus.FAILED


def test_unregistered_source_is_invalid() -> None:
    p = Pair()
    with pytest.raises(InvalidWrites):
        p.a.write(p.b.session_id, Writes.single(p.sa + N - 4, p.da, 8))


def test_unknown_or_down_peer_is_unreachable() -> None:
    p = Pair()
    with pytest.raises(PeerUnreachable):
        p.a.write("fake:999", Writes.single(p.sa, p.da, 8))
    p.fabric.set_down(p.b.session_id)
    with pytest.raises(PeerUnreachable):
        p.a.submit(p.b.session_id, Writes.single(p.sa, p.da, 8))
    p.fabric.set_down(p.b.session_id, False)
    p.a.write(p.b.session_id, Writes.single(p.sa, p.da, 8))


def test_injected_failure_and_close() -> None:
    p = Pair(auto_complete=False)
    p.a.fail_next()
    h1 = p.a.submit(p.b.session_id, Writes.single(p.sa, p.da, 8))
    h2 = p.a.submit(p.b.session_id, Writes.single(p.sa, p.da, 8))
    p.a.deliver()
    assert [p.a.poll(h1), p.a.poll(h2)] == [BatchStatus.FAILED, BatchStatus.DONE]
    h3 = p.a.submit(p.b.session_id, Writes.single(p.sa, p.da, 8))
    p.a.close()
    assert p.a.poll(h3) is BatchStatus.FAILED
    with pytest.raises(EngineClosed):
        p.a.write(p.b.session_id, Writes.single(p.sa, p.da, 8))


def test_registration_errors() -> None:
    p = Pair()
    with pytest.raises(RegistrationError, match="overlaps"):
        p.a.register(p.sa + 8, 16)
    with pytest.raises(RegistrationError):
        p.a.unregister(p.sa + 1)
    p.a.unregister(p.sa)
    with pytest.raises(InvalidWrites):
        p.a.write(p.b.session_id, Writes.single(p.sa, p.da, 8))


def test_completion_word_follows_data_and_is_skipped_on_failure() -> None:
    p = Pair()
    words = CompletionWordWriter(p.a, slots=2)
    word = p.dst[N - 8 :].view(np.uint64)
    words.send(p.b.session_id, Writes.single(p.sa, p.da, 1024), p.da + N - 8, 41)
    assert int(word[0]) == 41 and p.dst[:1024].tolist() == p.src[:1024].tolist()
    p.a.fail_next()
    with pytest.raises(TransferFailed):
        words.send(p.b.session_id, Writes.single(p.sa, p.da, 8), p.da + N - 8, 42)
    assert int(word[0]) == 41  # the data failed, so no word
    assert words.free_slots == 2
    words.close()


def _word_fails(p: Pair) -> None:
    """Lets the next data batch through and fails the word batch after it."""
    real = p.a.write
    calls = 0

    def write(peer: str, writes: Writes) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:
            p.a.fail_next()
        real(peer, writes)

    p.a.write = write  # type: ignore[method-assign]


def test_failed_word_write_quarantines_its_slots_until_time_is_up() -> None:
    p = Pair()
    clock = ManualClock()
    words = CompletionWordWriter(p.a, slots=3, wait_s=0.0, quarantine_s=60.0, clock=clock)
    word = p.dst[N - 16 :].view(np.uint64)  # (2,) two destination words
    _word_fails(p)
    with pytest.raises(TransferFailed):
        words.send_many(
            p.b.session_id, Writes.single(p.sa, p.da, 64), [(p.da + N - 16, 7), (p.da + N - 8, 8)]
        )
    assert word.tolist() == [0, 0]
    assert (words.free_slots, words.quarantined_slots) == (1, 2)
    with pytest.raises(TransferError, match="quarantined"):  # two words need two slots
        words.send_many(p.b.session_id, Writes.empty(), [(p.da + N - 16, 1), (p.da + N - 8, 2)])
    clock.advance(59.9)
    assert (words.free_slots, words.quarantined_slots) == (1, 2)
    clock.advance(0.1)
    assert (words.free_slots, words.quarantined_slots) == (3, 0)
    words.send_many(p.b.session_id, Writes.empty(), [(p.da + N - 16, 1), (p.da + N - 8, 2)])
    assert word.tolist() == [1, 2]
    assert words.free_slots == 3
    words.close()


def test_writer_that_saw_many_failures_still_sends() -> None:
    p = Pair()
    clock = ManualClock()
    words = CompletionWordWriter(p.a, slots=2, wait_s=0.0, quarantine_s=60.0, clock=clock)
    target = p.da + N - 8
    for failure in range(10):  # five times the slots, each failure 30 s after the last
        p.a.fail_next()
        with pytest.raises(TransferFailed):
            words.send(p.b.session_id, Writes.empty(), target, 100 + failure)
        assert words.free_slots + words.quarantined_slots == 2
        clock.advance(30.0)
    words.send(p.b.session_id, Writes.single(p.sa, p.da, 64), target, 5)
    assert int(p.dst[N - 8 :].view(np.uint64)[0]) == 5
    assert p.dst[:64].tolist() == p.src[:64].tolist()
    clock.advance(60.0)
    assert (words.free_slots, words.quarantined_slots) == (2, 0)
    words.close()


def test_sender_waiting_for_a_slot_takes_one_freed_by_another() -> None:
    p = Pair()
    words = CompletionWordWriter(p.a, slots=1, wait_s=10.0)
    holding, release = threading.Event(), threading.Event()
    real = p.a.write
    target = p.da + N - 8

    def slow_word(peer: str, writes: Writes) -> None:
        if int(writes.dst[0]) == target and not release.is_set():
            holding.set()
            release.wait(10.0)  # hold the only slot while the second sender waits
        real(peer, writes)

    p.a.write = slow_word  # type: ignore[method-assign]
    first = threading.Thread(target=words.send, args=(p.b.session_id, Writes.empty(), target, 1))
    first.start()
    assert holding.wait(10.0) and words.free_slots == 0
    timer = threading.Timer(0.05, release.set)
    timer.start()
    words.send(p.b.session_id, Writes.empty(), target - 8, 2)  # blocks until `first` is done
    first.join(10.0)
    timer.join(10.0)
    assert p.dst[N - 16 :].view(np.uint64).tolist() == [2, 1]
    with pytest.raises(TransferError, match="slots"):
        words.send_many(p.b.session_id, Writes.empty(), [(target, 1), (target - 8, 2)])
    words.close()


def test_write_with_completion_from_threads() -> None:
    p = Pair()
    words = CompletionWordWriter(p.a, slots=2)
    errors: list[BaseException] = []

    def run(t: int) -> None:
        try:
            for r in range(1, 51):
                w = Writes.single(p.sa + t * 256, p.da + t * 256, 256)
                words.send(p.b.session_id, w, p.da + N - 8 * (t + 1), r)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(10.0)
    assert not errors
    assert p.dst[N - 32 :].view(np.uint64).tolist() == [50] * 4
    assert p.dst[:1024].tolist() == p.src[:1024].tolist()


def test_write_with_completion_uses_caller_word() -> None:
    p = Pair()
    write_with_completion(
        p.a, p.b.session_id, Writes.single(p.sa, p.da, 16), Writes.single(p.sa + 8, p.da + 64, 8)
    )
    assert p.dst[64:72].tolist() == p.src[8:16].tolist()


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, N - 1), st.integers(0, N - 1), st.integers(1, 512)),
        max_size=40,
    )
)
def test_writes_apply_in_order_like_numpy(triples: list[tuple[int, int, int]]) -> None:
    p = Pair()
    triples = [(s, d, min(n, N - s, N - d)) for s, d, n in triples]
    ref = np.zeros(N, dtype=np.uint8)
    for s, d, n in triples:
        ref[d : d + n] = p.src[s : s + n]
    cols = np.array(triples, dtype=np.int64).reshape(-1, 3)  # (n, 3): src, dst, nbytes
    src, dst, nb = cols[:, 0], cols[:, 1], cols[:, 2]
    p.a.write(p.b.session_id, Writes.of(p.sa + src, p.da + dst, nb))
    assert p.dst.tobytes() == ref.tobytes()


def test_fake_satisfies_the_protocol() -> None:
    from sgl_pd.transfer import TransferEngine

    assert isinstance(FakeTransferEngine(FakeFabric()), TransferEngine)
