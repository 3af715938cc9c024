"""Per-key queues and threads: order within a key, independence across keys, idle exit,
and a crashed worker counted and replaced."""

from __future__ import annotations

import threading
import time

from sgl_pd.messenger.keyed_workers import KeyedWorkers


def _wait(predicate, timeout_s: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_items_of_a_key_run_in_order_and_a_blocked_key_holds_up_only_itself() -> None:
    gate = threading.Event()
    seen: list[tuple[str, int]] = []

    def handle(key: str, item: int) -> None:
        if key == "slow":
            gate.wait(10)
        seen.append((key, item))

    workers: KeyedWorkers[int] = KeyedWorkers(handle, "test")
    for i in range(3):
        workers.put("slow", i)
    for i in range(50):
        workers.put("fast", i)
    _wait(lambda: len(seen) == 50)
    assert [i for k, i in seen if k == "fast"] == list(range(50))
    gate.set()
    _wait(lambda: len(seen) == 53)
    assert [i for k, i in seen if k == "slow"] == [0, 1, 2]
    workers.close(timeout_s=5)
    assert not workers.put("fast", 99)


def test_idle_threads_exit_and_come_back_on_demand() -> None:
    seen: list[int] = []
    workers: KeyedWorkers[int] = KeyedWorkers(
        lambda _k, i: seen.append(i), "idle", idle_exit_s=0.05
    )
    workers.put("a", 1)
    _wait(lambda: seen == [1])
    _wait(lambda: not any(t.name == "idle" for t in threading.enumerate()))
    workers.put("a", 2)
    _wait(lambda: seen == [1, 2])
    workers.close(timeout_s=5)


def test_a_crashing_handler_is_counted_and_the_key_gets_a_new_thread() -> None:
    seen: list[int] = []

    def handle(_key: str, item: int) -> None:
        if item == 0:
            raise RuntimeError("a bug")
        seen.append(item)

    workers: KeyedWorkers[int] = KeyedWorkers(handle, "crash")
    workers.put("a", 0)
    _wait(lambda: workers.thread_failures == 1)
    workers.put("a", 1)
    _wait(lambda: seen == [1])
    workers.close(timeout_s=5)


def test_a_full_queue_refuses() -> None:
    gate = threading.Event()
    workers: KeyedWorkers[int] = KeyedWorkers(lambda _k, _i: gate.wait(10), "full", max_queued=2)
    accepted = [workers.put("a", i) for i in range(5)]
    assert accepted.count(False) >= 2  # at most one in hand and two queued
    gate.set()
    workers.close(timeout_s=5)


def test_keys_beyond_the_limit_are_refused_and_retired_keys_are_reported() -> None:
    gate = threading.Event()
    retired: list[str] = []
    workers: KeyedWorkers[int] = KeyedWorkers(
        lambda _k, _i: gate.wait(10),
        "bounded",
        max_keys=2,
        idle_exit_s=0.05,
        on_retire=retired.append,
    )
    assert workers.put("a", 1) and workers.put("b", 1)
    assert not workers.put("c", 1)  # a third peer while two are busy
    assert workers.put("a", 2)  # known keys still queue
    gate.set()
    _wait(lambda: sorted(retired) == ["a", "b"])
    assert workers.put("c", 1)  # room again once the others retired
    workers.close(timeout_s=5)
