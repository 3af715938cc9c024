"""Every timing bound a safety argument of sgl_pd rests on, derived and checked in one place.

Seconds throughout. Two are the operator's (`--pd-hang-timeout`, `--pd-transfer-timeout`);
one is the transfer engine's; the rest follow from them:

- `engine_transfer_timeout_s`: a write posted to the engine has landed or failed within
  this long (Mooncake: 30 s, or ``MC_TRANSFER_TIMEOUT``, plus 1 s per GiB of the batch;
  sgl_pd's batches stay far under `LARGEST_BATCH_GIB`).
- `quarantine_s`: how long a request stays undrained (no drain ack, source pages pinned)
  after one of its write batches failed (why: `backend.prefill.drain`, `Drain.quarantine`):
  twice the engine's timeout.
- `deferred_release_s`: how long SGLang's decode scheduler keeps an early-ended request's
  pages waiting for the prefill ranks' drain acks before it frees them anyway. A prefill
  rank posts nothing for a request once it failed it, which it does at the latest when it
  declares the decoder hung (the hang timeout) or finds itself frozen (`FreezeWatch`, a
  margin before the hang timeout); a write it posted before lands within the engine's
  timeout; a failed batch's quarantine is over. So the pages wait at least
  ``max(hang + engine, quarantine)`` - the decoder's receive staging of such a request
  too. The backend raises SGLang's value to this when it is lower (`enforce_deferred_release`).
- `resend_interval_s` / `resend_max_interval_s`: a control message whose loss matters
  (`messenger.reliable`) is sent again at these intervals until acknowledged; it is given up
  only when its peer is declared lost, or `give_up_s` after it was first sent - past the
  hang timeout, so a peer paused for less than that (whose connections ZMQ dropped on its
  own 10 s heartbeat) still gets every message.
- `keep_alive_s`: an HTTP server keeps an idle connection longer than the router does
  (`ROUTER_POOL_IDLE_S`) plus the longest pause that must fail nothing (the hang timeout).

`TimingBounds.violations` lists each inequality that does not hold; the backend refuses to
start with the first one (`ConfigError`), never serves on a bound no code checked.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

ENGINE_TIMEOUT_ENV = "MC_TRANSFER_TIMEOUT"  # Mooncake's transfer timeout, seconds
ENGINE_DEFAULT_TIMEOUT_S = 30.0
ENGINE_MIN_TIMEOUT_S = 5.0  # Mooncake raises a smaller setting to this
LARGEST_BATCH_GIB = 4.0  # Mooncake adds 1 s per GiB of a batch
ROUTER_POOL_IDLE_S = 50.0  # sglang_router's HTTP client keeps idle connections this long
DEFERRED_RELEASE_ENV = "SGLANG_DISAGGREGATION_DEFERRED_DECODE_KV_RELEASE_TIMEOUT"
SGLANG_DEFERRED_RELEASE_S = 30.0  # SGLang's own default
DEFAULT_DEFERRED_RELEASE_S = 120.0  # what sgl_pd asks SGLang for (SGLang's own: 30 s)
FREEZE_MARGIN_S = 1.5  # a process gap this much shorter than the hang timeout is a freeze
RESEND_INTERVAL_S = 0.5
RESEND_MAX_INTERVAL_S = 2.0


def engine_transfer_timeout_s(environ: Mapping[str, str] = os.environ) -> float:
    """The longest a posted write may take to land or fail, on this host's settings."""
    try:
        base = float(environ.get(ENGINE_TIMEOUT_ENV, ENGINE_DEFAULT_TIMEOUT_S))
    except ValueError:
        base = ENGINE_DEFAULT_TIMEOUT_S
    return max(base, ENGINE_MIN_TIMEOUT_S) + LARGEST_BATCH_GIB


DEFAULT_ENGINE_TRANSFER_TIMEOUT_S = ENGINE_DEFAULT_TIMEOUT_S + LARGEST_BATCH_GIB


def failed_batch_quarantine_s(engine_transfer_timeout_s: float) -> float:
    """How long a request with a failed batch stays undrained: twice the engine's
    timeout, after which none of that batch's writes is still posted."""
    return 2 * engine_transfer_timeout_s


def freeze_limit_s(hang_timeout_s: float, margin_s: float = FREEZE_MARGIN_S) -> float:
    """A gap in a process's liveness beats longer than this is a freeze (`FreezeWatch`):
    `margin_s` before the hang timeout, never before half of it."""
    return max(hang_timeout_s / 2, hang_timeout_s - margin_s)


def deferred_release_s(environ: Mapping[str, str] = os.environ) -> float:
    """SGLang's deferred-release timeout as its decode scheduler reads it."""
    try:
        return float(environ.get(DEFERRED_RELEASE_ENV, SGLANG_DEFERRED_RELEASE_S))
    except ValueError:
        return SGLANG_DEFERRED_RELEASE_S


@dataclass(frozen=True)
class TimingBounds:
    hang_timeout_s: float  # a peer silent this long is hung (--pd-hang-timeout)
    transfer_timeout_s: float  # a request making no progress this long fails
    engine_transfer_timeout_s: float = DEFAULT_ENGINE_TRANSFER_TIMEOUT_S
    # what SGLang's decode scheduler will wait (its setting, after the backend raised it);
    # None on a prefill server, which frees nothing on a peer's behalf
    deferred_release_s: float | None = DEFAULT_DEFERRED_RELEASE_S
    keep_alive_s: float | None = None  # the HTTP server's, when known (the launcher's)

    @property
    def quarantine_s(self) -> float:
        return failed_batch_quarantine_s(self.engine_transfer_timeout_s)

    @property
    def required_deferred_release_s(self) -> float:
        """The least SGLang may wait before freeing an early-ended request's pages."""
        return max(self.hang_timeout_s + self.engine_transfer_timeout_s, self.quarantine_s)

    @property
    def staging_hold_s(self) -> float:
        """How long a forgotten request's receive staging is held (as its pages are)."""
        return max(self.deferred_release_s or 0.0, self.required_deferred_release_s)

    @property
    def freeze_limit_s(self) -> float:
        """A gap in this process's liveness beats longer than this is a freeze: its
        peers may be about to declare it hung, so its writers hold off."""
        return freeze_limit_s(self.hang_timeout_s)

    @property
    def resend_interval_s(self) -> float:
        return min(RESEND_INTERVAL_S, self.hang_timeout_s / 8)

    @property
    def resend_max_interval_s(self) -> float:
        return min(RESEND_MAX_INTERVAL_S, self.hang_timeout_s / 4)

    @property
    def give_up_s(self) -> float:
        """An unacknowledged control message is dropped this long after it was first
        sent (by then its request has timed out on both sides)."""
        return max(self.transfer_timeout_s, 2 * self.hang_timeout_s)

    @property
    def delivery_memory_s(self) -> float:
        """How long a receiver remembers a delivered control message, to tell a resent
        copy from a new message: longer than any sender resends one."""
        return 2 * self.give_up_s

    @property
    def required_keep_alive_s(self) -> float:
        return ROUTER_POOL_IDLE_S + self.hang_timeout_s

    def violations(self) -> list[str]:
        """Each inequality a safety argument needs that does not hold, as one line."""
        out = []
        if not self.hang_timeout_s > 0 or not self.transfer_timeout_s > 0:
            out.append("the hang and transfer timeouts must be > 0 s")
        deferred = self.deferred_release_s
        if deferred is not None and deferred < self.required_deferred_release_s:
            out.append(
                f"SGLang's deferred release of an ended request's pages waits"
                f" {deferred:g} s, less than the hang timeout plus the transfer"
                f" engine's timeout ({self.required_deferred_release_s:g} s): a write posted"
                " before a peer was declared hung could land in freed pages"
            )
        if self.give_up_s <= self.hang_timeout_s:
            out.append("control messages must be resent for longer than the hang timeout")
        if not 0 < self.resend_interval_s <= self.resend_max_interval_s < self.hang_timeout_s:
            out.append("control resends must come more often than the hang timeout")
        if not self.freeze_limit_s < self.hang_timeout_s:
            out.append("a freeze must be noticed before peers declare this process hung")
        if self.keep_alive_s is not None and self.keep_alive_s < self.required_keep_alive_s:
            out.append(
                f"the HTTP keep-alive ({self.keep_alive_s:g} s) must exceed the router's idle"
                f" connections plus the hang timeout ({self.required_keep_alive_s:g} s)"
            )
        return out
