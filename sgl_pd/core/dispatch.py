"""A decoder's prefill servers in direct mode (D3): where they are, and the load it put
on each (`core.placement` chooses among them)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillerLoad:
    available: bool  # answered the last probe with every rank registered
    outstanding_tokens: int  # prompt tokens submitted and not yet prefilled, as estimated


def parse_bootstrap_addresses(spec: str) -> tuple[str, ...]:
    """ "host:port,host:port" (spaces or newlines also separate) -> the distinct addresses,
    in order. Raises ValueError naming a malformed one."""
    out: list[str] = []
    for item in spec.replace(",", " ").split():
        host, sep, port = item.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"{item!r} is not a prefill bootstrap address host:port")
        if item not in out:
            out.append(item)
    return tuple(out)
