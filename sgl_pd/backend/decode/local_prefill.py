"""Decoder, local prefill: a request whose uncached suffix is short is prefilled by the
decode server itself instead of crossing the wire (`core.placement.prefill_locally`
decides; the request arrives with `LOCAL_HOST` as its bootstrap host).

SGLang's disaggregated decode loop runs only decode batches and the pre-built batches
of transferred requests. Here its scheduling step also runs SGLang's own prefill
scheduling (prefix match in the decoder's tree cache, `PrefillAdder`, `ScheduleBatch`,
sampling with the request's full state, as a monolithic server does) over a queue of
its own, with two limits that keep the running streams flowing - the reason PD exists:

- a local step computes at most `step_tokens` prompt tokens (SGLang's
  `max_prefill_tokens` for that step; a request is prefilled locally only when its
  uncached suffix fits, so no request is ever chunked here);
- after a local step the next one decodes whenever there are running streams, so a
  stream waits for at most one local step between two of its tokens.

The finished local batch joins the running batch at the next step, exactly as SGLang's
monolithic loop merges its last prefill batch. Nothing of sgl_pd's transfer machinery
is involved: no room, no receiver, no prefill server.

Hooks (registered in `backend/registration.py`): ``Scheduler._add_request_to_queue``
routes local requests here, ``get_next_disagg_decode_batch_to_run`` interleaves local
steps, ``Scheduler.abort_request`` removes queued local requests.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger("sgl_pd.local_prefill")

LOCAL_HOST = "sgl-pd-local"  # the bootstrap host that marks a request prefilled here
_STATE = "_sgl_pd_local_prefills"  # the Scheduler attribute holding `LocalPrefills`


class LocalPrefills:
    """One decode scheduler's local prefill queue and its per-step token budget."""

    def __init__(self, step_tokens: int) -> None:
        self.step_tokens = step_tokens
        self.queue: list[Any] = []  # SGLang Reqs waiting for a local step, in arrival order
        self.launched: Any = None  # the last local step's ScheduleBatch, until merged
        self.steps = 0  # local steps run


def is_local(req: Any) -> bool:
    return getattr(req, "bootstrap_host", None) == LOCAL_HOST


def _state(scheduler: Any) -> LocalPrefills | None:
    """This scheduler's local prefills; None unless it is an sgl_pd decoder that serves
    them (read once, at its first scheduling step)."""
    if not hasattr(scheduler, _STATE):
        setattr(scheduler, _STATE, _configured(scheduler))
    return getattr(scheduler, _STATE)


def _configured(scheduler: Any) -> LocalPrefills | None:
    from sgl_pd.backend.server_options import local_prefill_limit
    from sgl_pd.config import SglPdConfig, sgl_pd_role

    server_args = scheduler.server_args
    if sgl_pd_role(server_args) != "decode":
        return None
    configured = SglPdConfig.from_environment().local_prefill_max_tokens
    limit = local_prefill_limit(server_args, configured)
    if limit <= 0:
        return None
    logger.info("local prefill on: suffixes of at most %d prompt tokens, one step each", limit)
    return LocalPrefills(limit)


def around_add_request_to_queue(
    original: Any, scheduler: Any, req: Any, is_retracted: bool = False
) -> Any:
    """A local request waits in the local queue instead of the transfer queues. A local
    request retracted without a KV backup (it resumes by recomputing its KV) is
    recomputed here too: it has no prefill server to do it."""
    local = _state(scheduler)
    if local is None or not is_local(req):
        return original(scheduler, req, is_retracted)
    if is_retracted and getattr(getattr(req, "kv", None), "retraction_backup", None) is not None:
        return original(scheduler, req, is_retracted)  # resumes from its host copy
    if not scheduler._set_or_validate_priority(req):
        scheduler._release_aborted_request(req)
        return None
    local.queue.append(req)
    req.time_stats.set_wait_queue_entry_time()
    return None


def around_get_next_batch(original: Any, scheduler: Any, running_batch: Any) -> Any:
    """AROUND hook of ``get_next_disagg_decode_batch_to_run``: merges the last local
    batch into the running one, then runs either a local step or SGLang's decode step."""
    local = _state(scheduler)
    if local is None:
        return original(scheduler, running_batch)
    last, local.launched = local.launched, None  # (it may become the running batch)
    after_local = last is not None
    if last is not None:
        last.filter_batch()  # finished in its first token (max_new_tokens=1, stop, abort)
        if not last.is_empty():
            if running_batch.is_empty():
                running_batch = last
            else:
                running_batch.merge_batch(last)
    streams_waiting = after_local and not running_batch.is_empty()
    if local.queue and not streams_waiting:
        step = _local_step(scheduler, local, running_batch)
        if step is not None:
            return step
    return original(scheduler, running_batch)


def _local_step(scheduler: Any, local: LocalPrefills, running_batch: Any) -> Any:
    """SGLang's prefill scheduling over the local queue, under the step's token budget;
    None when nothing could be admitted (no free memory or request slot)."""
    saved = (
        scheduler.waiting_queue,
        scheduler.max_prefill_tokens,
        scheduler.chunked_prefill_size,
        scheduler.is_mixed_chunk,
    )
    scheduler.waiting_queue = local.queue
    scheduler.max_prefill_tokens = local.step_tokens
    scheduler.chunked_prefill_size = None  # a local request fits a step whole
    scheduler.is_mixed_chunk = False  # the decode step is the next one, on its own
    try:
        plan = scheduler.get_new_batch_prefill(running_batch)
    finally:
        local.queue = scheduler.waiting_queue  # rebound without the admitted requests
        (
            scheduler.waiting_queue,
            scheduler.max_prefill_tokens,
            scheduler.chunked_prefill_size,
            scheduler.is_mixed_chunk,
        ) = saved
    batch = plan.batch_to_run
    if batch is None:
        return None
    local.launched = batch
    local.steps += 1
    batch = scheduler.dp_attn_adapter.maybe_prepare_mlp_sync_batch(batch)
    from sglang.srt.managers.schedule_batch import NextBatchPlan

    return NextBatchPlan(batch_to_run=batch, running_batch=plan.running_batch)


def around_abort_request(original: Any, scheduler: Any, recv_req: Any) -> Any:
    """Queued local requests hold nothing yet: they leave the queue and their client is
    told, as SGLang does for its own waiting queue. Running ones are SGLang's."""
    local = _state(scheduler)
    if local is not None and local.queue:
        from sglang.srt.managers.scheduler import _make_abort_req

        kept = []
        for req in local.queue:
            if recv_req.abort_all or req.rid.startswith(recv_req.rid):
                scheduler._release_aborted_request(req)
                scheduler.send_abort_output(
                    _make_abort_req(req, finished_reason=recv_req.finished_reason), req
                )
                logger.debug("aborted queued local prefill %s", req.rid)
            else:
                kept.append(req)
        local.queue = kept
    return original(scheduler, recv_req)
