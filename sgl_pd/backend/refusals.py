"""Requests the prefill server refuses at its door reach their decoder at once.

In the router flow both servers get the request. When the prefill server refuses its copy
(an invalid `logprob_start_len`, a prompt past its context, a session it does not know,
input embeddings with its radix cache on, ...), no prefill of it will ever run, while the
decoder has queued it and waits for its KV. Each refusal is turned into a failed room
here: every decode rank that asked, or asks later, hears the prefill server's reason and
ends the request with it, instead of waiting its transfer timeout.

On the decoder, SGLang ends such a request as a failed transfer (HTTP 500):
`around_decode_prepare_abort` gives the client the prefill server's reason as a 400, as
the prefill server (and a monolithic server) answers it.

Two doors on the prefill server: SGLang's prefill scheduler (`before_retire_unadmitted_request`,
`after_exceed_kv_capacity`), on each rank; and the HTTP process, which refuses some
requests before any scheduler sees them (`around_generate_request`): there every rank is
told through SGLang's own channel to its schedulers, as an `AbortReq` naming the room.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

from sgl_pd.config import BACKEND_NAME, sgl_pd_role

logger = logging.getLogger("sgl_pd.refusals")

# how a refusal's reason starts, as far as the client's answer
REFUSED_BY_PREFILL = "the prefill server refused the request: "
# An AbortReq whose rid starts so carries a room the HTTP process refused (no request's
# rid does: SGLang's are hex digests), and its reason
REFUSED_ROOM_RID = "sgl-pd-refused-room:"


def _our_prefill_manager(scheduler: Any) -> Any:
    """This prefill scheduler's sgl_pd manager, or None (another role or backend)."""
    if getattr(getattr(scheduler, "disaggregation_mode", None), "value", None) != "prefill":
        return None
    if getattr(getattr(scheduler, "transfer_backend", None), "value", None) != BACKEND_NAME:
        return None
    queue = getattr(scheduler, "disagg_prefill_bootstrap_queue", None)
    manager = getattr(queue, "kv_manager", None)
    return manager if getattr(manager, "prefill", None) is not None else None


def _refuse_room(manager: Any, room: int, why: str) -> None:
    manager.prefill.refuse(room, f"{REFUSED_BY_PREFILL}{why}")


def _refuse(manager: Any, req: Any, why: str) -> None:
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    room = getattr(req, "bootstrap_room", None)
    if room is None or getattr(req, "bootstrap_host", None) == FAKE_BOOTSTRAP_HOST:
        return  # no decoder behind it (SGLang's warm-up and health checks)
    _refuse_room(manager, int(room), why)


def refuse_request(scheduler: Any, req: Any, why: str) -> None:
    """On a prefill server of ours: the room of `req` (a request or a tokenized one) is
    refused with `why`, so a decoder waiting for its KV fails it at once."""
    manager = _our_prefill_manager(scheduler)
    if manager is not None:
        _refuse(manager, req, why)


def before_retire_unadmitted_request(scheduler: Any, req: Any, *args: Any, **kw: Any) -> None:
    """BEFORE hook of ``Scheduler.retire_unadmitted_request``: SGLang finishes a request
    its queues rejected at their door, with the reason in ``to_finish``."""
    manager = _our_prefill_manager(scheduler)
    if manager is None:
        return
    reason = getattr(req, "finished_reason", None) or getattr(req, "to_finish", None)
    _refuse(manager, req, str(getattr(reason, "message", None) or "rejected"))


def after_exceed_kv_capacity(result: Any, queue: Any, req: Any, *args: Any, **kw: Any) -> Any:
    """AFTER hook of ``PrefillBootstrapQueue._check_if_req_exceed_kv_capacity``: True
    means the prompt is longer than this server takes, and no sender will be made."""
    if result:
        manager = _our_prefill_manager(getattr(queue, "scheduler", None))
        if manager is not None:
            limit = getattr(queue, "max_input_len", "its limit")
            _refuse(manager, req, f"{len(req.origin_input_ids)} prompt tokens exceed {limit}")
    return result


async def around_generate_request(
    original: Any, manager: Any, obj: Any, request: Any = None
) -> AsyncIterator[Any]:
    """AROUND hook of ``TokenizerManager.generate_request``, on a prefill server of ours:
    a request of the router flow refused here, before any scheduler has seen it, is
    named to the schedulers, whose ranks fail its room (`around_abort_request`)."""
    room = getattr(obj, "bootstrap_room", None)
    if sgl_pd_role(manager.server_args) != "prefill" or not isinstance(room, int):
        async for out in original(manager, obj, request):
            yield out
        return
    answered = False
    try:
        async for out in original(manager, obj, request):
            answered = True
            yield out
    except Exception as e:
        if not answered:
            from sglang.srt.managers.io_struct import AbortReq

            notice = AbortReq(rid=f"{REFUSED_ROOM_RID}{room}", abort_message=str(e)[:2000])
            await manager._async_dispatch_to_scheduler(notice)
        raise


def around_abort_request(original: Any, scheduler: Any, recv_req: Any) -> Any:
    """AROUND hook of ``Scheduler.abort_request``: the HTTP process's notice of a room it
    refused (see `around_generate_request`) fails that room; any other abort is SGLang's."""
    rid = getattr(recv_req, "rid", None) or ""
    if not rid.startswith(REFUSED_ROOM_RID):
        return original(scheduler, recv_req)
    manager = _our_prefill_manager(scheduler)
    if manager is not None:
        room = int(rid[len(REFUSED_ROOM_RID) :])
        _refuse_room(manager, room, recv_req.abort_message or "rejected")
    return None


def around_decode_prepare_abort(
    original: Any, req: Any, error_message: str, status_code: Any = None
) -> Any:
    """AROUND hook of ``prepare_abort`` as SGLang's decode scheduler calls it: a transfer
    that failed because the prefill server refused the request answers the client with
    that server's reason and a 400, not a 500 naming the transfer."""
    from http import HTTPStatus

    at = error_message.find(REFUSED_BY_PREFILL)
    if at >= 0 and status_code == HTTPStatus.INTERNAL_SERVER_ERROR:
        return original(req, error_message[at:], status_code=HTTPStatus.BAD_REQUEST)
    return original(req, error_message, status_code=status_code)
