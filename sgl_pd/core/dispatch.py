"""Which prefill server a decoder sends a request to (direct mode, D3): the available one
with the fewest prompt tokens outstanding (submitted, first token not yet seen), ties
broken in turn so equal servers share the load."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PrefillerLoad:
    available: bool  # answered the last probe with every rank registered
    outstanding_tokens: int  # prompt tokens submitted and not yet prefilled, as estimated


def choose_prefiller(
    loads: Mapping[str, PrefillerLoad], *, exclude: Sequence[str] = (), turn: int = 0
) -> str | None:
    """The address to submit to, or None when no prefill server is available. `exclude`
    holds addresses that just refused this request; `turn` rotates ties."""
    candidates = sorted(a for a, load in loads.items() if load.available and a not in exclude)
    if not candidates:
        return None
    least = min(loads[a].outstanding_tokens for a in candidates)
    tied = [a for a in candidates if loads[a].outstanding_tokens == least]
    return tied[turn % len(tied)]


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
