"""A receiver process for the Mooncake tests: owns a registered numpy buffer and answers
commands from a queue. Started with the multiprocessing spawn context."""

from __future__ import annotations

import queue
import time
from typing import Any

import numpy as np

IDLE_EXIT_S = 120.0  # seconds without a command before the peer exits on its own
POLL_S = 0.0001  # seconds between reads of a completion word


def serve(cmd_q: Any, out_q: Any, nbytes: int) -> None:
    from sgl_pd.transfer.config import TransportConfig
    from sgl_pd.transfer.mooncake import MooncakeTransferEngine

    engine = MooncakeTransferEngine(TransportConfig(hostname="127.0.0.1"))
    buf = np.zeros(nbytes, dtype=np.uint8)  # (nbytes,) destination memory
    engine.register(int(buf.ctypes.data), nbytes)
    out_q.put(("ready", engine.session_id, int(buf.ctypes.data)))
    last = time.monotonic()
    try:
        while time.monotonic() - last < IDLE_EXIT_S:
            try:
                cmd = cmd_q.get(timeout=0.5)
            except queue.Empty:
                continue
            last = time.monotonic()
            op = cmd[0]
            if op == "stop":
                break
            if op == "read":
                _, off, n = cmd
                out_q.put(bytes(buf[off : off + n]))
            elif op == "zero":
                buf[:] = 0
                out_q.put("ok")
            elif op == "wait_word":
                # Spin on the word; the moment it shows `value`, copy the data range, so the
                # test sees what a decoder would read right after counting the word.
                _, word_off, value, data_off, n, timeout_s = cmd
                word = buf[word_off : word_off + 8].view(np.uint64)
                deadline = time.monotonic() + timeout_s
                seen = False
                while time.monotonic() < deadline:
                    if int(word[0]) == value:
                        seen = True
                        break
                    time.sleep(POLL_S)
                out_q.put((seen, bytes(buf[data_off : data_off + n])))
    finally:
        engine.close()
