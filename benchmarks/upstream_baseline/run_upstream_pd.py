"""Upstream baseline: SGLang 0.5.23's own Mooncake PD backend, on this CPU-only machine.

    cd /work/main && .venv/bin/python benchmarks/upstream_baseline/run_upstream_pd.py

What it does, leaving the installed SGLang untouched:

1. copies ``site-packages/sglang`` to a private directory and applies
   ``sglang-0.5.23-cpu-mooncake.patch`` there (``patch -p1``);
2. starts a prefill server, a decode server (``python -m sglang.launch_server``, with that
   copy first on ``PYTHONPATH``, ``--disaggregation-transfer-backend mooncake_tcp``) and
   SGLang's router in PD mode. sgl_pd's plugin is kept out (``SGLANG_PLUGINS``), so this is
   upstream SGLang only; the CPU harness (stand-in libcuda, ``SGLANG_USE_CPU_ENGINE=1``, CPU
   flags, ``--disaggregation-decode-retraction-backup cpu_tensor`` on the decoder) comes
   from ``sgl_pd.harness.cpu``;
3. sends a few greedy completions through the router and prints them;
4. stops PD, then (unless ``--no-monolithic``) starts one ordinary server from the same
   copy, sends the same prompts and compares the texts;
5. stops every process it started (each runs in its own process group).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import requests

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from sgl_pd.cluster.local import router_argv, serving_pd  # noqa: E402
from sgl_pd.cluster.processes import ManagedProcess, free_ports, managed  # noqa: E402
from sgl_pd.harness.cpu import Harness, plan_harness  # noqa: E402
from sgl_pd.models import TINY_LLAMA_PATH  # noqa: E402

HERE = Path(__file__).resolve().parent
PATCH = HERE / "sglang-0.5.23-cpu-mooncake.patch"
HOST = "127.0.0.1"
READY_TIMEOUT_S = 300.0
PROMPTS = [
    "Count: 41 42 43",
    "Days: Friday",
    "3 + 4 =",
    "7 x 8 =",
]
COMMON_ARGS = [
    "--model-path", str(TINY_LLAMA_PATH),
    "--host", HOST,
    # The CPU engine measures free *host* memory before and after loading weights; with
    # other servers starting on this machine at the same time, 0.05 fails at random
    # ("Loaded weights leave no GPU memory for the KV cache"). The pool is capped by
    # --max-total-tokens anyway (32768 tokens, 64 MB here).
    "--mem-fraction-static", "0.2",
    "--max-total-tokens", "32768",
    "--max-running-requests", "16",
    "--log-level", "info",
    "--sleep-on-idle",  # as sgl_pd's local servers: idle schedulers do not spin
]  # fmt: skip


def installed_sglang() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    assert spec is not None and spec.origin is not None, "sglang is not installed"
    return Path(spec.origin).resolve().parent


def patched_copy(dest_root: Path, apply_patch: bool = True) -> Path:
    """Copies the installed ``sglang`` package under ``dest_root`` and patches the copy."""
    src = installed_sglang()
    dst = dest_root / "sglang"
    if not dst.exists():
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
        if apply_patch:
            subprocess.run(
                ["patch", "-p1", "--forward", "-d", str(dest_root), "-i", str(PATCH)],
                check=True,
            )
    what = "patched" if apply_patch else "UNPATCHED"
    print(f"[baseline] {what} copy of {src} at {dst}")
    return dest_root


def server_env_and_args(copy_root: Path, argv: list[str]) -> tuple[dict[str, str], list[str]]:
    plan = plan_harness(Harness.CPU, argv)
    env = dict(plan.env)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(copy_root), os.environ.get("PYTHONPATH")) if p
    )
    # whitelist a plugin name that does not exist: no sgl_pd (or any other) plugin loads
    env["SGLANG_PLUGINS"] = "upstream-baseline-none"
    # mooncake_tcp sets this too; set it explicitly so the transport is certain
    env["MC_FORCE_TCP"] = "1"
    return env, [*argv, *plan.extra_args]


def server(name: str, copy_root: Path, port: int, extra: list[str], log_dir: Path):
    argv = [*COMMON_ARGS, "--port", str(port), *extra]
    env, argv = server_env_and_args(copy_root, argv)
    return ManagedProcess(
        name, [sys.executable, "-m", "sglang.launch_server", *argv], log_dir / f"{name}.log", env
    )


def generate(url: str, prompt: str, max_new_tokens: int) -> tuple[dict, float, float]:
    """Streams one greedy request; returns (last chunk, time to first token, total time)."""
    t0 = time.perf_counter()
    ttft = None
    last: dict = {}
    with requests.post(
        f"{url}/generate",
        json={
            "text": prompt,
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
            "stream": True,
        },
        timeout=120,
        stream=True,
    ) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data:"):
                continue
            payload = line[len(b"data:") :].strip()
            if payload == b"[DONE]":
                break
            last = json.loads(payload)
            if ttft is None and last.get("meta_info", {}).get("completion_tokens", 0) > 0:
                ttft = time.perf_counter() - t0
    total = time.perf_counter() - t0
    return last, (ttft if ttft is not None else total), total


def run_prompts(url: str, label: str, max_new_tokens: int) -> list[str]:
    texts = []
    for prompt in PROMPTS:
        out, ttft, total = generate(url, prompt, max_new_tokens)
        meta = out.get("meta_info", {})
        n = int(meta.get("completion_tokens") or 0)
        itl = (total - ttft) / (n - 1) if n > 1 else 0.0
        print(
            f"[{label}] {prompt!r} -> {out.get('text')!r}  ({n} tokens, "
            f"TTFT {ttft * 1000:.0f} ms, ITL {itl * 1000:.1f} ms, total {total * 1000:.0f} ms)"
        )
        texts.append(out.get("text"))
    return texts


def run_pd(copy_root: Path, log_dir: Path, max_new_tokens: int) -> list[str]:
    prefill_port, decode_port, bootstrap_port, router_port, metrics_port = free_ports(5)
    pd = ["--disaggregation-transfer-backend", "mooncake_tcp"]
    prefill = server(
        "prefill",
        copy_root,
        prefill_port,
        ["--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
         str(bootstrap_port), *pd],
        log_dir,
    )  # fmt: skip
    decode = server(
        "decode", copy_root, decode_port, ["--disaggregation-mode", "decode", *pd], log_dir
    )
    prefill_url, decode_url = f"http://{HOST}:{prefill_port}", f"http://{HOST}:{decode_port}"
    router_url = f"http://{HOST}:{router_port}"
    router = ManagedProcess(
        "router",
        router_argv(router_port, metrics_port, prefill_url, bootstrap_port, decode_url),
        log_dir / "router.log",
    )
    with serving_pd(prefill, prefill_url, decode, decode_url, router, router_url):
        print(f"[baseline] PD up: router {router_url}, prefill {prefill_url}, decode {decode_url}")
        return run_prompts(router_url, "upstream-pd", max_new_tokens)


def run_monolithic(copy_root: Path, log_dir: Path, max_new_tokens: int) -> list[str]:
    (port,) = free_ports(1)
    mono = server("monolithic", copy_root, port, [], log_dir)
    with managed([mono]):
        mono.start()
        url = f"http://{HOST}:{port}"
        mono.wait_http_ready(f"{url}/health", READY_TIMEOUT_S)
        return run_prompts(url, "monolithic", max_new_tokens)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", type=Path, help="keep the patched copy and logs here")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--no-monolithic", action="store_true", help="skip the comparison run")
    ap.add_argument(
        "--no-patch",
        action="store_true",
        help="run SGLang as shipped (reproduces the prefill crash; implies --no-monolithic)",
    )
    args = ap.parse_args()

    work = args.work_dir or Path(tempfile.mkdtemp(prefix="upstream_pd_"))
    work.mkdir(parents=True, exist_ok=True)
    log_dir = work / "logs"
    site = work / ("site-unpatched" if args.no_patch else "site")
    try:
        copy_root = patched_copy(site, apply_patch=not args.no_patch)
        pd_texts = run_pd(copy_root, log_dir, args.max_new_tokens)
        if args.no_monolithic or args.no_patch:
            return 0
        mono_texts = run_monolithic(copy_root, log_dir, args.max_new_tokens)
        same = pd_texts == mono_texts
        for p, a, b in zip(PROMPTS, pd_texts, mono_texts, strict=True):
            if a != b:
                print(f"[baseline] MISMATCH {p!r}: pd={a!r} monolithic={b!r}")
        print(f"[baseline] PD vs monolithic: {'identical' if same else 'DIFFERENT'}")
        return 0 if same else 1
    finally:
        print(f"[baseline] logs in {log_dir}")
        if args.work_dir is None:
            shutil.rmtree(site, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
