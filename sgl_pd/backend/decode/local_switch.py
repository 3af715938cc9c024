"""Decoder: local prefill turned down or off, and on again, while it serves - through
SGLang's own admin endpoint, with its admin key where one is set:

    curl -X POST http://DECODER/set_internal_state \\
         -d '{"server_args": {"pd_local_prefill_max_tokens": 0}}'

The value is the largest uncached suffix prefilled here from then on (0: none), at most
what the decoder started with (`--pd-local-prefill-max-tokens` as
`server_options.local_prefill_limit` capped it): the local machinery is built at start-up
or not at all, so a decoder started without local prefill answers SGLang's "not
supported". Both places that choose a request's prefill follow it: each scheduler rank
(router flow, `local_prefill._router_request_here`) and, once every rank took it, the
HTTP process (direct mode, `direct.DirectDispatcher`) - refused on a direct-mode decoder
with several HTTP workers, of which only the one asked would hear of it. Requests
already placed here are prefilled here; so are requests a retracting pause took back
(`local_prefill`). The tokens a local step carries stay as configured.

Hooks (registered in `backend/registration.py`): ``SchedulerInternalStateController.
_update_handlers`` adds the setting on each rank, ``TokenizerManager.set_internal_state``
passes it to the HTTP process's dispatcher.
"""

from __future__ import annotations

import logging
from typing import Any

SETTING = "pd_local_prefill_max_tokens"

logger = logging.getLogger("sgl_pd.local_switch")


def around_update_handlers(original: Any, controller: Any) -> dict[str, Any]:
    """AROUND hook of ``SchedulerInternalStateController._update_handlers``: SGLang's
    settings, and `SETTING` on a decoder that serves local prefill."""
    from sglang.srt.managers.scheduler_components.internal_state import (
        UpdateRejected,
        _UpdateHandler,
    )

    from sgl_pd.backend.decode.local_prefill import local_prefills_of

    handlers: dict[str, Any] = original(controller)
    local = local_prefills_of(controller.scheduler)
    if local is None:
        return handlers  # (SGLang: "Updating pd_local_prefill_max_tokens is not supported.")
    workers = _direct_mode_http_workers(controller.scheduler.server_args)

    def validate(key: str, value: Any) -> None:
        if workers > 1:  # (the answer reaches the worker that asked: the others place on)
            raise UpdateRejected(
                f"{key} is set at start-up on a direct-mode decoder with {workers} HTTP "
                "workers (--tokenizer-worker-num): each places its own requests"
            )
        if isinstance(value, bool) or not isinstance(value, int):
            raise UpdateRejected(f"{key} takes a whole number of tokens, not {value!r}")
        if not 0 <= value <= local.start_max_tokens:
            raise UpdateRejected(
                f"{key} is 0 (off) to {local.start_max_tokens} on this decoder "
                f"(its --pd-local-prefill-max-tokens), not {value}"
            )

    def apply(key: str, value: int) -> None:
        local.max_tokens = value
        logger.info("local prefill: suffixes of at most %d prompt tokens from now on", value)

    handlers[SETTING] = _UpdateHandler(validate, apply)
    return handlers


def _direct_mode_http_workers(server_args: Any) -> int:
    """The HTTP worker processes that place this decoder's requests (direct mode), each
    with its own dispatcher; 0 in the router flow, where the schedulers place them."""
    from sgl_pd.config import SglPdConfig

    if not SglPdConfig.from_environment().prefill_bootstrap:
        return 0
    return int(getattr(server_args, "tokenizer_worker_num", 1) or 1)


async def around_set_internal_state(original: Any, manager: Any, obj: Any) -> list[bool]:
    """AROUND hook of ``TokenizerManager.set_internal_state``: once every scheduler rank
    took `SETTING`, direct mode's placement in this HTTP process follows it too."""
    from sgl_pd.backend.decode import direct

    updated: list[bool] = await original(manager, obj)
    wanted = (getattr(obj, "server_args", None) or {}).get(SETTING)
    if wanted is not None and updated and all(updated):
        dispatcher = direct.dispatcher_of(manager)
        if dispatcher is not None:
            dispatcher.set_local_max_tokens(int(wanted))
    return updated
