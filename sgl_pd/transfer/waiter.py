"""The thread that turns Mooncake's blocking batch wait into a pollable status.

Mooncake's binding has no non-blocking status for a whole batch: `transfer_check_status`
looks at the first write only, and `get_batch_transfer_status` blocks (spinning, GIL
released) until the batch completes, fails or times out. One thread per engine runs a
job per submitted batch, in submission order, and records the outcome: usually waiting for
a batch already handed to Mooncake, sometimes pushing a batch too big for the in-flight cap
through in chunks.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable

from sgl_pd.transfer.engine import BatchHandle, BatchStatus
from sgl_pd.transfer.errors import EngineClosed, TransferError, UnknownBatch

_log = logging.getLogger(__name__)
_IDLE_WAKE_S = 0.1  # seconds between stop checks while no batch is queued

Job = Callable[[], bool]  # runs or waits for one batch; True when it completed


class BatchWaiter:
    """Holds the status of every submitted batch until `take` reports a final one."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._status: dict[int, BatchStatus] = {}  # handle id -> status
        self._queue: queue.Queue[tuple[int, Job]] = queue.Queue()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def add(self, handle_id: int, job: Job) -> None:
        with self._lock:
            if self._stop.is_set():
                raise EngineClosed("the engine is closed; build a new one")
            self._status[handle_id] = BatchStatus.PENDING
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self._name, daemon=True)
                self._thread.start()
        self._queue.put((handle_id, job))

    def add_final(self, handle_id: int, status: BatchStatus) -> None:
        """Records a batch that finished at submission (empty batch)."""
        with self._lock:
            self._status[handle_id] = status

    def take(self, handle: BatchHandle) -> BatchStatus:
        with self._lock:
            status = self._status.get(handle.id)
            if status is None:
                raise UnknownBatch(
                    f"batch {handle.id} to {handle.peer} is unknown: its final status was "
                    "already reported, or another engine issued it"
                )
            if status is not BatchStatus.PENDING:
                del self._status[handle.id]
            return status

    def stop(self, timeout_s: float) -> bool:
        """Stops the thread; batches not finished by then become FAILED. Returns False if
        the thread was still inside a native wait after `timeout_s` seconds."""
        self._stop.set()
        thread = self._thread
        if thread is not None:
            thread.join(timeout_s)
        with self._lock:
            for hid, st in self._status.items():
                if st is BatchStatus.PENDING:
                    self._status[hid] = BatchStatus.FAILED
        return thread is None or not thread.is_alive()

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                handle_id, job = self._queue.get(timeout=_IDLE_WAKE_S)
            except queue.Empty:
                continue
            try:
                ok = job()
            except TransferError:  # the job's batch failed; the thread goes on
                ok = False
            except Exception:  # a bug or binding error fails the batch, never the thread
                _log.exception("batch %d: job raised; marking it FAILED", handle_id)
                ok = False
            with self._lock:
                if handle_id in self._status:
                    self._status[handle_id] = BatchStatus.DONE if ok else BatchStatus.FAILED
