"""The TCP sockets Mooncake listens on, pinned to the configured interface.

`initialize` opens, in this process, the handshake/metadata listener (the RPC
port of the session id; every transport) and, on TCP, the data listener that serves writes
and reads into registered memory. Mooncake binds both to every interface whatever host name
it is given: the handshake socket to INADDR_ANY (`findAvailableTcpPort` and
`SocketHandShakePlugin::startDaemon`, IN6ADDR_ANY with MC_USE_IPV6) and the data socket to
`::` dual-stack, else 0.0.0.0 (`TcpContext`). No setting changes that, in 0.3.13.post1 nor
in Mooncake's main branch of 2026-08: MC_TCP_BIND_ADDRESS only picks the *advertised*
address with a metadata server, MC_RDMA_BIND_ADDRESS the RDMA one. So when
`TransportConfig.bind_host` names one address, we pin the sockets `initialize` opened to the
interface owning it with SO_BINDTODEVICE: the kernel then refuses connections that arrive
on any other interface (local connections to the host's own addresses still come in, since
Linux 4.14 counts them as arriving on the owning interface). `ss -ltn` shows them as
`0.0.0.0%lo:PORT`. What remains: every address of that interface is served, not only
`bind_host`; a connection accepted in the moments between `initialize` and the pinning stays
open (no memory is registered yet then); and without Linux 5.7 or CAP_NET_RAW the pinning
fails, which is logged, the listeners staying open to every interface (`listeners` says).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import socket
from dataclasses import dataclass

import psutil

logger = logging.getLogger("sgl_pd.transfer.mooncake")

_WILDCARD_IPS = ("0.0.0.0", "::")
_IFNAMSIZ = 16  # bytes of an interface name, NUL included (Linux)


@dataclass(frozen=True)
class Listener:
    """A TCP socket the engine listens on, as the kernel reports it."""

    address: str  # bound address; "0.0.0.0" or "::" = every address
    port: int
    device: str | None  # interface it is pinned to (SO_BINDTODEVICE); None = every one

    @property
    def open_to_all(self) -> bool:
        return self.address in _WILDCARD_IPS and self.device is None

    def __str__(self) -> str:  # like `ss -ltn`: 0.0.0.0%lo:15420
        where = f"[{self.address}]" if ":" in self.address else self.address
        return f"{where}%{self.device}:{self.port}" if self.device else f"{where}:{self.port}"


def listening_fds() -> dict[int, tuple[str, int]] | None:
    """fd -> (address, port) of every TCP socket this process listens on; None if the
    kernel will not say (a sandbox hiding /proc), which must not stop the engine."""
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except (psutil.Error, OSError):
        return None
    return {
        c.fd: (str(c.laddr.ip), int(c.laddr.port))
        for c in conns
        if c.status == psutil.CONN_LISTEN and c.fd >= 0
    }


def pin_listeners(
    before: dict[int, tuple[str, int]] | None, bind_host: str | None
) -> tuple[Listener, ...]:
    """Pins the sockets opened since `before` to `bind_host`'s interface; returns them.

    Sockets opened meanwhile by other threads are taken for Mooncake's; with one bind host
    for the whole process that is what they should serve too.
    """
    after = listening_fds()
    if before is None or after is None:
        if bind_host is not None:
            logger.warning(
                "cannot list this process's sockets, so Mooncake's listeners stay open on "
                "every interface although the bind host is %s; block Mooncake's ports "
                "(MC_MIN_RPC_PORT..MC_MAX_RPC_PORT) with a firewall",
                bind_host,
            )
        return ()
    opened = {fd: a for fd, a in after.items() if before.get(fd) != a}
    device = _interface_of(bind_host) if bind_host is not None else None
    problem = ""
    if bind_host is not None and device is None:
        problem = f"no network interface here has the address of {bind_host!r}"
    for fd, (address, port) in opened.items():
        if device is None or address not in _WILDCARD_IPS:
            continue
        try:
            _set_device(fd, device)
        except OSError as e:
            problem = (
                f"pinning port {port} to {device} failed ({e}; needs Linux >= 5.7 or CAP_NET_RAW)"
            )
    listeners = tuple(
        Listener(address, port, _device_of(fd)) for fd, (address, port) in sorted(opened.items())
    )
    exposed = [str(li) for li in listeners if li.open_to_all]
    if bind_host is not None and exposed:
        logger.warning(
            "Mooncake listens on %s on every interface although the bind host is %s: %s. "
            "Other hosts can reach these ports and the registered memory behind them; block "
            "them with a firewall (Mooncake picks them from MC_MIN_RPC_PORT..MC_MAX_RPC_PORT)",
            ", ".join(exposed),
            bind_host,
            problem,
        )
    return listeners


def _interface_of(host: str) -> str | None:
    """The network interface that owns `host`'s address; None if none here does."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return None
    wanted = {str(info[4][0]) for info in infos}
    loopback = any(ipaddress.ip_address(addr.split("%", 1)[0]).is_loopback for addr in wanted)
    nics = psutil.net_if_addrs()
    for name, entries in nics.items():
        if any(str(e.address).split("%", 1)[0] in wanted for e in entries):
            return str(name)
    if loopback:  # 127.0.0.0/8 is all loopback though `lo` lists only 127.0.0.1
        for name, entries in nics.items():
            if any(str(e.address) in ("127.0.0.1", "::1") for e in entries):
                return str(name)
    return None


def _set_device(fd: int, device: str) -> None:
    # a duplicate of Mooncake's descriptor shares its socket; closing it leaves Mooncake's
    with socket.socket(fileno=os.dup(fd)) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, device.encode())


def _device_of(fd: int) -> str | None:
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            raw = s.getsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, _IFNAMSIZ)
    except OSError:
        return None
    return raw.split(b"\0", 1)[0].decode() or None
