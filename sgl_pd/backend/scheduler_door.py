"""A request the scheduler cannot even build is refused, not fatal.

SGLang's scheduler builds a `Req` from each tokenized request it receives, and the
constructor checks some fields itself (`return_hidden_states` of the wrong type, for
one): a ValueError there ends the scheduler process - and with it the server, every
request in flight and, for a prefill server, the requests of every decoder it serves.
`core.request_limits` refuses the fields known to do that at the HTTP door; this is the
net under it, for a field nobody has found yet:

- `around_create_generation_req` marks an exception raised while building the `Req`
  (nothing is queued or allocated before it; a session request's session may already
  have been changed, as SGLang changes it first) as the request's own fault;
- `around_handle_generate_request` answers such a request with an abort of status 400
  naming the error, as SGLang answers requests its queues refuse; on a prefill server
  its room is refused too, so a decoder waiting for its KV fails it at once
  (`refusals`).

Every rank builds the same request from the same fields, so every rank refuses it.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from sgl_pd.log_limits import LogLimiter

logger = logging.getLogger("sgl_pd.scheduler_door")
_log = LogLimiter(logger)


class RequestNotBuilt(Exception):
    """The scheduler could not build a request from its fields."""


def around_create_generation_req(original: Callable[..., Any], scheduler: Any, *args: Any,
                                 **kwargs: Any) -> Any:  # fmt: skip
    """AROUND hook of ``Scheduler._create_generation_req`` (builds the `Req`)."""
    try:
        return original(scheduler, *args, **kwargs)
    except Exception as e:
        raise RequestNotBuilt(f"{type(e).__name__}: {e}") from e


def around_handle_generate_request(
    original: Callable[..., Any], scheduler: Any, recv_req: Any, *args: Any, **kwargs: Any
) -> Any:
    """AROUND hook of ``Scheduler.handle_generate_request``."""
    try:
        return original(scheduler, recv_req, *args, **kwargs)
    except RequestNotBuilt as e:
        if getattr(scheduler, "rust_server", None) is not None:
            raise  # (its abort path reads a built Req's fields: not for this request)
        _refuse(scheduler, recv_req, f"invalid request: {e}"[:1000])
        return None


def _refuse(scheduler: Any, recv_req: Any, message: str) -> None:
    from sglang.srt.managers.io_struct import AbortReq

    from sgl_pd.backend import refusals

    rid = getattr(recv_req, "rid", None)
    _log.warning("not built", "refused request %s, which the scheduler could not build: %s",
                 rid, message)  # fmt: skip
    refusals.refuse_request(scheduler, recv_req, message)  # (its decoder hears at once)
    abort = AbortReq(
        rid=rid,
        abort_message=message,
        finished_reason={
            "type": "abort",
            "message": message,
            "status_code": HTTPStatus.BAD_REQUEST,
        },
    )
    scheduler.send_abort_output(abort, recv_req)
