"""sgl_pd against SGLang's own Mooncake PD, side by side: TTFT and exposed transfer time.

Starts three PD deployments of the bundled tiny Llama on this machine, side by side, each
a prefill server, a decode server (pinned to one core each) and SGLang's router:

- upstream: SGLang 0.5.23's Mooncake backend (`benchmarks/upstream_baseline/`: a patched
  private copy of SGLang, sgl_pd's plugin kept out), over Mooncake TCP;
- sgl_pd, layer-wise streaming (the default) and sgl_pd, sending after the forward.

For prompts of 512, 2k and 8k tokens, fresh for every request (nothing cached), the same
prompt goes to each deployment in turn (the order rotates), and for each request:

- TTFT through the router (streamed);
- the exposed transfer time: from the end of the prefill forward that computed the
  prompt's last chunk to the moment the decode server's transfer queue hands the request
  on with its KV and metadata complete. Both stamps come from the servers themselves,
  through the same read-only SGLang hooks for every backend (`sgl_pd/observe.py`,
  loaded alone into the upstream servers); they only log, so the measurement does not
  change what it measures.

    python benchmarks/bench_vs_upstream.py [--quick] [--out benchmarks/out]

Prints a table, writes a PNG plot, and ends with one JSON line: prompt_tokens (largest),
ttft_ms_ours / exposed_ms_ours (layer-wise), ttft_ms_upstream, exposed_ms_upstream,
ratio_exposed_upstream_over_ours (medians at the largest size).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from sgl_pd.cluster.client import stream_generate
from sgl_pd.cluster.load import plot_grouped_bars
from sgl_pd.cluster.local import (
    Patience,
    local_patience,
    pd_cluster,
    place_servers,
    router_argv,
    serving_pd,
)
from sgl_pd.cluster.processes import ManagedProcess, free_ports
from sgl_pd.cluster.prompts import long_prompt_ids
from sgl_pd.observe import OBSERVE_ENV, read_stamps

sys.path.insert(0, str(Path(__file__).resolve().parent / "upstream_baseline"))
import run_upstream_pd as upstream

SYSTEMS = ("upstream", "layerwise", "after-forward")
SERVER_ARGS = [
    "--chunked-prefill-size", "8192",  # one chunk per prompt
    "--max-prefill-tokens", "16384",
    "--disable-radix-cache",  # every prompt computed whole
    "--log-level", "info",  # the observer's lines
]  # fmt: skip


@dataclass(frozen=True)
class Endpoint:
    url: str
    prefill_log: Path
    decode_log: Path


@dataclass(frozen=True)
class Sample:
    system: str
    tokens: int
    ttft_ms: float
    exposed_ms: float


def _placed(process: ManagedProcess, cpus: int) -> ManagedProcess:
    placement = place_servers(2)[cpus]
    process.argv = placement.wrap(process.argv)
    process.env.update(placement.env())
    return process


@contextlib.contextmanager
def upstream_cluster(log_dir: Path, copy_root: Path, patience: Patience) -> Iterator[Endpoint]:
    """SGLang's own PD pair and router, the way `run_upstream_pd.py` starts them, with
    only the observer plugin loaded."""
    prefill_port, decode_port, bootstrap_port, router_port, metrics_port = free_ports(5)
    transfer = ["--disaggregation-transfer-backend", "mooncake_tcp"]
    prefill_args = [
        "--disaggregation-mode", "prefill",
        "--disaggregation-bootstrap-port", str(bootstrap_port),
        *transfer, *SERVER_ARGS,
    ]  # fmt: skip
    decode_args = ["--disaggregation-mode", "decode", *transfer, *SERVER_ARGS]
    prefill = _placed(upstream.server("prefill", copy_root, prefill_port, prefill_args, log_dir), 0)
    decode = _placed(upstream.server("decode", copy_root, decode_port, decode_args, log_dir), 1)
    for process in (prefill, decode):
        process.env["SGLANG_PLUGINS"] = "sgl_pd_observe"  # the observer alone
    urls = f"http://127.0.0.1:{prefill_port}", f"http://127.0.0.1:{decode_port}"
    router_url = f"http://127.0.0.1:{router_port}"
    router = ManagedProcess(
        "router",
        router_argv(router_port, metrics_port, urls[0], bootstrap_port, urls[1], patience=patience),
        log_dir / "router.log",
    )
    with serving_pd(prefill, urls[0], decode, urls[1], router, router_url, patience=patience):
        yield Endpoint(router_url, prefill.log_path, decode.log_path)


@contextlib.contextmanager
def deployments(log_dir: Path, patience: Patience) -> Iterator[dict[str, Endpoint]]:
    os.environ[OBSERVE_ENV] = "1"  # every server started below logs its stamps
    with contextlib.ExitStack() as stack:
        copy_root = upstream.patched_copy(log_dir / "upstream-site")
        stack.callback(shutil.rmtree, log_dir / "upstream-site", True)
        endpoints = {
            "upstream": stack.enter_context(
                upstream_cluster(log_dir / "upstream", copy_root, patience)
            )
        }
        for mode in ("layerwise", "after-forward"):
            cluster = stack.enter_context(
                pd_cluster(
                    log_dir / mode,
                    prefill_extra=[*SERVER_ARGS, "--pd-kv-send", mode],
                    decode_extra=SERVER_ARGS,
                    patience=patience,
                )
            )
            endpoints[mode] = Endpoint(
                cluster.router_url,
                cluster.prefill.process.log_path,
                cluster.decode.process.log_path,
            )
        yield endpoints


def sample_once(
    system: str, endpoint: Endpoint, tokens: int, seed: int, patience: Patience
) -> Sample:
    """One fresh prompt; its TTFT and, from the two servers' stamps, its exposed transfer."""
    seen_prefill = len(read_stamps(endpoint.prefill_log))
    seen_decode = len(read_stamps(endpoint.decode_log))
    ids = long_prompt_ids(tokens, seed)
    start = time.perf_counter()
    arrivals = [
        at
        for at, _ in stream_generate(endpoint.url, ids, 2, patience.seconds(600.0), ignore_eos=True)
    ]
    ttft = (arrivals[0] - start) * 1e3
    deadline = time.monotonic() + patience.seconds(30.0)
    while True:
        ends = {s.room: s.t for s in read_stamps(endpoint.prefill_log)[seen_prefill:]}
        done = {s.room: s.t for s in read_stamps(endpoint.decode_log)[seen_decode:]}
        both = set(ends) & set(done)
        if both:
            break
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"{system}: no matching observer stamps for the request "
                f"({endpoint.prefill_log}, {endpoint.decode_log})"
            )
        time.sleep(0.05)
    if len(both) != 1:
        raise RuntimeError(f"{system}: stamps of {len(both)} requests for one request")
    (room,) = both
    return Sample(system, tokens, ttft, (done[room] - ends[room]) * 1e3)


LABELS = {
    "upstream": "SGLang Mooncake PD",
    "layerwise": "sgl_pd layer-wise",
    "after-forward": "sgl_pd after-forward",
}


def plot(rows: dict[tuple[str, int], dict[str, float]], sizes: list[int], path: Path) -> None:
    plot_grouped_bars(
        {LABELS[s]: [rows[(s, n)]["exposed_ms"] for n in sizes] for s in SYSTEMS},
        sizes,
        path,
        ylabel="exposed transfer, ms (median)",
        title="Forward end to KV + metadata complete on the decoder (CPU, TCP)",
        log_scale=True,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="512 and 2k tokens, 2 repetitions")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = parser.parse_args(argv)
    sizes = [512, 2048] if args.quick else [512, 2048, 8192]
    reps = 2 if args.quick else 5
    args.out.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="bench_vs_upstream_"))
    print(f"[bench] prompts {sizes}, {reps} reps; logs in {log_dir}", flush=True)
    patience = local_patience()
    samples: list[Sample] = []
    started = time.monotonic()
    with deployments(log_dir, patience) as endpoints:
        print(f"[bench] deployments up in {time.monotonic() - started:.0f} s", flush=True)
        for tokens in sizes:
            for system in SYSTEMS:
                sample_once(system, endpoints[system], tokens, 1, patience)  # warm-up
            for rep in range(reps):
                order = SYSTEMS[rep % 3 :] + SYSTEMS[: rep % 3]
                for system in order:
                    seed = 1000 * (rep + 2) + tokens
                    s = sample_once(system, endpoints[system], tokens, seed, patience)
                    samples.append(s)
                    print(
                        f"  {system:13s} {tokens:6d} tokens  rep {rep + 1}/{reps}: TTFT "
                        f"{s.ttft_ms:8.1f} ms  exposed {s.exposed_ms:8.2f} ms",
                        flush=True,
                    )

    rows = {
        (system, n): {
            field: statistics.median(
                getattr(s, field) for s in samples if s.system == system and s.tokens == n
            )
            for field in ("ttft_ms", "exposed_ms")
        }
        for system in SYSTEMS
        for n in sizes
    }
    print("\nmedians; exposed = prefill forward end -> decoder holds KV and metadata")
    print(f"{'tokens':>6}  " + "  ".join(f"{s + ' TTFT':>20} {'exposed':>9}" for s in SYSTEMS))
    for n in sizes:
        print(
            f"{n:>6}  "
            + "  ".join(
                f"{rows[(s, n)]['ttft_ms']:>20.1f} {rows[(s, n)]['exposed_ms']:>9.2f}"
                for s in SYSTEMS
            )
        )
    png = args.out / "vs_upstream.png"
    plot(rows, sizes, png)
    print(f"plot: {png}")
    largest = sizes[-1]
    ours, theirs = rows[("layerwise", largest)], rows[("upstream", largest)]
    print(
        json.dumps(
            {
                "prompt_tokens": largest,
                "ttft_ms_ours": round(ours["ttft_ms"], 1),
                "ttft_ms_upstream": round(theirs["ttft_ms"], 1),
                "exposed_ms_ours": round(ours["exposed_ms"], 2),
                "exposed_ms_upstream": round(theirs["exposed_ms"], 2),
                "ratio_exposed_upstream_over_ours": round(
                    theirs["exposed_ms"] / max(ours["exposed_ms"], 1e-3), 2
                ),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
