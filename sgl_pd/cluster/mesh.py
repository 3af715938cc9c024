"""Several local PD servers of different shapes (TP sizes, send modes, page sizes) and one
SGLang router per chosen (prefill, decode) pairing, all started together.

Sharded pairings (TP2 -> TP1, TP1 -> TP2, ...) need a server of each shape on both sides;
starting them once and putting a router over each pairing lets one set of servers cover
every pairing, which matters on a 2-core machine where a TP2 server is three or four
processes. Routers are small (one Rust process each).

Prefill servers share one block of cores and decode servers another (see
`place_pd`); every server gets free ports, waits for readiness with a timeout and is
stopped on exit, whatever happened inside.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sgl_pd.cluster.local import (
    HOST,
    Patience,
    Server,
    local_patience,
    pd_process,
    place_pd,
    router_argv,
    scheduler_ranks,
    wait_servers_ready,
    write_cluster_secret,
)
from sgl_pd.cluster.processes import ManagedProcess, free_ports, managed
from sgl_pd.models import TINY_LLAMA_PATH


@dataclass(frozen=True)
class MeshServer:
    """One server of a mesh: `role` "prefill" or "decode", `extra` its further flags.
    A decoder's `direct_from` names prefill servers of the mesh it may send requests to
    itself (direct mode, ``--pd-prefill-bootstrap``)."""

    name: str
    role: str
    extra: tuple[str, ...] = ()
    direct_from: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.role not in ("prefill", "decode"):
            raise ValueError(f"server {self.name!r}: role must be prefill or decode")
        if self.direct_from and self.role != "decode":
            raise ValueError(f"server {self.name!r}: only a decoder submits prefills itself")


@dataclass(frozen=True)
class PdMesh:
    servers: dict[str, Server]
    bootstrap_ports: dict[str, int]  # prefill server name -> its bootstrap port
    routers: dict[tuple[str, str], str]  # (prefill name, decode name) -> router URL

    def router(self, prefill: str, decode: str) -> str:
        return self.routers[(prefill, decode)]


@contextlib.contextmanager
def pd_mesh(
    log_dir: Path,
    servers: Sequence[MeshServer],
    routes: Sequence[tuple[str, str]],
    *,
    model: Path = TINY_LLAMA_PATH,
    patience: Patience | None = None,
    router_retries: bool = True,
) -> Iterator[PdMesh]:
    """Starts `servers` side by side, then one router per (prefill, decode) in `routes`
    once every server answers. Yields the servers, bootstrap ports and router URLs."""
    patience = patience if patience is not None else local_patience()
    names = [s.name for s in servers]
    if len(set(names)) != len(names):
        raise ValueError(f"server names must be distinct: {names}")
    roles = {s.name: s.role for s in servers}
    for prefill, decode in routes:
        if roles.get(prefill) != "prefill" or roles.get(decode) != "decode":
            raise ValueError(f"route {prefill} -> {decode}: need a prefill and a decode server")
    prefills = [s for s in servers if s.role == "prefill"]
    decodes = [s for s in servers if s.role == "decode"]
    ports = iter(free_ports(len(servers) + len(prefills) + 2 * len(routes)))
    http_ports = {s.name: next(ports) for s in servers}
    bootstrap_ports = {s.name: next(ports) for s in prefills}
    secret = ("--pd-auth-secret-file", str(write_cluster_secret(log_dir / "cluster.secret")))
    placements = place_pd(
        [scheduler_ranks(s.extra) for s in prefills], [scheduler_ranks(s.extra) for s in decodes]
    )
    processes: dict[str, ManagedProcess] = {}
    for spec, placement in zip([*prefills, *decodes], placements, strict=True):
        direct: tuple[str, ...] = ()
        if spec.direct_from:
            listed = ",".join(f"{HOST}:{bootstrap_ports[p]}" for p in spec.direct_from)
            direct = ("--pd-prefill-bootstrap", listed)
        processes[spec.name] = pd_process(
            spec.name,
            spec.role,
            model,
            http_ports[spec.name],
            [*secret, *direct, *spec.extra],
            log_dir,
            placement,
            bootstrap_ports.get(spec.name),
        )
    urls = {name: f"http://{HOST}:{port}" for name, port in http_ports.items()}
    routers: dict[tuple[str, str], tuple[ManagedProcess, str]] = {}
    for prefill, decode in routes:
        port, metrics_port = next(ports), next(ports)
        argv = router_argv(
            port,
            metrics_port,
            urls[prefill],
            bootstrap_ports[prefill],
            urls[decode],
            patience=patience,
            retries=router_retries,
        )
        process = ManagedProcess(
            f"router-{prefill}-{decode}", argv, log_dir / f"router-{prefill}-{decode}.log"
        )
        routers[(prefill, decode)] = (process, f"http://{HOST}:{port}")
    with managed([*processes.values(), *(p for p, _ in routers.values())]):
        for process in processes.values():
            process.start()
        wait_servers_ready([(processes[n], urls[n]) for n in names], patience)
        for process, _ in routers.values():
            process.start()
        for process, url in routers.values():
            process.wait_http_ready(
                f"{url}/readiness",
                patience.router_ready_s,
                probe_timeout_s=patience.probe_timeout_s,
            )
        yield PdMesh(
            {n: Server(urls[n], processes[n]) for n in names},
            bootstrap_ports,
            {route: url for route, (_, url) in routers.items()},
        )
