"""One log line per change of an idle server's KV pool: proof that no page leaked.

SGLang checks its pools for leaks whenever a scheduler goes idle
(``SchedulerInvariantChecker._check_all_pools``). We hook after that check and log
what it saw, once per change, so tests and operators can read the free counts:

    sgl_pd pool idle: used 0 tokens, available 32000, evictable 768, rooms 0,
        in flight 0, staging 0 bytes (no leak)

Rooms: requests this rank holds transfer state for; in flight: prefill, write jobs
running; decode, requests whose KV is still arriving; staging: bytes of the re-layout
staging area held (the messenger's last tick).
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("sgl_pd.pool")

POOL_LINE_PREFIX = "sgl_pd pool idle:"
_last_logged: tuple[int, int, int, int, int, int, bool] | None = None
_ran_batch_since_log = False
# (rooms, in flight, staging bytes held), set by the messenger's liveness tick
_live: tuple[int, int, int] = (0, 0, 0)


def note_live(rooms: int, in_flight: int, staging_bytes: int = 0) -> None:
    """The messenger's counts, for the next pool line (any thread: one assignment)."""
    global _live
    _live = (rooms, in_flight, staging_bytes)


def after_run_batch(result: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook of ``Scheduler.run_batch``: the next idle check is logged even when the
    pool looks as it did before (a decoder frees every page it received)."""
    global _ran_batch_since_log
    _ran_batch_since_log = True
    return result


def after_pool_check(result: Any, checker: Any, stats: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook of ``_check_all_pools``: returns SGLang's result untouched."""
    global _last_logged, _ran_batch_since_log
    has_leak = bool(result[0])
    seen = (
        int(stats.full_num_used),
        int(stats.full_available_size),
        int(stats.full_evictable_size),
        *_live,
        has_leak,
    )
    if seen != _last_logged or _ran_batch_since_log:
        _last_logged, _ran_batch_since_log = seen, False
        logger.info(
            "%s used %d tokens, available %d, evictable %d, rooms %d, in flight %d, "
            "staging %d bytes (%s)",
            POOL_LINE_PREFIX,
            *seen[:6],
            "LEAK" if has_leak else "no leak",
        )
    return result
