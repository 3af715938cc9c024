"""The bind / advertise rules of `resolve_hosts`, with the network lookups injected."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import FrozenInstanceError

import pytest

from sgl_pd.backend.addresses import (
    Hosts,
    is_loopback,
    local_addresses,
    resolve_host,
    resolve_hosts,
)
from sgl_pd.errors import ConfigError, SglPdError


def _local(*addrs: str) -> Callable[[], Sequence[str]]:
    return lambda: list(addrs)


def _no_lookup() -> Sequence[str]:
    raise AssertionError("the local addresses must not be looked up here")


def _resolver(table: dict[str, list[str]]) -> Callable[[str], Sequence[str]]:
    return lambda host: table.get(host, [])


@pytest.mark.parametrize("bind", ["", "0.0.0.0", "::", " 0.0.0.0 "])
def test_wildcard_bind_advertises_the_first_outward_address(bind: str) -> None:
    hosts = resolve_hosts(bind, "", False, local=_local("127.0.0.1", "10.0.0.5", "10.0.0.6"))
    assert hosts.advertise == "10.0.0.5"
    assert hosts.binds_all
    assert hosts.bind == ("::" if bind == "::" else "0.0.0.0")


def test_specific_bind_is_advertised_without_lookups() -> None:
    assert resolve_hosts("10.1.2.3", "", False, local=_no_lookup) == Hosts("10.1.2.3", "10.1.2.3")


def test_localhost_means_ipv4_loopback() -> None:
    hosts = resolve_hosts("localhost", "", False, local=_no_lookup)
    assert hosts == Hosts("127.0.0.1", "127.0.0.1")
    assert not hosts.binds_all


def test_loopback_bind_may_advertise_loopback() -> None:
    # listening on loopback only is a single-host setup by construction
    assert resolve_hosts("127.0.0.1", "", False, local=_no_lookup).advertise == "127.0.0.1"


@pytest.mark.parametrize("found", [(), ("127.0.0.1",), ("127.0.1.1",), ("127.0.1.1", "::1")])
def test_wildcard_bind_refuses_to_advertise_loopback(found: tuple[str, ...]) -> None:
    # ("127.0.1.1",) is what Debian's /etc/hosts gives for the host name
    with pytest.raises(ConfigError) as err:
        resolve_hosts("0.0.0.0", "", False, local=_local(*found))
    msg = str(err.value)
    assert "--pd-advertise-host" in msg
    assert "--host" in msg
    assert "--pd-allow-loopback-advertise" in msg
    assert isinstance(err.value, SglPdError)


def test_wildcard_bind_advertises_loopback_when_allowed() -> None:
    hosts = resolve_hosts("0.0.0.0", "", True, local=_local("127.0.1.1"))
    assert hosts == Hosts("0.0.0.0", "127.0.0.1")


def test_explicit_advertise_host_wins_without_lookups() -> None:
    hosts = resolve_hosts("0.0.0.0", "10.9.9.9", False, local=_no_lookup)
    assert hosts == Hosts("0.0.0.0", "10.9.9.9")


def test_explicit_advertise_may_differ_from_a_specific_bind() -> None:
    hosts = resolve_hosts("127.0.0.1", "10.9.9.9", False, local=_no_lookup)
    assert hosts == Hosts("127.0.0.1", "10.9.9.9")


@pytest.mark.parametrize("advertise", ["127.0.0.1", "localhost", "::1", "loopy-name"])
def test_explicit_loopback_advertise_with_wildcard_bind(advertise: str) -> None:
    resolve = _resolver({"loopy-name": ["10.0.0.1", "127.0.1.1"]})
    with pytest.raises(ConfigError, match="--pd-allow-loopback-advertise"):
        resolve_hosts("0.0.0.0", advertise, False, local=_no_lookup, resolve=resolve)
    hosts = resolve_hosts("0.0.0.0", advertise, True, local=_no_lookup, resolve=resolve)
    assert hosts.advertise == ("127.0.0.1" if advertise == "localhost" else advertise)


def test_explicit_host_name_that_resolves_outward_is_kept() -> None:
    resolve = _resolver({"node-a.cluster": ["10.0.0.7"]})
    hosts = resolve_hosts("::", "node-a.cluster", False, local=_no_lookup, resolve=resolve)
    assert hosts == Hosts("::", "node-a.cluster")


def test_derived_host_names_are_checked_through_the_resolver() -> None:
    resolve = _resolver({"vm": ["127.0.1.1"], "node-a": ["10.0.0.7"]})
    hosts = resolve_hosts("0.0.0.0", "", False, local=_local("vm", "node-a"), resolve=resolve)
    assert hosts.advertise == "node-a"


@pytest.mark.parametrize("advertise", ["0.0.0.0", "::"])
def test_wildcard_advertise_is_refused(advertise: str) -> None:
    with pytest.raises(ConfigError, match="every interface"):
        resolve_hosts("10.0.0.1", advertise, True, local=_no_lookup)


@pytest.mark.parametrize(
    ("host", "expected"),
    [
        ("127.0.0.1", True),
        ("127.0.1.1", True),
        ("::1", True),
        ("::ffff:127.0.0.1", True),
        ("localhost", True),
        ("10.0.0.1", False),
        ("::ffff:10.0.0.1", False),
        ("fe80::1%eth0", False),
        ("2001:db8::1", False),
    ],
)
def test_is_loopback_literals(host: str, expected: bool) -> None:
    assert is_loopback(host, resolve=_resolver({})) is expected


def test_is_loopback_resolves_names() -> None:
    resolve = _resolver(
        {"lo-name": ["127.0.1.1"], "out": ["10.0.0.1"], "mixed": ["10.0.0.2", "::1"]}
    )
    assert is_loopback("lo-name", resolve=resolve)
    assert not is_loopback("out", resolve=resolve)
    assert is_loopback("mixed", resolve=resolve)
    assert not is_loopback("unknown", resolve=resolve)


def test_hosts_is_frozen() -> None:
    hosts = Hosts("0.0.0.0", "10.0.0.1")
    with pytest.raises(FrozenInstanceError):
        hosts.bind = "127.0.0.1"  # type: ignore[misc]


def test_default_lookups_return_addresses() -> None:
    # no packet is sent: UDP connect() only consults the routing table
    found = local_addresses()
    assert all(isinstance(a, str) and a for a in found)
    assert resolve_host("localhost")  # /etc/hosts
