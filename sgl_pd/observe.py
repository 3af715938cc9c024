"""Read-only transfer timestamps, the same for every PD transfer backend.

To compare backends (sgl_pd's and SGLang's own Mooncake backend) by the transfer time a
request's first token waits for, each side stamps the same two moments through the same
SGLang hooks, whatever backend moves the bytes:

- prefill server: the end of the forward that computed a request's last prompt chunk
  (AFTER ``Scheduler.run_batch``);
- decode server: the moment SGLang's decode transfer queue hands the request on with its
  KV and metadata complete (AFTER ``DecodeTransferQueue.pop_transferred``).

The hooks only read and log (``time.monotonic()``, shared by every process of a host):
one INFO line per request and side, ``sgl_pd observe: side=... room=... t=...``. They
are installed only when ``SGLPD_OBSERVE_TIMING=1``; otherwise this plugin does nothing.
It is its own entry point (``sgl_pd_observe``) so that an upstream-only server can load
it alone (``SGLANG_PLUGINS=sgl_pd_observe``).
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sgl_pd.environment import OBSERVE_TIMING, env_value

logger = logging.getLogger("sgl_pd.observe")

OBSERVE_ENV = OBSERVE_TIMING.name
LINE_PREFIX = "sgl_pd observe:"
_LINE = re.compile(rf"{LINE_PREFIX} side=(\w+) room=(\d+) t=([0-9.]+)")


def register() -> None:
    if env_value(OBSERVE_ENV) != "1":
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.run_batch", after_run_batch, HookType.AFTER
    )
    HookRegistry.register(
        "sglang.srt.disaggregation.decode.DecodeTransferQueue.pop_transferred",
        after_pop_transferred,
        HookType.AFTER,
    )
    logger.info("sgl_pd observer: logging transfer timestamps")


def _real(req: Any) -> bool:
    """A client's request, not SGLang's warm-up or health check (no peer behind those)."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    return getattr(req, "bootstrap_host", None) != FAKE_BOOTSTRAP_HOST and (
        getattr(req, "bootstrap_room", None) is not None
    )


def after_run_batch(result: Any, scheduler: Any, batch: Any, *args: Any, **kwargs: Any) -> Any:
    mode = getattr(getattr(scheduler, "disaggregation_mode", None), "value", None)
    if mode != "prefill" or batch is None or not batch.forward_mode.is_extend():
        return result
    now = time.monotonic()
    for req in batch.reqs:
        end = getattr(req, "extend_end", None)
        if _real(req) and end is not None and int(end) >= len(req.origin_input_ids):
            logger.info("%s side=forward_end room=%d t=%.6f", LINE_PREFIX, req.bootstrap_room, now)
    return result


def after_pop_transferred(result: Any, *args: Any, **kwargs: Any) -> Any:
    now = time.monotonic()
    for req in result or ():
        if _real(req):
            logger.info("%s side=kv_complete room=%d t=%.6f", LINE_PREFIX, req.bootstrap_room, now)
    return result


@dataclass(frozen=True)
class Stamp:
    side: str  # "forward_end" (prefill log) or "kv_complete" (decode log)
    room: int
    t: float  # time.monotonic(), seconds


def read_stamps(log: Path) -> list[Stamp]:
    """Every observer line of a server log, in order."""
    try:
        text = log.read_text(errors="replace")
    except FileNotFoundError:
        return []
    return [Stamp(m[1], int(m[2]), float(m[3])) for m in _LINE.finditer(text)]
