"""Which interface our listeners bind and which address other nodes are told to use.

`--host` picks the bind interface ("", "0.0.0.0" and "::" mean every interface). Other nodes
need an address they can reach, which a wildcard is not, and which the host name often is
not either: Debian and Ubuntu map the host name to 127.0.1.1 in /etc/hosts. So with a
wildcard bind we ask the routing table for this host's outward address, and refuse to
advertise a loopback address unless the user says the whole deployment is on one host.

The network lookups are parameters, so the rules can be tested without a network.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from sgl_pd.errors import ConfigError

WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})  # --host values meaning every interface
# Routable addresses a UDP socket is connected to, only to read which local address the
# routing table would send from: connect() on UDP sends no packet.
_ROUTE_PROBES = (("8.8.8.8", socket.AF_INET), ("2001:4860:4860::8888", socket.AF_INET6))

Resolver = Callable[[str], Sequence[str]]  # host name -> its IP addresses ([] if unknown)
LocalAddresses = Callable[[], Sequence[str]]  # this host's addresses, preferred first


@dataclass(frozen=True)
class Hosts:
    bind: str  # what listeners bind: an address or host name, "0.0.0.0" / "::" = all
    advertise: str  # what other nodes are told to connect to

    @property
    def binds_all(self) -> bool:
        return self.bind in WILDCARD_HOSTS


def resolve_host(host: str) -> list[str]:
    """The IP addresses `host` resolves to here, in resolver order; [] if it does not."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError):
        return []
    return _unique(str(info[4][0]) for info in infos)


def local_addresses() -> list[str]:
    """This host's addresses, the one on the default route first.

    The default route's source address comes from the kernel without sending anything;
    the host name's addresses follow, for hosts without a default route.
    """
    found: list[str] = []
    for target, family in _ROUTE_PROBES:
        try:
            with socket.socket(family, socket.SOCK_DGRAM) as s:
                s.connect((target, 9))  # port 9 (discard); nothing is sent
                found.append(str(s.getsockname()[0]))
        except OSError:
            continue  # no route for this family
    found.extend(resolve_host(socket.gethostname()))
    return _unique(found)


def is_loopback(host: str, *, resolve: Resolver = resolve_host) -> bool:
    """True if `host` is, or resolves to, a loopback address (127.0.0.0/8, ::1).

    A host name counts as loopback if any of its addresses is one, since a peer on this
    host may pick that address.
    """
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return any(_ip_is_loopback(a) for a in resolve(host))
    return _ip_is_loopback(str(ip))


def resolve_hosts(
    bind_host: str,
    advertise_host: str,
    allow_loopback_advertise: bool,
    *,
    local: LocalAddresses = local_addresses,
    resolve: Resolver = resolve_host,
) -> Hosts:
    """The bind and advertised hosts for `--host bind_host` and `--pd-advertise-host`.

    `advertise_host` "" means: derive it. Raises `ConfigError` when other nodes would be
    told a loopback address while we listen on every interface (a multi-host setup that
    cannot work), unless `allow_loopback_advertise`, and when the advertised host is a
    wildcard.
    """
    bind = bind_address(bind_host)
    wildcard = bind in WILDCARD_HOSTS
    advertise = _normalize(advertise_host)
    if advertise in WILDCARD_HOSTS - {""}:
        raise ConfigError(
            f"--pd-advertise-host {advertise_host!r} means every interface, which other nodes "
            "cannot connect to; pass an address of this host that they reach"
        )
    if not advertise:
        if not wildcard:
            return Hosts(bind, bind)
        outward = [a for a in local() if not is_loopback(a, resolve=resolve)]
        if outward:
            return Hosts(bind, outward[0])
        advertise = "127.0.0.1"  # only loopback found; fine for a single-host setup
    if wildcard and not allow_loopback_advertise and is_loopback(advertise, resolve=resolve):
        raise ConfigError(
            f"--host {bind_host!r} listens on every interface but other nodes would be told "
            f"to connect to {advertise!r}, a loopback address they cannot reach. Pass "
            "--pd-advertise-host <address other nodes reach> or --host <that address>; for "
            "a deployment on this one host, pass --pd-allow-loopback-advertise"
        )
    return Hosts(bind, advertise)


def bind_address(host: str) -> str:
    """What a listener binds for `--host host`: "localhost" is 127.0.0.1, "" every interface."""
    return _normalize(host) or "0.0.0.0"


def local_connect_host(bind_host: str) -> str:
    """What a process on this host connects to for a listener bound to `bind_host`:
    loopback for a wildcard (every interface includes it)."""
    return "127.0.0.1" if bind_host in WILDCARD_HOSTS else bind_host


def host_port(host: str, port: int) -> str:
    """ "host:port", an IPv6 address in brackets."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _normalize(host: str) -> str:
    host = host.strip()
    return "127.0.0.1" if host == "localhost" else host


def _ip_is_loopback(addr: str) -> bool:
    try:
        ip = ipaddress.ip_address(addr.split("%", 1)[0])  # drop an IPv6 zone ("fe80::1%eth0")
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped  # ::ffff:127.0.0.1; Python 3.11 does not look inside
    return ip.is_loopback


def _unique(addrs: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(addrs))  # first occurrence wins, order kept
