"""GPU memory to GPU memory through sgl_pd's transfer layer (Mooncake), on one host.

Two processes, as a prefill rank and a decode rank are: this one owns a source buffer in
GPU memory, a spawned one a destination buffer in GPU memory and a completion word in
host memory. Both register their buffers with a `MooncakeTransferEngine` (TCP on
loopback: the device machine has no RDMA NIC, and Mooncake's TCP transport stages GPU
memory through the host). The writer sends scattered pages with `CompletionWordWriter`
(the writes, then the count word), as a prefill writer does; the receiver waits for the
word, then checks every destination page byte for byte against the pattern.

    python benchmarks/gpu/transfer_gpu.py [--pages 4096] [--page-kib 64]

Prints one JSON line: ok, pages, bytes, gbps (median of the timed repetitions), or
skipped with the reason when there is no CUDA device or no Mooncake.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np

WORD_VALUE = 41
Q_TIMEOUT_S = 120.0


def _receiver(cmd_q: Any, out_q: Any, nbytes: int, page: int, order: list[int]) -> None:
    import torch

    from sgl_pd.transfer import TransportConfig
    from sgl_pd.transfer.mooncake import MooncakeTransferEngine

    engine = MooncakeTransferEngine(TransportConfig(hostname="127.0.0.1"))
    try:
        dst = torch.zeros(nbytes, dtype=torch.uint8, device="cuda")
        word = np.zeros(1, dtype=np.uint64)
        engine.register(dst.data_ptr(), nbytes, location="cuda:0")
        engine.register(int(word.ctypes.data), word.nbytes)
        out_q.put((engine.session_id, dst.data_ptr(), int(word.ctypes.data)))
        while True:
            cmd = cmd_q.get(timeout=600)
            if cmd == "stop":
                return
            deadline = time.monotonic() + 60
            while int(word[0]) != cmd and time.monotonic() < deadline:
                time.sleep(0.0005)
            if int(word[0]) != cmd:
                out_q.put(("word never arrived", None))
                continue
            torch.cuda.synchronize()
            # page i of the source (value i % 251 + 1) landed at destination page order[i]
            got = dst.view(-1, page)[torch.tensor(order, device="cuda")][:, :: page // 16]
            want = (torch.arange(len(order), device="cuda") % 251 + 1).to(torch.uint8)
            ok = bool((got == want[:, None]).all().item())
            out_q.put(("ok" if ok else "bytes differ", None))
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    try:
        import torch

        if not torch.cuda.is_available():
            raise ImportError("torch.cuda.is_available() is False")
        from sgl_pd.transfer import TransportConfig, Writes
        from sgl_pd.transfer.completion import CompletionWordWriter
        from sgl_pd.transfer.mooncake import MooncakeTransferEngine, load_mooncake

        load_mooncake()
    except Exception as e:  # no GPU or no Mooncake here: say so, do not fail the check run
        print(json.dumps({"check": "transfer_gpu", "skipped": f"{type(e).__name__}: {e}"}))
        return 0

    page = args.page_kib * 1024
    nbytes = args.pages * page
    order = np.random.default_rng(0).permutation(args.pages).tolist()  # scattered pages
    ctx = mp.get_context("spawn")
    cmd_q, out_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(cmd_q, out_q, nbytes, page, order), daemon=True)
    proc.start()
    engine = MooncakeTransferEngine(TransportConfig(hostname="127.0.0.1"))
    words = CompletionWordWriter(engine)
    try:
        src = (torch.arange(args.pages, device="cuda") % 251 + 1).to(torch.uint8)
        src = src[:, None].expand(args.pages, page).contiguous().view(-1)  # page i: i % 251 + 1
        engine.register(src.data_ptr(), nbytes, location="cuda:0")
        torch.cuda.synchronize()
        peer, dst_addr, word_addr = out_q.get(timeout=Q_TIMEOUT_S)
        i = np.arange(args.pages, dtype=np.int64)
        writes = Writes.of(src.data_ptr() + i * page, dst_addr + np.asarray(order) * page, page)
        times, verdicts = [], []
        for rep in range(args.reps + 1):  # the first one warms up connections
            value = WORD_VALUE + rep
            t0 = time.perf_counter()
            words.send_many(peer, writes, [(word_addr, value)])
            elapsed = time.perf_counter() - t0
            cmd_q.put(value)
            verdict, _ = out_q.get(timeout=Q_TIMEOUT_S)
            verdicts.append(verdict)
            if rep:
                times.append(elapsed)
        ok = all(v == "ok" for v in verdicts)
        print(
            json.dumps(
                {
                    "check": "transfer_gpu",
                    "ok": ok,
                    "verdicts": sorted(set(verdicts)),
                    "pages": args.pages,
                    "bytes": nbytes,
                    "gbps": round(nbytes / statistics.median(times) / 1e9, 3),
                }
            )
        )
        return 0 if ok else 1
    finally:
        words.close()
        engine.close()
        cmd_q.put("stop")
        proc.join(30)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
