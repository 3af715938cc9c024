"""The main job on this machine: a local prefiller + decoder + router serving the
bundled model, a few requests answered, with their time to first token and the KV bytes
the prefiller moved.

    python -m sgl_pd.demo                 # disaggregated: prefill + decode + router
    python -m sgl_pd.demo --direct        # one prefill feeding two decoders, no router:
                                          # clients talk to the decoders (D3)
    python -m sgl_pd.demo --monolithic    # one ordinary SGLang server, for comparison
"""

from __future__ import annotations

import argparse
import re
import sys
import tempfile
import time
from pathlib import Path

import requests

from sgl_pd.cluster.client import complete, stream_chat
from sgl_pd.cluster.local import direct_cluster, monolithic_server, pd_cluster
from sgl_pd.cluster.processes import ServerStartError

CHAT_PROMPTS = ["What is 3 + 4?", "Count from 12.", "Name the days of the week."]
TEXT_PROMPT = "Count: 41 42 43"


def transfer_bytes(metrics_text: str) -> float | None:
    """``sgl_pd_transfer_bytes_total`` summed over roles, from a /metrics page."""
    values = re.findall(r"^sgl_pd_transfer_bytes_total\{[^}]*\} ([0-9.e+]+)$", metrics_text, re.M)
    return sum(float(v) for v in values) if values else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--monolithic", action="store_true", help="one server, no disaggregation")
    mode.add_argument(
        "--direct", action="store_true", help="1 prefill + 2 decoders, requests sent to decoders"
    )
    parser.add_argument("--log-dir", type=Path, default=None, help="server logs (default: temp)")
    args = parser.parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="sgl_pd_demo_"))
    print(f"[demo] logs in {log_dir}", flush=True)
    started = time.perf_counter()
    try:
        if args.monolithic:
            with monolithic_server(log_dir) as server:
                print(f"[demo] server ready in {time.perf_counter() - started:.0f} s", flush=True)
                _ask(server.url, None)
        elif args.direct:
            metrics = ["--enable-metrics"]
            with direct_cluster(log_dir, prefill_extra=metrics, decode_extra=metrics) as cluster:
                decoders = ", ".join(d.url for d in cluster.decoders)
                print(
                    f"[demo] prefill {cluster.prefill.url}, decoders {decoders} (direct mode, "
                    f"no router): ready in {time.perf_counter() - started:.0f} s",
                    flush=True,
                )
                for decoder in cluster.decoders:
                    print(f"\n[demo] asking decoder {decoder.url}", flush=True)
                    _ask(decoder.url, None)
                _report_moved(cluster.prefill.url)
        else:
            metrics = ["--enable-metrics"]
            with pd_cluster(log_dir, prefill_extra=metrics, decode_extra=metrics) as cluster:
                print(
                    f"[demo] prefill {cluster.prefill.url}, decode {cluster.decode.url}, "
                    f"router {cluster.router_url}: ready in {time.perf_counter() - started:.0f} s",
                    flush=True,
                )
                _ask(cluster.router_url, cluster.prefill.url)
    except ServerStartError as e:
        print(f"[demo] a server failed to start:\n{e}", file=sys.stderr)
        return 1
    except requests.RequestException as e:
        print(f"[demo] a request failed: {e}; server logs are in {log_dir}", file=sys.stderr)
        return 1
    print("[demo] all servers stopped", flush=True)
    return 0


def _ask(url: str, prefill_url: str | None) -> None:
    text = complete(url, TEXT_PROMPT, max_tokens=24)
    print(f"\n  completion  {TEXT_PROMPT!r} -> {text!r}")
    for prompt in CHAT_PROMPTS:
        answer = stream_chat(url, prompt, max_tokens=48)
        print(f"  chat        {prompt!r} -> {answer.text!r}")
        print(
            f"              TTFT {answer.ttft_s * 1e3:.0f} ms, total {answer.total_s * 1e3:.0f} ms"
        )
    if prefill_url is not None:
        _report_moved(prefill_url)


def _report_moved(prefill_url: str) -> None:
    moved = transfer_bytes(requests.get(f"{prefill_url}/metrics", timeout=30).text)
    shown = "not reported" if moved is None else f"{moved / 1e6:.2f} MB"
    print(f"\n  KV and metadata moved by the prefiller over Mooncake: {shown}\n", flush=True)


if __name__ == "__main__":
    sys.exit(main())
