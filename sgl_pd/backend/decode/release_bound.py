"""The decode scheduler's deferred release, held to the bound sgl_pd's safety needs.

SGLang frees an early-ended request's pages once the prefill ranks acked its Abort, or
when its deferred-release timeout runs out (SGLang's default: 30 s, read once when its
decode transfer queue is made). Freed earlier than `TimingBounds.required_deferred_release_s`,
a write posted before a peer was declared hung could still land in them. The launcher
sets sgl_pd's value in the environment; a server started through SGLang's own launcher,
or with that variable set lower, is raised here to it (one log line), and the backend
refuses to start if this hook did not run (`SglPdKVManager`: the bounds are checked
against the environment this hook updates).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from sgl_pd.config import SglPdConfig, sgl_pd_role
from sgl_pd.core.bounds import DEFAULT_DEFERRED_RELEASE_S, DEFERRED_RELEASE_ENV, TimingBounds

logger = logging.getLogger("sgl_pd.decode")


def hold_deferred_release(queue: Any, bounds: TimingBounds) -> str | None:
    """Raises `queue`'s deferred release (SGLang's ``DecodeTransferQueue``) to what
    `bounds` need, turning it on if it was off; returns what changed, or None."""
    changed = []
    if not queue.enable_deferred_kv_release:
        queue.enable_deferred_kv_release = True
        changed.append("turned on")
    required = bounds.required_deferred_release_s
    current = float(queue.deferred_kv_release_timeout)
    if current < required:
        queue.deferred_kv_release_timeout = max(required, DEFAULT_DEFERRED_RELEASE_S)
        changed.append(f"raised from {current:g} s to {queue.deferred_kv_release_timeout:g} s")
    # the backend checks its bounds against the value that will run
    os.environ[DEFERRED_RELEASE_ENV] = f"{float(queue.deferred_kv_release_timeout):g}"
    return ", ".join(changed) or None


def after_transfer_queue_init(result: Any, queue: Any, *args: Any, **kwargs: Any) -> Any:
    """AFTER hook of ``DecodeTransferQueue.__init__``."""
    scheduler = kwargs.get("scheduler", args[2] if len(args) > 2 else None)
    server_args = getattr(scheduler, "server_args", None)
    if sgl_pd_role(server_args) != "decode":
        return result
    config = SglPdConfig.from_environment()
    changed = hold_deferred_release(queue, config.bounds(decode=True))
    if changed:
        logger.warning(
            "SGLang's deferred release of early-ended requests' pages %s: a write posted"
            " before a prefill rank was declared hung (--pd-hang-timeout %g s) lands within"
            " the transfer engine's timeout",
            changed,
            config.hang_timeout_s,
        )
    return result
