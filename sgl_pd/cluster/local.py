"""Local SGLang servers through sgl_pd's launcher: one monolithic server, or a PD cluster.

Used by the demo, the end-to-end tests and the benchmarks, so they all start servers
the same way: free ports, readiness waits with a timeout, and everything stopped on exit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sgl_pd.cluster.processes import ManagedProcess, free_ports, managed, python_module_argv
from sgl_pd.models import TINY_LLAMA_PATH

HOST = "127.0.0.1"
READY_TIMEOUT_S = 300.0  # a cold CPU start imports torch and SGLang: about a minute here

# Small pools: the bundled model is tiny and CI machines have 2 cores. Pages stay at
# SGLang's default size (1 token on CPU) unless a caller overrides it.
DEFAULT_SERVER_ARGS: tuple[str, ...] = (
    # SGLang's CPU engine measures free host memory around the weight load; a fraction
    # too small fails when other processes start at the same time. The pool itself is
    # capped by --max-total-tokens (64 MB for the bundled model).
    "--mem-fraction-static", "0.2",
    "--max-total-tokens", "32768",
    "--max-running-requests", "64",
    "--log-level", "warning",
)  # fmt: skip


def server_argv(model: Path, port: int, extra: Sequence[str] = ()) -> list[str]:
    return python_module_argv(
        "sgl_pd.launch_server",
        "--model-path", str(model),
        "--host", HOST,
        "--port", str(port),
        *DEFAULT_SERVER_ARGS,
        *extra,
    )  # fmt: skip


@dataclass(frozen=True)
class Server:
    url: str
    process: ManagedProcess


@contextlib.contextmanager
def monolithic_server(
    log_dir: Path, model: Path = TINY_LLAMA_PATH, extra: Sequence[str] = ()
) -> Iterator[Server]:
    """One ordinary (mixed prefill + decode) SGLang server through our launcher."""
    (port,) = free_ports(1)
    process = ManagedProcess("server", server_argv(model, port, extra), log_dir / "server.log")
    with managed([process]):
        process.start()
        url = f"http://{HOST}:{port}"
        process.wait_http_ready(f"{url}/health", READY_TIMEOUT_S)
        yield Server(url, process)


@dataclass(frozen=True)
class PdCluster:
    router_url: str
    prefill: Server
    decode: Server
    bootstrap_port: int


def pd_server_args(role: str, bootstrap_port: int | None = None) -> list[str]:
    """SGLang's own flags that make a server one side of an sgl_pd pair."""
    args = ["--disaggregation-mode", role, "--disaggregation-transfer-backend", "sgl_pd"]
    if bootstrap_port is not None:
        args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return args


def router_argv(
    port: int, prometheus_port: int, prefill_url: str, bootstrap_port: int, decode_url: str
) -> list[str]:
    return python_module_argv(
        "sglang_router.launch_router",
        "--pd-disaggregation",
        "--prefill", prefill_url, str(bootstrap_port),
        "--decode", decode_url,
        "--host", HOST,
        "--port", str(port),
        "--prometheus-port", str(prometheus_port),  # its default, 29000, allows one router
        "--policy", "round_robin",
        # find the workers healthy within a second, not after the default minute
        "--health-check-interval-secs", "1",
        "--health-success-threshold", "1",
        "--log-level", "warn",
    )  # fmt: skip


@contextlib.contextmanager
def serving_pd(
    prefill: ManagedProcess,
    prefill_url: str,
    decode: ManagedProcess,
    decode_url: str,
    router: ManagedProcess,
    router_url: str,
) -> Iterator[None]:
    """Starts a PD pair side by side and the router once both answer; stops all three on
    exit, whatever happened inside."""
    with managed([prefill, decode, router]):
        prefill.start()
        decode.start()
        prefill.wait_http_ready(f"{prefill_url}/health", READY_TIMEOUT_S)
        decode.wait_http_ready(f"{decode_url}/health", READY_TIMEOUT_S)
        router.start()
        router.wait_http_ready(f"{router_url}/readiness", 60.0)  # both workers healthy
        yield


@contextlib.contextmanager
def pd_cluster(
    log_dir: Path,
    model: Path = TINY_LLAMA_PATH,
    prefill_extra: Sequence[str] = (),
    decode_extra: Sequence[str] = (),
) -> Iterator[PdCluster]:
    """A prefill server, a decode server and SGLang's router in PD mode, all local.

    The two servers start side by side; the router starts once both answer.
    """
    prefill_port, decode_port, bootstrap_port, router_port, metrics_port = free_ports(5)
    prefill = ManagedProcess(
        "prefill",
        server_argv(
            model, prefill_port, [*pd_server_args("prefill", bootstrap_port), *prefill_extra]
        ),
        log_dir / "prefill.log",
    )
    decode = ManagedProcess(
        "decode",
        server_argv(model, decode_port, [*pd_server_args("decode"), *decode_extra]),
        log_dir / "decode.log",
    )
    prefill_url, decode_url = f"http://{HOST}:{prefill_port}", f"http://{HOST}:{decode_port}"
    router = ManagedProcess(
        "router",
        router_argv(router_port, metrics_port, prefill_url, bootstrap_port, decode_url),
        log_dir / "router.log",
    )
    router_url = f"http://{HOST}:{router_port}"
    with serving_pd(prefill, prefill_url, decode, decode_url, router, router_url):
        yield PdCluster(
            router_url,
            Server(prefill_url, prefill),
            Server(decode_url, decode),
            bootstrap_port,
        )
