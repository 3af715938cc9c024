"""DeepSeek-V4's and DSA's state components, as planned (`sgl_pd.core.state_components`),
between device buffers of their shapes through sgl_pd's transfer layer (Mooncake).

SGLang's CPU engine runs neither model, so sgl_pd refuses them at start-up; what a lent
GPU can check without SGLang is the part below it: two processes, as a prefill rank and
a decode rank are, each holding every component's buffers in device memory (V4's
unified SWA ring, its C128 pending block, its request rows; DSA's indexer pages, MXFP8
block scales), register them with a `MooncakeTransferEngine` (TCP on loopback), and the
prefill writes each request's named items - the rows and pages each plan names on both
roles, for requests with and without a held prefix, in rows that differ between the
roles - then its count word, as a prefill writer does. The decoder checks every item
byte for byte: the named ones hold the prefill's, every other stays zero.

    python benchmarks/gpu/state_components_gpu.py [--device cuda|cpu]

`--device cpu` runs the same check on host memory (no GPU needed). Prints one JSON line:
ok, components, items moved, bytes; or skipped with the reason (no CUDA, no Mooncake).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from sgl_pd.core.state_components import Geometry, Request, named, writes

WORD_VALUE = 43
Q_TIMEOUT_S = 120.0
BUFFERS = 3  # per component: one per layer (and tensor)
ROWS = 8  # request rows of each role's pools


@dataclass(frozen=True)
class Case:
    """One component's pools (the same shape on both roles) and the requests moved."""

    kind: str
    geometry: Geometry
    items: int  # per buffer
    item_bytes: int
    requests: tuple[tuple[Request, Request], ...]  # (prefill's, decoder's), disjoint items


def cases() -> list[Case]:
    """Shapes from SGLang 0.5.23's pools (``deepseek_v4_memory_pool.py``, the DSA indexer
    pool), scaled down; each request's items differ from the others' on both roles."""
    v4_ring = Geometry(window=128, ring=256)
    return [
        # V4's SWA ring: the last 128 tokens' rows of a 256-row ring per request
        Case("swa_ring", v4_ring, ROWS * 256, 576,
             ((Request(0, 300, 1), Request(0, 300, 6)), (Request(0, 90, 2), Request(0, 90, 3)))),
        # V4's C128 pending block: the ring page holding the open compression block
        Case("dsv4_request_state", Geometry(ratio=128, ring=256), ROWS * 2, 1024,
             ((Request(0, 300, 1), Request(0, 300, 5)), (Request(0, 77, 4), Request(0, 77, 0)))),
        Case("request_row", Geometry(), ROWS, 64,
             ((Request(0, 300, 7), Request(0, 300, 2)),)),
        # DSA's indexer K pages after the held prefix (64-token pages of 132-byte rows)
        Case("dsa", Geometry(page_size=64), 32, 64 * 132,
             ((Request(128, 700, 0), Request(128, 700, 0)),)),
        # MXFP8 block scales beside a hybrid SWA pool's window pages
        Case("block_scale_swa", Geometry(page_size=64, window=256), 32, 64 * 8,
             ((Request(0, 1000, 0), Request(0, 1000, 0)),)),
    ]  # fmt: skip


def _pairs(case: Case) -> list[tuple[int, int]]:
    """(source item, destination item) of every request of `case`, in order."""
    pairs: list[tuple[int, int]] = []
    for prefill, decode in case.requests:
        src = named(case.kind, prefill, case.geometry)
        dst = named(case.kind, decode, case.geometry)
        if not src or len(src) != len(dst):
            raise AssertionError(f"{case.kind}: the roles named {len(src)} and {len(dst)} items")
        pairs.extend(zip(src, dst, strict=True))
    return pairs


def _source(case_index: int, buffer: int, case: Case, device: str) -> Any:
    """The prefill's buffer: seeded bytes, 1..255 (the decoder regenerates them)."""
    import torch

    generator = torch.Generator().manual_seed(1000 * case_index + buffer)
    data = torch.randint(1, 256, (case.items * case.item_bytes,), generator=generator)
    return data.to(torch.uint8).to(device)


def _receiver(cmd_q: Any, out_q: Any, device: str) -> None:
    import numpy as np
    import torch

    from sgl_pd.transfer import TransportConfig
    from sgl_pd.transfer.mooncake import MooncakeTransferEngine

    engine = MooncakeTransferEngine(TransportConfig(hostname="127.0.0.1"))
    try:
        all_cases = cases()
        buffers = [
            [torch.zeros(c.items * c.item_bytes, dtype=torch.uint8, device=device)
             for _ in range(BUFFERS)]
            for c in all_cases
        ]  # fmt: skip
        location = "cuda:0" if device == "cuda" else "cpu:0"
        for per_case in buffers:
            for b in per_case:
                engine.register(b.data_ptr(), b.numel(), location=location)
        word = np.zeros(1, dtype=np.uint64)
        engine.register(int(word.ctypes.data), word.nbytes)
        bases = [[b.data_ptr() for b in per_case] for per_case in buffers]
        out_q.put((engine.session_id, bases, int(word.ctypes.data)))
        cmd = cmd_q.get(timeout=600)
        deadline = time.monotonic() + 60
        while int(word[0]) != cmd and time.monotonic() < deadline:
            time.sleep(0.0005)
        if int(word[0]) != cmd:
            out_q.put({"verdict": "the count word never arrived"})
            return
        if device == "cuda":
            torch.cuda.synchronize()
        wrong: list[str] = []
        for i, (case, per_case) in enumerate(zip(all_cases, buffers, strict=True)):
            moved = dict((d, s) for s, d in _pairs(case))
            for buffer, got in enumerate(per_case):
                rows = got.view(case.items, case.item_bytes).cpu()
                source = _source(i, buffer, case, "cpu").view(case.items, case.item_bytes)
                want = torch.zeros_like(rows)
                for d, s in moved.items():
                    want[d] = source[s]
                if not torch.equal(rows, want):
                    bad = int((rows != want).any(dim=1).sum())
                    wrong.append(f"{case.kind} buffer {buffer}: {bad} items differ")
        out_q.put({"verdict": "ok" if not wrong else "; ".join(wrong)})
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = ap.parse_args()
    try:
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            raise ImportError("torch.cuda.is_available() is False")
        from sgl_pd.transfer import TransportConfig, Writes
        from sgl_pd.transfer.completion import CompletionWordWriter
        from sgl_pd.transfer.mooncake import MooncakeTransferEngine, load_mooncake

        load_mooncake()
    except Exception as e:  # no GPU or no Mooncake here: say so, do not fail the check run
        print(json.dumps({"check": "state_components", "skipped": f"{type(e).__name__}: {e}"}))
        return 0

    ctx = mp.get_context("spawn")
    cmd_q, out_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_receiver, args=(cmd_q, out_q, args.device), daemon=True)
    proc.start()
    engine = MooncakeTransferEngine(TransportConfig(hostname="127.0.0.1"))
    words = CompletionWordWriter(engine)
    try:
        all_cases = cases()
        location = "cuda:0" if args.device == "cuda" else "cpu:0"
        sources = []
        for i, case in enumerate(all_cases):
            per_case = [_source(i, b, case, args.device) for b in range(BUFFERS)]
            for b in per_case:
                engine.register(b.data_ptr(), b.numel(), location=location)
            sources.append(per_case)
        if args.device == "cuda":
            torch.cuda.synchronize()
        peer, dst_bases, word_addr = out_q.get(timeout=Q_TIMEOUT_S)
        planned: list[tuple[int, int, int]] = []
        items = 0
        for case, per_case, bases in zip(all_cases, sources, dst_bases, strict=True):
            pairs = _pairs(case)
            items += len(pairs) * BUFFERS
            planned += writes(
                [b.data_ptr() for b in per_case], bases, [case.item_bytes] * BUFFERS,
                [s for s, _ in pairs], [d for _, d in pairs],
            )  # fmt: skip
        batch = Writes.of(*zip(*planned, strict=True))
        words.send_many(peer, batch, [(word_addr, WORD_VALUE)])
        cmd_q.put(WORD_VALUE)
        verdict = out_q.get(timeout=Q_TIMEOUT_S)["verdict"]
        ok = verdict == "ok"
        print(
            json.dumps(
                {
                    "check": "state_components",
                    "device": args.device,
                    "ok": ok,
                    "verdict": verdict,
                    "components": sorted({c.kind for c in all_cases}),
                    "items": items,
                    "bytes": batch.total_bytes,
                }
            )
        )
        return 0 if ok else 1
    finally:
        words.close()
        engine.close()
        proc.join(30)
        if proc.is_alive():
            proc.kill()


if __name__ == "__main__":
    sys.exit(main())
