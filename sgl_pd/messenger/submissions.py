"""How a prefill server's registry answered each recent submission of a room (direct
mode), so that a submission resent by a client that stopped waiting is answered as the
first copy was and never handed to the prefill server twice (two prefill requests would
share one bootstrap room)."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass

from sgl_pd.core.clock import Clock
from sgl_pd.core.wire import ErrorCode, SubmitPrefill

# How long the registry remembers how it answered a room's submission. A client resends a
# submission only within SUBMIT_TIMEOUT_S of its first copy, so each copy is served at most
# that long plus the registry's backlog after the first: 60 s covers a backlog of 55 s. A
# room submitted again later is a new request (a decoder draws rooms at random, 63 bits).
SUBMISSION_MEMORY_S = 60.0
# rooms remembered at once: 32768 in 60 s is ~550 submissions/s, far above what one prefill
# server takes; at most ~8 MiB (a digest, a time and an answer per room)
MAX_REMEMBERED_SUBMISSIONS = 1 << 15


@dataclass(frozen=True)
class PastAnswer:
    """How the registry answered one room's submission."""

    at_s: float  # clock time of the answer
    digest: bytes  # of the submission (sender and request): a resent copy has the same
    refusal: tuple[ErrorCode, str] | None  # None: handed to the prefill server


class RecentSubmissions:
    """The answers to the submissions of the last `memory_s`, by room, at most `capacity`
    (the oldest go first). Not thread-safe: the registry thread owns it."""

    def __init__(
        self,
        clock: Clock,
        memory_s: float = SUBMISSION_MEMORY_S,
        capacity: int = MAX_REMEMBERED_SUBMISSIONS,
    ) -> None:
        self._clock = clock
        self._memory_s = memory_s
        self._capacity = capacity
        # (room, attempt) -> its answer, oldest first
        self._answers: OrderedDict[tuple[int, int], PastAnswer] = OrderedDict()

    def __len__(self) -> int:
        return len(self._answers)

    def recall(self, msg: SubmitPrefill) -> PastAnswer | None:
        """How a submission of `msg`'s room and attempt was answered within `memory_s`,
        if one was (a later attempt of a room is a new hand-off: `SubmitPrefill.attempt`)."""
        self._forget_old()
        return self._answers.get((msg.request_id, msg.attempt))

    def remember(self, msg: SubmitPrefill, refusal: tuple[ErrorCode, str] | None) -> None:
        self._forget_old()
        key = (msg.request_id, msg.attempt)
        self._answers[key] = PastAnswer(self._clock.monotonic(), digest(msg), refusal)
        self._answers.move_to_end(key)
        while len(self._answers) > self._capacity:
            self._answers.popitem(last=False)

    def _forget_old(self) -> None:
        horizon = self._clock.monotonic() - self._memory_s
        while self._answers:
            key, answered = next(iter(self._answers.items()))
            if answered.at_s > horizon:
                return
            del self._answers[key]


def digest(msg: SubmitPrefill) -> bytes:
    h = hashlib.blake2b(msg.sender.encode(), digest_size=16)
    h.update(b"\0")
    h.update(msg.request)
    return h.digest()
