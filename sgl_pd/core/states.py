"""Request state machines of both roles: allowed transitions as data, clock-driven timeouts.

Decode side:   ALLOCATED -> REQUESTED -> TRANSFERRING -> COMPLETE -> HANDED_OFF
Prefill side:  WAITING_FOR_DECODER -> READY -> SENDING -> DONE
From every non-final state: FAILED, ABORTED, TIMED_OUT. A state with no way out is final.

A final state ends a request's *state*, not its writes: a request that failed while
writes were in flight keeps its pages until those writes have stopped (the backend
counts them; see the drain rule in `backend/prefill/drain.py` and the decoder's drain
acks).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Generic, TypeVar

from sgl_pd.core.clock import Clock
from sgl_pd.core.errors import DuplicateRequest, IllegalTransition, StateError, UnknownRequest

S = TypeVar("S", bound=enum.Enum)


class DecodeState(enum.Enum):
    ALLOCATED = "allocated"  # un-evictable destination pages held (D2)
    REQUESTED = "requested"  # TransferRequest sent to every prefill rank, nothing seen yet
    TRANSFERRING = "transferring"  # first chunk notice or completion word seen
    COMPLETE = "complete"  # every expected group and the metadata counted (D10)
    HANDED_OFF = "handed_off"  # given to the decode engine; the messenger is done with it
    FAILED = "failed"
    ABORTED = "aborted"
    TIMED_OUT = "timed_out"


class PrefillState(enum.Enum):
    WAITING_FOR_DECODER = "waiting_for_decoder"  # not every decode rank has asked yet
    READY = "ready"  # destinations known; waiting for the scheduler's first chunk (D5)
    SENDING = "sending"  # chunks are being written, layer by layer or after each forward
    DONE = "done"  # all writes, completion words and the metadata row done
    FAILED = "failed"
    ABORTED = "aborted"
    TIMED_OUT = "timed_out"


@dataclass(frozen=True)
class TransitionTable(Generic[S]):
    initial: S
    allowed: Mapping[S, frozenset[S]]  # every state is a key; final states map to {}
    timed_out: S  # where `poll_timeouts` moves expired requests

    def is_final(self, state: S) -> bool:
        return not self.allowed[state]


def _with_failures(
    forward: Mapping[S, frozenset[S]], failures: frozenset[S]
) -> dict[S, frozenset[S]]:
    table: dict[S, frozenset[S]] = {}
    for state, nexts in forward.items():
        table[state] = nexts | failures if nexts else nexts
    for state in failures:
        table[state] = frozenset()
    return table


_D = DecodeState
DECODE_TABLE: TransitionTable[DecodeState] = TransitionTable(
    initial=_D.ALLOCATED,
    allowed=_with_failures(
        {
            _D.ALLOCATED: frozenset({_D.REQUESTED}),
            _D.REQUESTED: frozenset({_D.TRANSFERRING}),
            _D.TRANSFERRING: frozenset({_D.COMPLETE}),
            _D.COMPLETE: frozenset({_D.HANDED_OFF}),
            _D.HANDED_OFF: frozenset(),
        },
        frozenset({_D.FAILED, _D.ABORTED, _D.TIMED_OUT}),
    ),
    timed_out=_D.TIMED_OUT,
)

_P = PrefillState
PREFILL_TABLE: TransitionTable[PrefillState] = TransitionTable(
    initial=_P.WAITING_FOR_DECODER,
    allowed=_with_failures(
        {
            _P.WAITING_FOR_DECODER: frozenset({_P.READY}),
            _P.READY: frozenset({_P.SENDING}),
            _P.SENDING: frozenset({_P.DONE}),
            _P.DONE: frozenset(),
        },
        frozenset({_P.FAILED, _P.ABORTED, _P.TIMED_OUT}),
    ),
    timed_out=_P.TIMED_OUT,
)


class MetadataWait(enum.Flag):
    """What a prefill request's metadata row (D9) still waits for before its job may be
    queued: the row is written behind the KV on each destination's FIFO queue, so every
    write of the last chunk must be queued first. Empty: due now; QUEUED: done once.

    The scheduler thread clears LAST_SEND (SGLang's last send filled the row) and, after
    a forward, the layers it queued; in layer-wise mode the streamer thread clears
    TARGET_LAYERS; each draft-model chunk noticed sets DRAFT_LAYERS again. All under the
    rooms' lock."""

    LAST_SEND = enum.auto()  # SGLang's last send: the metadata row is filled
    TARGET_LAYERS = enum.auto()  # every target-model layer of the last chunk is queued
    DRAFT_LAYERS = enum.auto()  # every draft-model layer of every chunk is queued
    QUEUED = enum.auto()  # the metadata jobs were handed out (terminal)


METADATA_DUE = MetadataWait(0)


@dataclass(frozen=True)
class Expired(Generic[S]):
    request_id: int
    state: S  # the state it overstayed
    waited_s: float


class RequestTracker(Generic[S]):
    """States of many requests of one role. `deadlines` gives the seconds a request may stay
    in a state (states absent: no limit); time comes only from `clock`."""

    def __init__(
        self, table: TransitionTable[S], deadlines: Mapping[S, float], clock: Clock
    ) -> None:
        for state, limit in deadlines.items():
            if table.is_final(state) or not limit > 0:
                raise StateError(f"deadline {limit} s for {state} (final states have none)")
        self._table = table
        self._deadlines = dict(deadlines)
        self._clock = clock
        self._entries: dict[int, tuple[S, float]] = {}  # id -> (state, entered at, s)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, request_id: int) -> None:
        if request_id in self._entries:
            raise DuplicateRequest(f"request {request_id} is already tracked")
        self._entries[request_id] = (self._table.initial, self._clock.monotonic())

    def state(self, request_id: int) -> S:
        return self._entry(request_id)[0]

    def transition(self, request_id: int, new: S) -> None:
        old = self._entry(request_id)[0]
        if new not in self._table.allowed[old]:
            allowed = sorted(s.name for s in self._table.allowed[old]) or ["nothing (final)"]
            raise IllegalTransition(
                f"request {request_id}: {old.name} -> {new.name} not allowed; {old.name} may go"
                f" to {', '.join(allowed)}"
            )
        self._entries[request_id] = (new, self._clock.monotonic())

    def progressed(self, request_id: int) -> None:
        """The request made progress: its state's deadline counts from now (a deadline
        bounds a stall, not a long transfer that keeps moving)."""
        state = self._entry(request_id)[0]
        if not self._table.is_final(state):
            self._entries[request_id] = (state, self._clock.monotonic())

    def forget(self, request_id: int) -> S:
        """Stop tracking a request; returns its last state."""
        state = self._entry(request_id)[0]
        del self._entries[request_id]
        return state

    def poll_timeouts(self) -> list[Expired[S]]:
        """Requests past their state's deadline, now moved to the table's timed-out state."""
        now = self._clock.monotonic()
        expired: list[Expired[S]] = []
        for request_id, (state, since) in self._entries.items():
            limit = self._deadlines.get(state)
            if limit is not None and now - since > limit:
                expired.append(Expired(request_id, state, now - since))
        for e in expired:
            self._entries[e.request_id] = (self._table.timed_out, now)
        return expired

    def _entry(self, request_id: int) -> tuple[S, float]:
        try:
            return self._entries[request_id]
        except KeyError:
            raise UnknownRequest(f"request {request_id} is not tracked") from None
