"""Sharded pairings side by side: exposed KV transfer, bytes and writes per request per
rank for TP1 -> TP1, TP2 -> TP2, TP2 -> TP1 and TP1 -> TP2 on the bundled tiny Llama, the
mismatched pairings with re-layout (the default) and without (--pd-staging-mb 0).

A monolithic TP1 server answers a set of prompts first (the greedy reference); then one
mesh holds a TP1 and a TP2 prefill server (both streaming layer by layer) and a TP1 and a
TP2 decode server, with one SGLang router per pairing (`sgl_pd.cluster.mesh`). Each
pairing answers the reference prompts (tokens compared), then fresh prompts of 512 and
2k tokens (one prefill chunk each, no prefix cache) go to the pairings in turn, the order
rotating every repetition so all see the same machine. From the prefill ranks' own
timing lines (time.monotonic, shared by all processes of this machine):

    exposed transfer = last rank's transfer done - last rank's forward end

the part of the transfer the forward did not hide, as bench_layerwise.py and
bench_vs_upstream.py take it, plus, re-laid out into a TP1 decoder, the decoder's
scatter before the request decodes (its own log line); bytes and writes are per prefill
rank and request (the busiest rank; KV plus the metadata row, completion words not
counted). The mesh also holds a TP1 prefill and a TP1 decode server without staging, so
the mismatched pairings run both ways in the same rotation.

    python benchmarks/bench_sharded.py [--quick] [--out benchmarks/out]

Prints a table, writes a PNG plot, and ends with one JSON line. Nine scheduler processes
share this machine's cores: the prefill servers one block, the decoders the other.
"""

from __future__ import annotations

import argparse
import itertools
import json
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from sgl_pd.backend.decode.staging_grants import SCATTER_LINE_PREFIX
from sgl_pd.cluster.client import generate_ids
from sgl_pd.cluster.load import plot_grouped_bars
from sgl_pd.cluster.local import Patience, Server, local_patience, monolithic_server
from sgl_pd.cluster.logs import timing_lines
from sgl_pd.cluster.mesh import MeshServer, PdMesh, pd_mesh
from sgl_pd.cluster.prompts import long_prompt_ids, varied_prompts

SERVER_ARGS = (
    "--chunked-prefill-size", "16384",  # one chunk per prompt: the forward is one pass
    "--max-prefill-tokens", "16384",
    # a cached prefix would be sent before the forward: every prompt is computed whole
    "--disable-radix-cache",
    "--log-level", "info",
    "--pd-hang-timeout", "30",  # seven busy processes on two cores answer late
)  # fmt: skip
PAIRINGS = {  # name -> (prefill server, decode server)
    "tp1_tp1": ("p_tp1", "d_tp1"),
    "tp2_tp2": ("p_tp2", "d_tp2"),
    "tp2_tp1": ("p_tp2", "d_tp1"),
    "tp1_tp2": ("p_tp1", "d_tp2"),
    # the same mismatched pairings one token slot a write: the side that would stage has
    # no staging area (TP2 -> TP1: the decoder receives, TP1 -> TP2: the prefill gathers)
    "tp2_tp1_per_slot": ("p_tp2", "d_tp1_off"),
    "tp1_tp2_per_slot": ("p_tp1_off", "d_tp2"),
}
# pairings whose decoder scatters received blocks before the request decodes
SCATTERS = {"tp2_tp1"}
LABELS = {
    name: name.replace("_per_slot", "").replace("_", " -> ").upper()
    + (" per slot" if name.endswith("per_slot") else "")
    for name in PAIRINGS
}
REFERENCE_PROMPTS = varied_prompts(8, seed=47)
NEW_TOKENS = 8


@dataclass(frozen=True)
class Sample:
    pairing: str
    tokens: int
    exposed_ms: float
    bytes_per_rank: int  # the busiest prefill rank's
    writes_per_rank: int


def mesh_servers() -> list[MeshServer]:
    layerwise = (*SERVER_ARGS, "--pd-kv-send", "layerwise")
    return [
        MeshServer("p_tp1", "prefill", (*layerwise, "--tp", "1")),
        MeshServer("p_tp2", "prefill", (*layerwise, "--tp", "2")),
        MeshServer("d_tp1", "decode", (*SERVER_ARGS, "--tp", "1")),
        MeshServer("d_tp2", "decode", (*SERVER_ARGS, "--tp", "2")),
        MeshServer("p_tp1_off", "prefill", (*layerwise, "--tp", "1", "--pd-staging-mb", "0")),
        MeshServer("d_tp1_off", "decode", (*SERVER_ARGS, "--tp", "1", "--pd-staging-mb", "0")),
    ]


def reference_tokens(log_dir: Path, patience: Patience) -> list[list[int]]:
    with monolithic_server(log_dir, extra=SERVER_ARGS[:-2], patience=patience) as server:
        return answers(server.url)


def answers(url: str) -> list[list[int]]:
    return [generate_ids(url, p, NEW_TOKENS) for p in REFERENCE_PROMPTS]


def sample_once(mesh: PdMesh, pairing: str, tokens: int, start: int, patience: Patience) -> Sample:
    """One fresh prompt through `pairing`; the timing line of each of its prefill ranks."""
    prefill_name, decode_name = PAIRINGS[pairing]
    prefill: Server = mesh.servers[prefill_name]
    ranks = 2 if prefill_name == "p_tp2" else 1
    log = prefill.process.log_path
    seen = len(timing_lines(log))
    generate_ids(mesh.router(prefill_name, decode_name), long_prompt_ids(tokens, start), 1)
    deadline = time.monotonic() + patience.seconds(30.0)
    while len(lines := timing_lines(log)) < seen + ranks:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{pairing}: {len(lines) - seen} of {ranks} timing lines ({log})")
        time.sleep(0.05)
    mine = lines[seen:]
    if len(mine) != ranks or len({line["room"] for line in mine}) != 1:
        raise RuntimeError(f"{pairing}: timing lines of other requests in {log}: {mine}")
    done = max(float(line["done"]) for line in mine)
    forward_end = max(float(line["forward_end"]) for line in mine)
    room = int(mine[0]["room"])
    return Sample(
        pairing,
        tokens,
        (done - forward_end) * 1e3
        + (_scatter_ms(mesh.servers[decode_name], room, patience) if pairing in SCATTERS else 0),
        max(int(line["bytes"]) for line in mine),
        max(int(line["writes"]) for line in mine),
    )


def _scatter_ms(decoder: Server, room: int, patience: Patience) -> float:
    """The TP1 decoder's scatter of one re-laid-out request (its own log line)."""
    deadline = time.monotonic() + patience.seconds(10.0)
    while time.monotonic() < deadline:
        times = [
            float(ms)
            for line in decoder.process.log_path.read_text(errors="replace").splitlines()
            if SCATTER_LINE_PREFIX in line and f"room={room} " in line
            for ms in re.findall(r"ms=(\S+)", line)
        ]
        if times:
            return max(times)
        time.sleep(0.05)
    raise RuntimeError(f"no scatter line for request {room} in {decoder.process.log_path}")


def run(mesh: PdMesh, sizes: list[int], reps: int, patience: Patience) -> list[Sample]:
    samples = []
    names = list(PAIRINGS)
    starts = itertools.count(1000, 7919)  # a fresh prompt every time (no prefix in common)
    for tokens in sizes:
        for name in names:
            sample_once(mesh, name, tokens, next(starts), patience)  # warm-up, not kept
        for rep in range(reps):
            order = names[rep % len(names) :] + names[: rep % len(names)]
            for name in order:
                sample = sample_once(mesh, name, tokens, next(starts), patience)
                samples.append(sample)
                print(
                    f"  {LABELS[name]:12s} {tokens:5d} tokens rep {rep + 1}/{reps}: exposed "
                    f"{sample.exposed_ms:7.2f} ms, {sample.writes_per_rank} writes / "
                    f"{sample.bytes_per_rank} bytes on the busiest rank",
                    flush=True,
                )
    return samples


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 repetitions instead of 5")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    sizes, reps = [512, 2048], (2 if args.quick else 5)
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_sharded_"))
    patience = local_patience()
    print(
        f"[bench] pairings {list(LABELS.values())}, prompts {sizes}, {reps} reps; logs in {log_dir}"
    )

    print("[bench] monolithic TP1 reference ...", flush=True)
    reference = reference_tokens(log_dir / "mono", patience)
    print("[bench] starting the mesh (3 prefill + 3 decode servers, 6 routers) ...", flush=True)
    with pd_mesh(
        log_dir / "mesh", mesh_servers(), list(PAIRINGS.values()), patience=patience
    ) as mesh:
        identical = {
            name: answers(mesh.router(*route)) == reference for name, route in PAIRINGS.items()
        }
        print(f"[bench] greedy tokens equal to monolithic TP1: {identical}", flush=True)
        samples = run(mesh, sizes, reps, patience)

    rows: dict[tuple[str, int], dict[str, float]] = {}
    for name in PAIRINGS:
        for n in sizes:
            mine = [s for s in samples if s.pairing == name and s.tokens == n]
            rows[(name, n)] = {
                "exposed_ms": statistics.median(s.exposed_ms for s in mine),
                "bytes": statistics.median(s.bytes_per_rank for s in mine),
                "writes": statistics.median(s.writes_per_rank for s in mine),
            }
    print("\nmedians; exposed = last prefill rank's transfer done - its forward end")
    print(f"{'pairing':12s} {'tokens':>6s} {'exposed ms':>10s} {'writes/rank':>12s} "
          f"{'KV bytes/rank':>14s} {'tokens ok':>9s}")  # fmt: skip
    for name in PAIRINGS:
        for n in sizes:
            row = rows[(name, n)]
            print(
                f"{LABELS[name]:12s} {n:6d} {row['exposed_ms']:10.2f} {row['writes']:12.0f} "
                f"{row['bytes']:14.0f} {identical[name]!s:>9s}"
            )
    png = args.out / "sharded.png"
    plot_grouped_bars(
        {LABELS[name]: [rows[(name, n)]["exposed_ms"] for n in sizes] for name in PAIRINGS},
        sizes,
        png,
        ylabel="exposed transfer, ms (median)",
        title="Forward end to KV + metadata on the decoder, by TP pairing (CPU, TCP)",
        log_scale=True,  # identical TP is milliseconds, mismatched hundreds
    )
    print(f"\nplot: {png}")
    largest = sizes[-1]
    print(
        json.dumps(
            {
                "prompt_tokens": largest,
                "pairings_run": len({s.pairing for s in samples}),
                "tokens_identical": sum(identical.values()),
                **{
                    f"exposed_ms_{name}": round(rows[(name, largest)]["exposed_ms"], 2)
                    for name in ("tp1_tp1", "tp2_tp2", "tp2_tp1", "tp1_tp2")
                },
                **{
                    f"exposed_ms_{name}_per_slot": round(
                        rows[(f"{name}_per_slot", largest)]["exposed_ms"], 2
                    )
                    for name in ("tp2_tp1", "tp1_tp2")
                },
                "writes_per_request_tp2_tp1": rows[("tp2_tp1", largest)]["writes"],
                "writes_per_request_tp2_tp1_per_slot": rows[("tp2_tp1_per_slot", largest)][
                    "writes"
                ],
                "writes_per_request_tp1_tp1": rows[("tp1_tp1", largest)]["writes"],
                "relayout_exposed_speedup_tp2_tp1": round(
                    rows[("tp2_tp1_per_slot", largest)]["exposed_ms"]
                    / rows[("tp2_tp1", largest)]["exposed_ms"],
                    1,
                ),
                "relayout_exposed_speedup_tp1_tp2": round(
                    rows[("tp1_tp2_per_slot", largest)]["exposed_ms"]
                    / rows[("tp1_tp2", largest)]["exposed_ms"],
                    1,
                ),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
