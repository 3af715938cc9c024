"""One request's PD timeline on one rank, from the stamps the messengers already keep:
what a tracer turns into spans and the debug log into a line (`backend.tracing`).

Every stage lies within its side's `sgl_pd.request` root, which is built as the hull of
the request's stamps, so a child never starts before or ends after its root. Times are
`Clock.monotonic()` seconds; the edge converts them to epoch nanoseconds.

Both sides know a request only by its bootstrap room, so `room_trace_ids` derives a
trace id and a parent span id from it: a prefill rank and a decode rank on different
hosts then put their spans into the same trace without exchanging anything (a room is a
random 63-bit number the router draws; two requests sharing one already break PD).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

REQUEST = "sgl_pd.request"
BOOTSTRAP = "sgl_pd.bootstrap"
TRANSFER = "sgl_pd.transfer"
CHUNK = "sgl_pd.transfer.chunk"
KV_WAIT = "sgl_pd.kv_wait"
HAND_OFF = "sgl_pd.hand_off"

Attr = int | float | str | bool


@dataclass(frozen=True)
class Stage:
    name: str
    start_s: float  # Clock.monotonic() seconds
    end_s: float
    attrs: tuple[tuple[str, Attr], ...] = ()


@dataclass(frozen=True)
class Timeline:
    role: str  # "prefill" or "decode"
    room: int
    rank: int
    root: Stage
    children: tuple[Stage, ...]
    error: str | None = None  # why the request failed; None when it completed

    def log_fields(self) -> str:
        """The stamps as one log line's fields: `name=start..end` in monotonic seconds."""
        parts = [f"role={self.role} room={self.room} rank={self.rank}"]
        for stage in (self.root, *self.children):
            parts.append(f"{stage.name}={stage.start_s:.6f}..{stage.end_s:.6f}")
        if self.error is not None:
            parts.append(f"error={self.error[:200]!r}")
        return " ".join(parts)


def room_trace_ids(room: int) -> tuple[int, int]:
    """(128-bit trace id, 64-bit parent span id) of a request, from its bootstrap room
    alone; neither is ever 0 (OpenTelemetry's invalid id)."""
    room_bytes = (room & ((1 << 64) - 1)).to_bytes(8, "big")
    trace_id = int.from_bytes(
        hashlib.blake2b(b"sgl_pd trace" + room_bytes, digest_size=16).digest()
    )
    span_id = int.from_bytes(
        hashlib.blake2b(b"sgl_pd request" + room_bytes, digest_size=8).digest()
    )
    return trace_id or 1, span_id or 1


def _timeline(
    role: str,
    room: int,
    rank: int,
    stages: Sequence[Stage],
    bounds: Sequence[float | None],
    attrs: tuple[tuple[str, Attr], ...],
    error: str | None,
) -> Timeline:
    times = [t for t in bounds if t is not None]
    times += [t for s in stages for t in (s.start_s, s.end_s)]
    root = Stage(REQUEST, min(times), max(times), attrs)
    return Timeline(role, room, rank, root, tuple(stages), error)


def _stage(name: str, start_s: float | None, end_s: float | None, **attrs: Attr) -> list[Stage]:
    """The stage, or nothing when one of its stamps was never taken (the request ended
    before it): a missing stage says where it stopped."""
    if start_s is None or end_s is None:
        return []
    return [Stage(name, start_s, max(start_s, end_s), tuple(attrs.items()))]


def prefill_timeline(
    *,
    room: int,
    rank: int,
    seen_s: float,
    ready_s: float | None,
    first_write_s: float | None,
    end_s: float,
    chunks: Sequence[tuple[int, float, float]],
    attrs: tuple[tuple[str, Attr], ...] = (),
    error: str | None = None,
) -> Timeline:
    """A prefill rank's request: `seen_s` (first heard of it) to `ready_s` (every decode
    rank's pages known) is the bootstrap; each (chunk index, first write start, last
    write end) a chunk; `first_write_s` to `end_s` (done, or failed) the transfer."""
    stages = _stage(BOOTSTRAP, seen_s, ready_s)
    for index, start, stop in chunks:
        stages += _stage(CHUNK, start, stop, chunk=index)
    stages += _stage(TRANSFER, first_write_s, end_s, chunks=len(chunks))
    return _timeline("prefill", room, rank, stages, (seen_s, end_s), attrs, error)


def decode_timeline(
    *,
    room: int,
    rank: int,
    seen_s: float | None,
    found_s: float | None,
    requested_s: float,
    complete_s: float | None,
    end_s: float,
    attrs: tuple[tuple[str, Attr], ...] = (),
    error: str | None = None,
) -> Timeline:
    """A decode rank's request: `seen_s` (its receiver made) to `found_s` (the
    prefiller's ranks known) the bootstrap; `requested_s` (pages allocated and asked
    for) to `complete_s` the KV wait; `complete_s` to `end_s` (handed to the decode
    batch, re-layout scatter included) the hand-off."""
    stages = _stage(BOOTSTRAP, seen_s, found_s)
    stages += _stage(KV_WAIT, requested_s, complete_s)
    stages += _stage(HAND_OFF, complete_s, end_s if complete_s is not None else None)
    return _timeline("decode", room, rank, stages, (seen_s, requested_s, end_s), attrs, error)
