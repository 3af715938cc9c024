"""Hostile-input campaign against a real PD pair: every listener it opens gets frames from
processes without the cluster secret, then from a member that holds it.

Starts a prefill + decode + router cluster (`pd_cluster`, its defaults), records the greedy
tokens of a few real requests through the router, then:

a. strangers: random bytes, damaged and valid frames of every message type, over raw TCP,
   plain ZMQ and CURVE sockets with another cluster's key, at the registry (bootstrap
   port), the prefill rank's inbox and the decode rank's inbox: nothing may come back;
b. a hostile member: hypothesis-drawn frames with valid headers and hostile bodies (forged
   aborts, errors, chunk notices and drain acks, out-of-range transfer requests, giant
   and escape-filled strings, forged registrations, random bodies), while real requests
   with known ids run; then heartbeats naming thousands of endpoints, and frames over the
   size limits;
c. after each phase and at the end: both /health answer 200, every server process runs,
   the same requests give the same tokens, and the logs grew within the rate limits;
d. the cost of authentication: frames/s from a `Link` to an `Inbox` on loopback with and
   without CURVE, interleaved.

    python benchmarks/bench_hostile.py [--quick]

Prints a table and ends with one JSON line: frames_sent, server_crashes, health_failures,
output_changed, auth_overhead_us_per_frame, ... SGLPD_LOCAL_PATIENCE scales every wait.
"""

from __future__ import annotations

import argparse
import json
import queue
import sys
import tempfile
import time
from pathlib import Path

from tqdm import tqdm

from sgl_pd.cluster import hostile
from sgl_pd.cluster.client import generate_ids
from sgl_pd.cluster.local import HOST, local_patience, pd_cluster
from sgl_pd.cluster.prompts import prompt_ids, varied_prompts
from sgl_pd.core.layout import KvLayout, PageLayout
from sgl_pd.core.regions import Region
from sgl_pd.core.sharding import ShardingScheme
from sgl_pd.core.wire import (
    ChunkNotice,
    FrameCodec,
    Message,
    MetadataBuffers,
    Role,
    ShardRegistration,
    SlotArea,
    TransferRequest,
)
from sgl_pd.messenger.auth import ClusterAuth
from sgl_pd.messenger.inbox import Inbox
from sgl_pd.messenger.link import Link

MAX_NEW_TOKENS = 8
PROMPTS = 4
# Rate-limited logging: a few lines per kind of complaint per 10 s, whatever the volume.
LOG_LINES_ALLOWED = 200  # plus LOG_LINES_PER_S for every second of the campaign
LOG_LINES_PER_S = 5.0


# -- d. the cost of authentication ---------------------------------------------------------

_LAYOUT = KvLayout.gqa(
    num_layers=2, num_kv_heads=2, head_dim=8, page_size=1, elem_bytes=2, page_layout=PageLayout.NHD
)
_HASH = _LAYOUT.compat_hash()


def _overhead_messages() -> dict[str, Message]:
    """A chunk notice (~80 B) and a transfer request of about 64 KiB."""
    pages = 1 << 20
    decoder = ShardRegistration(
        role=Role.DECODE,
        rank=0,
        scheme=ShardingScheme(1),
        session="127.0.0.1:1",
        inbox="tcp://127.0.0.1:1",
        instance=1,
        layout=_LAYOUT,
        num_pages=pages,
        kv_regions=tuple(Region(4096 * (i + 1), 4096) for i in range(_LAYOUT.num_regions)),
        layer_group_size=1,
        metadata=MetadataBuffers(regions=(Region(1 << 24, 4096),), row_bytes=(64,), rows=64),
        completion=SlotArea(region=Region(1 << 30, 1 << 20), slot_bytes=64, num_slots=64),
    )
    chunk = ChunkNotice(
        request_id=7,
        chunk_index=0,
        token_start=0,
        token_stop=128,
        page_ids=tuple(range(8)),
        is_last=True,
        num_chunks=1,
        prefill_instance=3,
    )
    # 5 msgpack bytes per page id >= 2**16: 13k ids are about 64 KiB
    transfer = TransferRequest(
        request_id=7,
        decoder=decoder,
        dst_pages=tuple(range(1 << 16, (1 << 16) + 13_000)),
        metadata_slot=0,
        completion_slot=0,
    )
    return {"chunk_notice": chunk, "transfer_64k": transfer}


class _Pair:
    """An inbox and a link to it, with or without authentication."""

    def __init__(self, auth: ClusterAuth | None) -> None:
        self.got: queue.SimpleQueue[None] = queue.SimpleQueue()
        self.inbox = Inbox(
            HOST, FrameCodec(_HASH), lambda m: self.got.put(None), "bench", auth=auth
        )
        self.link = Link(self.inbox.endpoint, FrameCodec(_HASH), auth=auth, send_timeout_s=10.0)

    def rate(self, message: Message, frames: int, window: int = 200) -> float:
        """Frames/s delivered to the handler, `window` frames in flight at most."""
        start = time.perf_counter()
        sent = 0
        while sent < frames:
            n = min(window, frames - sent)
            for _ in range(n):
                self.link.send(message)
            for _ in range(n):
                self.got.get(timeout=30)
            sent += n
        return frames / (time.perf_counter() - start)

    def close(self) -> None:
        self.link.close()
        self.inbox.close()


def auth_overhead(reps: int, frames: int) -> dict[str, dict[str, float]]:
    """Per message: frames/s without and with CURVE (median of interleaved reps), and the
    difference in microseconds per frame."""
    member = ClusterAuth.from_secret(b"the benchmark's own secret, 32+ bytes")
    pairs = {"plain": _Pair(None), "auth": _Pair(member)}
    out: dict[str, dict[str, float]] = {}
    try:
        for name, message in _overhead_messages().items():
            for pair in pairs.values():
                pair.rate(message, 200)  # connect and warm up
            rates: dict[str, list[float]] = {"plain": [], "auth": []}
            for rep in range(reps):
                order = ["plain", "auth"] if rep % 2 == 0 else ["auth", "plain"]
                for mode in order:
                    rates[mode].append(pairs[mode].rate(message, frames))
            plain, auth = (sorted(rates[m])[len(rates[m]) // 2] for m in ("plain", "auth"))
            out[name] = {
                "plain_frames_per_s": round(plain),
                "auth_frames_per_s": round(auth),
                "us_per_frame": round(1e6 / auth - 1e6 / plain, 2),
            }
    finally:
        for pair in pairs.values():
            pair.close()
    return out


# -- the campaign ----------------------------------------------------------------------------


def _log_lines(paths: list[Path]) -> dict[str, int]:
    return {p.name: len(p.read_text(errors="replace").splitlines()) for p in paths}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few thousand frames")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="a folder for summary.json (the last line)")
    args = parser.parse_args(argv)
    quick = args.quick
    stranger_frames = 400 if quick else 3000  # per listener
    member_frames = 2000 if quick else 20_000
    flood = 1500 if quick else hostile.HEARTBEAT_ENDPOINTS  # senders, per inbox
    settle_s = 5.0 if quick else 40.0
    patience = local_patience()
    wait_s = patience.seconds(30.0)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_hostile_"))
    print(f"[bench] hostile campaign ({'quick' if quick else 'full'}); logs in {log_dir}")
    prompts = [prompt_ids(p) for p in varied_prompts(PROMPTS, seed=11)]
    started = time.monotonic()
    with pd_cluster(log_dir) as cluster:
        print(f"[bench] cluster up in {time.monotonic() - started:.0f} s")
        expected = [generate_ids(cluster.router_url, p, MAX_NEW_TOKENS) for p in prompts]
        targets, witness = hostile.find_targets(cluster, log_dir, wait_s)
        print("[bench] listeners: " + ", ".join(f"{k} {v}" for k, v in targets.endpoints().items()))
        pids = {"prefill": hostile.process_tree(cluster.prefill),
                "decode": hostile.process_tree(cluster.decode)}  # fmt: skip
        logs = [log_dir / "prefill.log", log_dir / "decode.log"]
        sizes0, lines0 = hostile.log_sizes(logs), _log_lines(logs)
        campaign_started = time.monotonic()

        def check(phase: str) -> hostile.Checked:
            result = hostile.check_cluster(
                cluster, pids, prompts, expected, max_new_tokens=MAX_NEW_TOKENS, timeout_s=wait_s
            )
            status = "ok" if not (result.notes) else "; ".join(result.notes[:5])
            print(f"[bench] check after {phase}: {status}")
            return result

        checks = hostile.Checked()
        tallies: dict[str, hostile.Tally] = {}
        try:
            total = 3 * stranger_frames
            with tqdm(total=total, desc="a. strangers", unit="frame") as bar:
                tallies["strangers"] = hostile.run_strangers(
                    targets, witness, stranger_frames, quiet_s=1.0, seed=args.seed,
                    progress=bar.update,
                )  # fmt: skip
            checks.add(check("strangers"))

            rooms = hostile.RealRooms()
            campaign = hostile.Campaign.create(targets, witness.endpoint, rooms)
            live = hostile.LiveTraffic(
                cluster, prompts, expected, rooms, max_new_tokens=MAX_NEW_TOKENS,
                timeout_s=patience.seconds(300.0), seed=args.seed,
            )  # fmt: skip
            member = hostile.MemberSockets(targets)
            witnessed = witness.received()
            try:
                with tqdm(total=member_frames, desc="b. member", unit="frame") as bar:
                    tallies["member"] = hostile.run_member(
                        campaign, member, member_frames, seed=args.seed, progress=bar.update
                    )
                with tqdm(total=2 * flood, desc="b. heartbeat flood", unit="frame") as bar:
                    tallies["heartbeat_flood"] = hostile.heartbeat_flood(
                        targets, member, flood, bar.update
                    )
                tallies["oversized"] = hostile.send_oversized(targets)
            finally:
                member.close()
                live_result = live.stop(patience.seconds(300.0))
            checks.add(check("member"))
            time.sleep(settle_s)
            checks.add(check(f"a {settle_s:.0f} s pause"))
            campaign_s = time.monotonic() - campaign_started
            answers_to_member = witness.received() - witnessed
            witness_types = witness.by_type()
        finally:
            witness.close()
        sizes1, lines1 = hostile.log_sizes(logs), _log_lines(logs)
        findings = hostile.log_findings(logs)

    overhead = auth_overhead(reps=5 if quick else 11, frames=2000 if quick else 5000)

    frames_sent = sum(t.frames_sent for t in tallies.values())
    print(f"\n{'phase':18s} {'frames':>8s} {'registry':>9s} {'prefill':>8s} {'decode':>8s}"
          f" {'answers':>8s} {'dropped':>8s}")  # fmt: skip
    for name, t in tallies.items():
        answers = t.answers if name == "strangers" else ""
        print(f"{name:18s} {t.frames_sent:8d} {t.per_target['registry']:9d}"
              f" {t.per_target['prefill_inbox']:8d} {t.per_target['decode_inbox']:8d}"
              f" {answers!s:>8s} {t.dropped:8d}")  # fmt: skip
    print(f"\nregistry answers to the member: {dict(member.registry_answers)}")
    print(f"witness inbox received {answers_to_member} during the member phase: {witness_types}")
    print(f"live requests with forged traffic: {live_result.requests} "
          f"({live_result.changed} changed, {live_result.failed} failed)")  # fmt: skip
    allowed = LOG_LINES_ALLOWED + LOG_LINES_PER_S * campaign_s
    print(f"\n{'log':12s} {'bytes before':>12s} {'bytes after':>12s} {'lines added':>12s}")
    growth = {}
    for p in logs:
        growth[p.name] = lines1[p.name] - lines0[p.name]
        print(f"{p.name:12s} {sizes0[p.name]:12d} {sizes1[p.name]:12d} {growth[p.name]:12d}")
    print(f"allowed: {allowed:.0f} lines per log in {campaign_s:.0f} s; findings: {findings}")
    print(f"\n{'auth overhead':14s} {'plain f/s':>10s} {'auth f/s':>10s} {'us/frame':>9s}")
    for name, o in overhead.items():
        print(f"{name:14s} {o['plain_frames_per_s']:10.0f} {o['auth_frames_per_s']:10.0f}"
              f" {o['us_per_frame']:9.2f}")  # fmt: skip
    for note in checks.notes:
        print(f"  problem: {note}")
    summary = {
        "frames_sent": frames_sent,
        "server_crashes": checks.server_crashes,
        "health_failures": checks.health_failures,
        "output_changed": checks.output_changed,
        "auth_overhead_us_per_frame": {k: v["us_per_frame"] for k, v in overhead.items()},
        "auth_frames_per_s": {
            k: [v["plain_frames_per_s"], v["auth_frames_per_s"]] for k, v in overhead.items()
        },
        "unauthenticated_answers": tallies["strangers"].answers,
        "request_failures": checks.request_failures,
        "live_requests": live_result.requests,
        "live_output_changed": live_result.changed + live_result.failed,
        "log_lines_added": growth,
        "log_bytes": {p.name: sizes1[p.name] for p in logs},
        "log_bound_exceeded": any(g > allowed for g in growth.values()),
        "log_tracebacks": findings["tracebacks"],
        "log_injected_lines": findings["injected_lines"],
        "campaign_s": round(campaign_s, 1),
    }
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
