"""Local SGLang servers through sgl_pd's launcher: one monolithic server, or a PD cluster.

Used by the demo, the end-to-end tests and the benchmarks, so they all start servers
the same way: free ports, readiness waits with a timeout, and everything stopped on exit.

How long they wait, and how much slowness SGLang's router forgives a worker, is one
setting, `Patience`: a factor read once per process from ``SGLPD_LOCAL_PATIENCE``
(default 1.0; 3 waits three times as long). This is test, benchmark and demo tooling,
not the server, which takes its settings from its command line only.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import secrets
from collections.abc import Iterator, Sequence
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_pd.cluster.processes import (
    ManagedProcess,
    exit_on_sigterm,
    free_port,
    free_ports,
    managed,
    python_module_argv,
)
from sgl_pd.environment import (
    COREDUMP_BEFORE_CRASH,
    LOCAL_PATIENCE,
    PYSPY_BEFORE_CRASH,
    WARNINGS_LOG,
    env_value,
)
from sgl_pd.errors import ConfigError
from sgl_pd.harness.cpu import flag_value, uses_dp_attention
from sgl_pd.models import TINY_LLAMA_PATH

HOST = "127.0.0.1"
PATIENCE_ENV = LOCAL_PATIENCE.name


@dataclass(frozen=True)
class Patience:
    """Every start-up wait of the local tooling and the router's health-check settings,
    scaled by one factor.

    The defaults suit a loaded 2-core machine: a cold CPU start imports torch and SGLang
    (about a minute), and a CPU prefiller busy with an 8k-token prompt answers nothing,
    not even /health, until its forward ends. SGLang's /health itself gives up after 20 s
    (``SGLANG_HEALTH_CHECK_TIMEOUT``) and answers 503, so a worker stays in the router's
    pool as long as it recovers within `health_failure_threshold` such checks (about
    7 minutes at factor 1). The router's circuit breaker is off: a request that fails is
    an error the caller sees, and must not take the worker out for everyone else.
    """

    factor: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.factor) and self.factor > 0):
            raise ConfigError(
                f"patience factor {self.factor!r}: need a finite number > 0 "
                f"({PATIENCE_ENV}, default 1.0)"
            )

    @classmethod
    def from_environment(cls) -> Patience:
        """The factor in ``SGLPD_LOCAL_PATIENCE``, or 1.0 when it is unset or empty."""
        text = (env_value(PATIENCE_ENV) or "").strip()
        if not text:
            return cls()
        try:
            factor = float(text)
        except ValueError as e:
            raise ConfigError(
                f"{PATIENCE_ENV}={text!r}: need a number > 0, a multiplier of the local "
                "tooling's waits (default 1.0)"
            ) from e
        return cls(factor)

    def seconds(self, base_s: float) -> float:
        """`base_s` seconds at factor 1, scaled: for a caller's own waits."""
        return base_s * self.factor

    @property
    def server_ready_s(self) -> float:
        """Seconds from a server's start to its /health answering 200."""
        return self.seconds(300.0)

    def servers_ready_s(self, scheduler_processes: int) -> float:
        """Seconds for servers started side by side with this many scheduler processes in
        all to answer: `server_ready_s` for up to three, a minute more for each further
        one (each loads the model and builds its pool on the same few cores)."""
        return self.server_ready_s + self.seconds(60.0) * max(0, scheduler_processes - 3)

    @property
    def router_ready_s(self) -> float:
        """Seconds from the router's start to its /readiness (both workers healthy)."""
        return self.seconds(120.0)

    @property
    def probe_timeout_s(self) -> float:
        """Seconds one readiness probe may take (SGLang's /health takes >= 1 s)."""
        return self.seconds(10.0)

    @property
    def health_check_timeout_s(self) -> int:
        """The router's timeout for one /health check, in whole seconds."""
        return math.ceil(self.seconds(30.0))

    @property
    def health_failure_threshold(self) -> int:
        """Consecutive failed checks before the router marks a worker unhealthy."""
        return math.ceil(20 * self.factor)

    def router_args(self) -> tuple[str, ...]:
        """``sglang_router.launch_router`` flags for these settings."""
        return (
            # find the workers healthy within a second of their readiness, not after the
            # default minute; the interval delays nothing else, so it is not scaled
            "--health-check-interval-secs", "1",
            "--health-success-threshold", "1",
            "--health-check-timeout-secs", str(self.health_check_timeout_s),
            "--health-failure-threshold", str(self.health_failure_threshold),
            "--disable-circuit-breaker",
        )  # fmt: skip


@functools.cache
def local_patience() -> Patience:
    """This process's `Patience`, read from the environment on the first call only."""
    return Patience.from_environment()


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
    # an idle scheduler otherwise polls its queues non-stop, a core's worth of CPU taken
    # from the servers that are working (SGLang sleeps only with nothing queued at all)
    "--sleep-on-idle",
)  # fmt: skip


def server_argv(model: Path, port: int, extra: Sequence[str] = ()) -> list[str]:
    # SGLang otherwise picks its process group's rendezvous port at random when it starts
    # and binds it seconds later, in its scheduler: servers starting side by side could
    # pick the same one (measured: EADDRINUSE); ours are handed out once per process
    rendezvous = () if "--nccl-port" in extra else ("--nccl-port", str(free_port()))
    return python_module_argv(
        "sgl_pd.launch_server",
        "--model-path", str(model),
        "--host", HOST,
        "--port", str(port),
        *rendezvous,
        *DEFAULT_SERVER_ARGS,
        *extra,
    )  # fmt: skip


@dataclass(frozen=True)
class Server:
    url: str
    process: ManagedProcess


def _wait_ready(process: ManagedProcess, url: str, budget_s: float, patience: Patience) -> None:
    process.wait_http_ready(url, budget_s, probe_timeout_s=patience.probe_timeout_s)


def wait_servers_ready(servers: Sequence[tuple[ManagedProcess, str]], patience: Patience) -> None:
    """Waits for every (process, base URL) started side by side to answer /health, the
    budget grown with the scheduler processes they run in all."""
    budget_s = patience.servers_ready_s(sum(scheduler_ranks(p.argv) for p, _ in servers))
    for process, url in servers:
        _wait_ready(process, f"{url}/health", budget_s, patience)


@contextlib.contextmanager
def monolithic_server(
    log_dir: Path,
    model: Path = TINY_LLAMA_PATH,
    extra: Sequence[str] = (),
    *,
    patience: Patience | None = None,
    placement: Placement | None = None,
) -> Iterator[Server]:
    """One ordinary (mixed prefill + decode) SGLang server through our launcher.
    `patience`: how long to wait for it; `local_patience()` when None. `placement`: its
    cores (default: all this process may use)."""
    patience = patience if patience is not None else local_patience()
    ranks = scheduler_ranks(extra)
    placement = placement if placement is not None else place_servers(1, ranks=[ranks])[0]
    (port,) = free_ports(1)
    process = placed_process(
        "server", server_argv(model, port, extra), log_dir / "server.log", placement
    )
    with managed([process]):
        process.start()
        url = f"http://{HOST}:{port}"
        _wait_ready(process, f"{url}/health", patience.servers_ready_s(ranks), patience)
        yield Server(url, process)


def start_side_by_side(
    stack: contextlib.ExitStack[Any], *servers: contextlib.AbstractContextManager[Any]
) -> list[Any]:
    """Enters the context managers of `servers` (a monolithic server, a PD cluster, ...)
    at once, each from its own thread, and returns what each yields; `stack` stops them
    all, also those that started when another failed to (or the wait was interrupted).
    A server's start is mostly single-threaded imports, so starts overlap well on two
    cores (answering requests side by side would not: start them here, then use them one
    at a time). A SIGTERM to this process stops them too, as it does a server started
    from the main thread (`processes.managed`)."""
    stack.callback(exit_on_sigterm())
    pool = ThreadPoolExecutor(len(servers))
    entered = [pool.submit(server.__enter__) for server in servers]
    try:
        futures.wait(entered)
    finally:  # (interrupted too: each start still ends within its readiness wait)
        pool.shutdown(wait=True)
        for server, future in zip(servers, entered, strict=True):
            if future.exception() is None:
                stack.push(server)
    failure = next((f.exception() for f in entered if f.exception() is not None), None)
    if failure is not None:
        raise failure
    return [future.result() for future in entered]


@dataclass(frozen=True)
class PdCluster:
    router_url: str
    prefill: Server
    decode: Server
    bootstrap_port: int
    more_prefills: tuple[Server, ...] = ()  # further prefill servers behind the router


@dataclass(frozen=True)
class Placement:
    """Where one local server runs: the CPU cores it is pinned to, and per scheduler
    process (one per TP rank) the cores that rank's torch threads run on, as many threads
    as it has cores. A server's idle torch threads spin for a while before they sleep, so
    servers sharing cores slow each other down (PD decode measured ten times slower per
    token with every server on all cores than with one core each).

    `ranks` defaults to one rank on all of `cpus`."""

    cpus: tuple[int, ...]
    ranks: tuple[tuple[int, ...], ...] = ()

    def __post_init__(self) -> None:
        if not self.ranks:
            object.__setattr__(self, "ranks", (self.cpus,))

    def env(self) -> dict[str, str]:
        # SGLang reads one '|'-separated entry per rank; its CPU kernels bind their OpenMP
        # threads there where they can (AMX, arm64), and the CPU harness pins each rank's
        # process to its entry everywhere else (cpu_shims)
        per_rank = "|".join(",".join(map(str, cores)) for cores in self.ranks)
        threads = min(len(cores) for cores in self.ranks)
        return {"OMP_NUM_THREADS": str(threads), "SGLANG_CPU_OMP_THREADS_BIND": per_rank}

    def wrap(self, argv: Sequence[str]) -> list[str]:
        """`argv` started on this placement's cores (taskset, from util-linux)."""
        return ["taskset", "--cpu-list", ",".join(map(str, self.cpus)), *argv]


def place_servers(
    num_servers: int, cores: Sequence[int] | None = None, ranks: Sequence[int] | None = None
) -> list[Placement]:
    """Cores for `num_servers` servers sharing `cores` (default: the cores this process
    may use), each server with `ranks[i]` scheduler processes (default one each).

    Servers get disjoint contiguous blocks, sized in proportion to their ranks (at least
    one core each); with more servers than cores, one core each, in turn. Inside a
    server's block each rank gets cores of its own, or, with fewer cores than ranks, the
    ranks take its cores in turn. Servers are kept apart rather than ranks: a prefill
    rank spinning on a decoder's core (SGLang's prefill loop polls its transfers while
    any is in flight, Mooncake's synchronous write polls its completion) was measured to
    stall that decoder's transfers for 30 s, while two ranks of one server sharing a core
    only slow each other's all-reduce."""
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, got {num_servers}")
    per_server = [1] * num_servers if ranks is None else list(ranks)
    if len(per_server) != num_servers or min(per_server) < 1:
        raise ValueError(f"need a rank count >= 1 for each of {num_servers} servers: {ranks}")
    available = sorted(os.sched_getaffinity(0) if cores is None else cores)
    if not available:
        raise ValueError("no CPU cores to place servers on")
    if num_servers >= len(available):
        blocks = [[available[i % len(available)]] for i in range(num_servers)]
    else:
        blocks, start = [], 0
        for size in _shares(len(available), per_server):
            blocks.append(available[start : start + size])
            start += size
    placements = []
    for block, count in zip(blocks, per_server, strict=True):
        if count <= len(block):
            rank_cores = [tuple(part) for part in _split(block, count)]
        else:
            rank_cores = [(block[r % len(block)],) for r in range(count)]
        placements.append(Placement(tuple(block), tuple(rank_cores)))
    return placements


def _shares(total: int, weights: Sequence[int]) -> list[int]:
    """`total` cores split in proportion to `weights`, at least one each (largest
    remainders get the leftover cores, earlier entries first on ties)."""
    spare = total - len(weights)
    exact = [spare * w / sum(weights) for w in weights]
    shares = [1 + int(x) for x in exact]
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(exact[i] - int(exact[i])), i))
    for i in by_remainder[: total - sum(shares)]:
        shares[i] += 1
    return shares


def _split(items: Sequence[int], parts: int) -> list[Sequence[int]]:
    """`items` in `parts` contiguous runs, the first runs one longer when uneven."""
    size, extra = divmod(len(items), parts)
    runs, start = [], 0
    for k in range(parts):
        end = start + size + (1 if k < extra else 0)
        runs.append(items[start:end])
        start = end
    return runs


def place_pd(prefill_ranks: Sequence[int], decode_ranks: Sequence[int]) -> list[Placement]:
    """Placements for prefill servers then decode servers: the two roles on separate
    blocks of cores (in proportion to their ranks) wherever there are two cores, each
    role's servers split inside its block."""
    if not decode_ranks:
        return place_servers(len(prefill_ranks), ranks=prefill_ranks)
    if not prefill_ranks:
        return place_servers(len(decode_ranks), ranks=decode_ranks)
    prefill_block, decode_block = place_servers(2, ranks=[sum(prefill_ranks), sum(decode_ranks)])
    return [
        *place_servers(len(prefill_ranks), prefill_block.cpus, prefill_ranks),
        *place_servers(len(decode_ranks), decode_block.cpus, decode_ranks),
    ]


TP_FLAGS = ("--tp", "--tp-size", "--tensor-parallel-size")
DP_FLAGS = ("--dp", "--dp-size", "--data-parallel-size")


def scheduler_ranks(argv: Sequence[str]) -> int:
    """How many scheduler processes SGLang starts for a server with these flags: TP
    ranks, times DP replicas unless DP attention runs inside the TP group."""
    args = list(argv)

    def size(flags: tuple[str, ...]) -> int:
        values = [v for f in flags if (v := flag_value(args, f)) is not None]
        return int(values[-1]) if values else 1

    tp, dp = size(TP_FLAGS), size(DP_FLAGS)
    return tp if uses_dp_attention(args) else tp * dp


# A local server is stopped by a SIGTERM to its process group. SGLang's launcher takes
# its scheduler's exit as a crash and sleeps 5 s before crash diagnostics (a py-spy
# dump, a CUDA coredump) that a CPU run has no use for: 5 s more per stop, and the test
# suite stops dozens of servers.
NO_CRASH_DIAGNOSTICS = {PYSPY_BEFORE_CRASH.name: "0", COREDUMP_BEFORE_CRASH.name: "0"}


def placed_process(
    name: str, argv: Sequence[str], log_path: Path, placement: Placement
) -> ManagedProcess:
    """A process pinned to `placement`, logging to `log_path`; a server's warnings are
    also gathered, with their level and logger, beside it (`warnings_path`)."""
    warnings_path(log_path).unlink(missing_ok=True)  # (appended to by every process)
    env = {
        **placement.env(),
        **NO_CRASH_DIAGNOSTICS,
        WARNINGS_LOG.name: str(warnings_path(log_path)),
    }
    return ManagedProcess(name, placement.wrap(argv), log_path, env)


def warnings_path(log_path: Path) -> Path:
    """Where a local server's processes gather their warnings (`sgl_pd.warnings_log`)."""
    return log_path.with_suffix(".warnings")


def write_cluster_secret(path: Path) -> Path:
    """A fresh random cluster secret in `path`, readable by this user only."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    os.chmod(path, 0o600)  # O_CREAT's mode applies only to a new file
    return path


def pd_server_args(role: str, bootstrap_port: int | None = None) -> list[str]:
    """SGLang's own flags that make a server one side of an sgl_pd pair."""
    args = ["--disaggregation-mode", role, "--disaggregation-transfer-backend", "sgl_pd"]
    if bootstrap_port is not None:
        args += ["--disaggregation-bootstrap-port", str(bootstrap_port)]
    return args


def pd_process(
    name: str,
    role: str,
    model: Path,
    port: int,
    extra: Sequence[str],
    log_dir: Path,
    placement: Placement,
    bootstrap_port: int | None = None,
) -> ManagedProcess:
    """One sgl_pd server of `role` on `port`, pinned to `placement`, logging to
    log_dir/name.log; `extra` holds its further flags (the cluster secret among them)."""
    return placed_process(
        name,
        server_argv(model, port, [*pd_server_args(role, bootstrap_port), *extra]),
        log_dir / f"{name}.log",
        placement,
    )


def router_argv(
    port: int,
    prometheus_port: int,
    prefill_url: str,
    bootstrap_port: int,
    decode_url: str,
    *,
    patience: Patience | None = None,
    retries: bool = True,
    more_prefills: Sequence[tuple[str, int]] = (),
    more_decodes: Sequence[str] = (),
    decode_policy: str = "round_robin",
) -> list[str]:
    """SGLang's router in PD mode over one pair; its health checks from `patience`
    (`local_patience()` when None). `retries=False`: a failed request reaches the client
    as it failed, instead of being sent again (fault campaigns count failures).
    `more_prefills`: (url, bootstrap port) of further prefill servers, taken in turn;
    `more_decodes`: URLs of further decode servers, chosen by `decode_policy`
    ("cache_aware": where the prompt's prefix went before, so a decoder's prefix cache
    is hit)."""
    patience = patience if patience is not None else local_patience()
    prefills = [(prefill_url, bootstrap_port), *more_prefills]
    return python_module_argv(
        "sglang_router.launch_router",
        "--pd-disaggregation",
        *(arg for url, port in prefills for arg in ("--prefill", url, str(port))),
        *(arg for url in (decode_url, *more_decodes) for arg in ("--decode", url)),
        "--host", HOST,
        "--port", str(port),
        "--prometheus-port", str(prometheus_port),  # its default, 29000, allows one router
        "--policy", "round_robin",
        "--decode-policy", decode_policy,
        *patience.router_args(),
        *(() if retries else ("--disable-retries",)),
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
    *,
    patience: Patience | None = None,
    more_prefills: Sequence[tuple[ManagedProcess, str]] = (),
) -> Iterator[None]:
    """Starts a PD pair (and `more_prefills`: (process, url) of further prefill servers)
    side by side and the router once all answer; stops them all on exit, whatever
    happened inside. `patience`: the waits; `local_patience()` when None."""
    patience = patience if patience is not None else local_patience()
    servers = [(prefill, prefill_url), *more_prefills, (decode, decode_url)]
    with managed([*(process for process, _ in servers), router]):
        for process, _ in servers:
            process.start()
        wait_servers_ready(servers, patience)
        router.start()
        # /readiness answers 200 once the router found both workers healthy
        _wait_ready(router, f"{router_url}/readiness", patience.router_ready_s, patience)
        yield


@contextlib.contextmanager
def pd_cluster(
    log_dir: Path,
    model: Path = TINY_LLAMA_PATH,
    prefill_extra: Sequence[str] = (),
    decode_extra: Sequence[str] = (),
    *,
    patience: Patience | None = None,
    router_retries: bool = True,
    more_prefills: Sequence[Sequence[str]] = (),
) -> Iterator[PdCluster]:
    """A prefill server, a decode server and SGLang's router in PD mode, all local.

    The servers start side by side; the router starts once all answer. `patience`:
    the waits and the router's health checks; `local_patience()` when None.
    `router_retries=False` lets failed requests reach the client unretried.
    `more_prefills`: one more prefill server per entry, with these flags instead of
    `prefill_extra`; the router sends requests to the prefill servers in turn.
    """
    patience = patience if patience is not None else local_patience()
    ports = free_ports(5 + 2 * len(more_prefills))  # one call: all distinct
    prefill_port, decode_port, bootstrap_port, router_port, metrics_port = ports[:5]
    secret = ("--pd-auth-secret-file", str(write_cluster_secret(log_dir / "cluster.secret")))
    # the prefill servers on one block of cores, the decoder on another (place_pd)
    placements = place_pd(
        [scheduler_ranks(a) for a in (prefill_extra, *more_prefills)],
        [scheduler_ranks(decode_extra)],
    )
    extra_prefills: list[tuple[ManagedProcess, str, int]] = []
    for i, extra in enumerate(more_prefills, start=1):
        port, extra_bootstrap = ports[3 + 2 * i : 5 + 2 * i]
        process = pd_process(
            f"prefill{i}", "prefill", model, port, [*secret, *extra], log_dir, placements[i],
            extra_bootstrap,
        )  # fmt: skip
        extra_prefills.append((process, f"http://{HOST}:{port}", extra_bootstrap))
    prefill = pd_process(
        "prefill", "prefill", model, prefill_port, [*secret, *prefill_extra], log_dir,
        placements[0], bootstrap_port,
    )  # fmt: skip
    decode = pd_process(
        "decode", "decode", model, decode_port, [*secret, *decode_extra], log_dir, placements[-1]
    )
    prefill_url, decode_url = f"http://{HOST}:{prefill_port}", f"http://{HOST}:{decode_port}"
    router = ManagedProcess(
        "router",
        router_argv(
            router_port,
            metrics_port,
            prefill_url,
            bootstrap_port,
            decode_url,
            patience=patience,
            retries=router_retries,
            more_prefills=[(url, port) for _, url, port in extra_prefills],
        ),
        log_dir / "router.log",
    )
    router_url = f"http://{HOST}:{router_port}"
    with serving_pd(
        prefill,
        prefill_url,
        decode,
        decode_url,
        router,
        router_url,
        patience=patience,
        more_prefills=[(process, url) for process, url, _ in extra_prefills],
    ):
        yield PdCluster(
            router_url,
            Server(prefill_url, prefill),
            Server(decode_url, decode),
            bootstrap_port,
            tuple(Server(url, process) for process, url, _ in extra_prefills),
        )


@dataclass(frozen=True)
class MixedCluster:
    router_url: str
    servers: tuple[Server, ...]


@contextlib.contextmanager
def mixed_cluster(
    log_dir: Path,
    num_servers: int,
    model: Path = TINY_LLAMA_PATH,
    extra: Sequence[str] = (),
    *,
    patience: Patience | None = None,
) -> Iterator[MixedCluster]:
    """`num_servers` ordinary (mixed prefill + decode) servers, each on its own cores,
    behind SGLang's router (round robin): the baseline a PD deployment is compared with
    on the same hardware."""
    patience = patience if patience is not None else local_patience()
    ports = free_ports(num_servers + 2)
    router_port, metrics_port = ports[-2:]
    servers = [
        Server(
            f"http://{HOST}:{port}",
            placed_process(
                f"server{i}", server_argv(model, port, extra), log_dir / f"server{i}.log", place
            ),
        )
        for i, (port, place) in enumerate(
            zip(
                ports,
                place_servers(num_servers, ranks=[scheduler_ranks(extra)] * num_servers),
                strict=False,
            )
        )
    ]
    router_cmd = python_module_argv(
        "sglang_router.launch_router",
        "--worker-urls", *(s.url for s in servers),
        "--host", HOST,
        "--port", str(router_port),
        "--prometheus-port", str(metrics_port),
        "--policy", "round_robin",
        *patience.router_args(),
        "--log-level", "warn",
    )  # fmt: skip
    router = ManagedProcess("router", router_cmd, log_dir / "router.log")
    router_url = f"http://{HOST}:{router_port}"
    with managed([*(s.process for s in servers), router]):
        for server in servers:
            server.process.start()
        wait_servers_ready([(s.process, s.url) for s in servers], patience)
        router.start()
        _wait_ready(router, f"{router_url}/readiness", patience.router_ready_s, patience)
        yield MixedCluster(router_url, tuple(servers))


@contextlib.contextmanager
def deployment(
    kind: str,
    log_dir: Path,
    model: Path,
    extra: Sequence[str] = (),
    patience: Patience | None = None,
) -> Iterator[str]:
    """One of the two setups benchmarks compare on this machine's cores, all servers with
    `extra`: "mixed", two ordinary servers behind the router, or "pd", one prefill and
    one decode server behind the router in PD mode. Yields the router's URL."""
    if kind == "mixed":
        with mixed_cluster(log_dir, 2, model=model, extra=extra, patience=patience) as mixed:
            yield mixed.router_url
    elif kind == "pd":
        with pd_cluster(
            log_dir, model=model, prefill_extra=extra, decode_extra=extra, patience=patience
        ) as cluster:
            yield cluster.router_url
    else:
        raise ValueError(f"unknown deployment {kind!r}: 'mixed' or 'pd'")


@dataclass(frozen=True)
class DirectCluster:
    prefill: Server
    decoders: tuple[Server, ...]
    bootstrap_port: int
    router_url: str | None  # SGLang's router over the same servers, when asked for
    more_prefills: tuple[Server, ...] = ()  # the decoders choose among all prefill servers


def _nth(extras: Sequence[Sequence[str]], i: int) -> Sequence[str]:
    return extras[i] if i < len(extras) else ()


@contextlib.contextmanager
def direct_cluster(
    log_dir: Path,
    model: Path = TINY_LLAMA_PATH,
    prefill_extra: Sequence[str] = (),
    decode_extra: Sequence[str] = (),
    *,
    decoders: int = 2,
    with_router: bool = False,
    patience: Patience | None = None,
    decode_policy: str = "round_robin",
    prefills: int = 1,
    decoder_extras: Sequence[Sequence[str]] = (),
) -> Iterator[DirectCluster]:
    """One prefill server feeding `decoders` decode servers in direct mode (D3): clients
    send requests to a decoder, which submits the prefill itself (--pd-prefill-bootstrap).
    `with_router`: SGLang's PD router over the same servers too, so both flows can be
    compared on one cluster, choosing decoders by `decode_policy`. Each server on its own
    cores where there are enough. `prefills`: prefill servers the decoders choose among
    (the router, when asked for, sends to the first). `decoder_extras`: flags for each
    decoder in turn after `decode_extra` (decoders past its end get none)."""
    patience = patience if patience is not None else local_patience()
    ports = free_ports(decoders + 2 + 2 * prefills)
    prefill_port, bootstrap_port, router_port, metrics_port = ports[:4]
    extra_ports = ports[4 + decoders :]
    secret = ("--pd-auth-secret-file", str(write_cluster_secret(log_dir / "cluster.secret")))
    placements = place_pd(
        [scheduler_ranks(prefill_extra)] * prefills, [scheduler_ranks(decode_extra)] * decoders
    )
    prefill = Server(
        f"http://{HOST}:{prefill_port}",
        pd_process(
            "prefill", "prefill", model, prefill_port, [*secret, *prefill_extra], log_dir,
            placements[0], bootstrap_port,
        ),
    )  # fmt: skip
    more_prefills = tuple(
        Server(
            f"http://{HOST}:{extra_ports[2 * i]}",
            pd_process(
                f"prefill{i + 1}",
                "prefill",
                model,
                extra_ports[2 * i],
                [*secret, *prefill_extra],
                log_dir,
                placements[1 + i],
                extra_ports[2 * i + 1],
            ),
        )
        for i in range(prefills - 1)
    )
    bootstraps = [bootstrap_port, *(extra_ports[2 * i + 1] for i in range(prefills - 1))]
    direct = ("--pd-prefill-bootstrap", ",".join(f"{HOST}:{p}" for p in bootstraps))
    decode_servers = tuple(
        Server(
            f"http://{HOST}:{port}",
            pd_process(
                f"decode{i}",
                "decode",
                model,
                port,
                [*secret, *direct, *decode_extra, *_nth(decoder_extras, i)],
                log_dir,
                placements[prefills + i],
            ),
        )
        for i, port in enumerate(ports[4 : 4 + decoders])
    )
    router = None
    if with_router:
        router_cmd = router_argv(
            router_port,
            metrics_port,
            prefill.url,
            bootstrap_port,
            decode_servers[0].url,
            patience=patience,
            more_decodes=[d.url for d in decode_servers[1:]],
            decode_policy=decode_policy,
        )
        router = ManagedProcess("router", router_cmd, log_dir / "router.log")
    router_url = f"http://{HOST}:{router_port}" if with_router else None
    servers = (prefill, *more_prefills, *decode_servers)
    with managed([*(s.process for s in servers), *([router] if router else [])]):
        for server in servers:
            server.process.start()
        wait_servers_ready([(s.process, s.url) for s in servers], patience)
        if router is not None:
            router.start()
            _wait_ready(router, f"{router_url}/readiness", patience.router_ready_s, patience)
        yield DirectCluster(prefill, decode_servers, bootstrap_port, router_url, more_prefills)
