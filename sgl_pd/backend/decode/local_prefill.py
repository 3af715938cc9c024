"""Decoder, local prefill: a request whose uncached suffix is short is prefilled by the
decode server itself instead of crossing the wire (`core.placement.prefill_locally`
decides; the request arrives with `LOCAL_HOST` as its bootstrap host).

SGLang's disaggregated decode loop runs only decode batches and the pre-built batches
of transferred requests. Here its scheduling step also runs SGLang's own prefill
scheduling (prefix match in the decoder's tree cache, `PrefillAdder`, `ScheduleBatch`,
sampling with the request's full state, as a monolithic server does) over a queue of
its own, with two limits that keep the running streams flowing - the reason PD exists:

- a local step computes at most `step_tokens` prompt tokens (SGLang's
  `max_prefill_tokens` and chunk size for that step: requests are sent here when their
  uncached suffix fits, and one that does not after all is chunked over several steps);
- the running streams decode in the same forward as the local chunk (SGLang's mixed
  chunk), so they get a token every step; where SGLang does not mix (logprob requests)
  the next step is their decode step, and it is SGLang's own whenever transferred
  requests wait to be admitted.

The finished local batch joins the running batch at the next step, exactly as SGLang's
monolithic loop merges its last prefill batch. Nothing of sgl_pd's transfer machinery
is involved: no room, no receiver, no prefill server.

Hooks (registered in `backend/registration.py`): ``Scheduler._add_request_to_queue``
routes local requests here, ``get_next_disagg_decode_batch_to_run`` interleaves local
steps, ``Scheduler.abort_request`` removes queued local requests (and ends one
mid-prefill at the next local step, as SGLang ends its own), ``pause_generation`` and
``DecodePreallocQueue.hold_rebootstrap`` give requests a retracting pause took back to
the local queue, to be recomputed here on resume.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

from sgl_pd.backend.first_token import queued_request_flags, whole_prompt_reason
from sgl_pd.backend.metrics import PlacementMetrics
from sgl_pd.core.dispatch import PrefillerLoad
from sgl_pd.core.placement import is_direct_room, prefill_locally

logger = logging.getLogger("sgl_pd.local_prefill")

LOCAL_HOST = "sgl-pd-local"  # the bootstrap host that marks a request prefilled here
_STATE = "_sgl_pd_local_prefills"  # the Scheduler attribute holding `LocalPrefills`


class LocalPrefills:
    """One decode scheduler's local prefill queue and its per-step token budget."""

    def __init__(
        self,
        max_tokens: int,
        *,
        step_tokens: int | None = None,
        prefix_cache: bool = False,
        metrics: bool = False,
        tracing: bool = False,
    ) -> None:
        self.max_tokens = max_tokens  # the largest uncached suffix prefilled here
        self.step_tokens = step_tokens or max_tokens  # prompt tokens a step carries
        self.prefix_cache = prefix_cache  # the decoder's tree cache holds conversations
        self.metrics = PlacementMetrics(metrics)  # router flow's local prefills
        self.tracing = tracing  # SGLang's --enable-trace: decisions go into request spans
        self.queue: list[Any] = []  # SGLang Reqs waiting for a local step, in arrival order
        self.launched: Any = None  # the last local step's ScheduleBatch, until merged
        self.chunked: Any = None  # the local request mid-prefill (SGLang's chunked_req)
        self.chunk_launched = False  # a chunk of it ran since its KV was last stashed
        self.last_mixed = False  # the last local step also decoded the running streams
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
    config = SglPdConfig.from_environment()
    limit = local_prefill_limit(server_args, config.local_prefill_max_tokens)
    if limit <= 0:
        return None
    step = config.local_prefill_step_tokens if config.local_prefill_step_tokens > 0 else limit
    logger.info(
        "local prefill on: suffixes of at most %d prompt tokens, %d per decode step", limit, step
    )
    return LocalPrefills(
        limit,
        step_tokens=step,
        prefix_cache=bool(getattr(server_args, "disaggregation_decode_enable_radix_cache", False)),
        metrics=bool(getattr(server_args, "enable_metrics", False)),
        tracing=bool(getattr(server_args, "enable_trace", False)),
    )


def around_add_request_to_queue(
    original: Any, scheduler: Any, req: Any, is_retracted: bool = False
) -> Any:
    """A local request waits in the local queue instead of the transfer queues. A local
    request retracted without a KV backup (it resumes by recomputing its KV) is
    recomputed here too: it has no prefill server to do it."""
    local = _state(scheduler)
    if local is None:
        return original(scheduler, req, is_retracted)
    if not is_local(req) and (is_retracted or not _router_request_here(scheduler, local, req)):
        return original(scheduler, req, is_retracted)
    if is_retracted and getattr(getattr(req, "kv", None), "retraction_backup", None) is not None:
        return original(scheduler, req, is_retracted)  # resumes from its host copy
    if not scheduler._set_or_validate_priority(req):
        scheduler._release_aborted_request(req)
        return None
    local.queue.append(req)
    req.time_stats.set_wait_queue_entry_time()
    return None


def _router_request_here(scheduler: Any, local: LocalPrefills, req: Any) -> bool:
    """Router flow: whether to prefill this request here, as its uncached suffix is
    short (`core.placement.prefill_locally`, with what this decoder's tree cache really
    holds); if so the prefill server, which has the request too, is told to skip it, and
    the request becomes a local one. Requests whose answer holds something the router
    takes from the prefill server's (input logprobs, whole-prompt features) are not."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    room = getattr(req, "bootstrap_room", None)
    if not local.prefix_cache or room is None or is_direct_room(int(room)):
        return False  # (direct mode decided where, in the HTTP process)
    if getattr(req, "bootstrap_host", None) in (None, FAKE_BOOTSTRAP_HOST) or req.output_ids:
        return False
    if getattr(req, "return_logprob", False):
        return False  # the router merges the prefill server's input logprobs
    if whole_prompt_reason(len(req.origin_input_ids), **queued_request_flags(req)) is not None:
        return False
    prompt = len(req.origin_input_ids)
    cached = _cached_tokens(scheduler.tree_cache, req)
    reason = prefill_locally(
        prompt, cached,
        max_tokens=local.max_tokens, loads=_UNKNOWN_PREFILLERS, saturated_tokens=sys.maxsize,
    )  # fmt: skip
    if reason is None:
        return False
    from sglang.srt.disaggregation.decode import _bootstrap_addr

    manager = scheduler.disagg_decode_prealloc_queue.kv_manager
    manager.skip_prefill(_bootstrap_addr(req), int(req.bootstrap_room))
    req.bootstrap_host = LOCAL_HOST
    if manager.rank == 0:
        local.metrics.local(reason)
        if local.tracing:
            from sgl_pd.backend.tracing import placement_span

            attrs = {
                "prefill": "local",
                "reason": reason,
                "prompt_tokens": prompt,
                "cached_tokens": cached,
            }
            placement_span(
                getattr(req.time_stats, "trace_ctx", None), int(req.bootstrap_room), attrs
            )
    return True


# the router flow's decoder does not see the prefill servers' queues
_UNKNOWN_PREFILLERS = {"router": PrefillerLoad(available=True, outstanding_tokens=0)}


def _cached_tokens(tree_cache: Any, req: Any) -> int:
    """The prompt tokens this decoder's tree cache holds (a lookup: nothing locked)."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.common import _req_radix_key

    key = _req_radix_key(tree_cache, req, req.origin_input_ids, None)
    return int(tree_cache.match_prefix(MatchPrefixParams(key=key, req=req)).device_prefix_len)


def around_get_next_batch(original: Any, scheduler: Any, running_batch: Any) -> Any:
    """AROUND hook of ``get_next_disagg_decode_batch_to_run``: merges the last local
    batch into the running one, then runs either a local step or SGLang's decode step."""
    local = _state(scheduler)
    if local is None:
        return original(scheduler, running_batch)
    last, local.launched = local.launched, None  # (it may become the running batch)
    # A retracting pause took the launched batch's requests (and cleared last_batch):
    # they are SGLang's to resume (`around_hold_rebootstrap`), not to merge.
    after_local = last is not None and last is scheduler.last_batch
    if after_local:
        # the request still mid-prefill stays out, as SGLang's own loop keeps it out
        last.filter_batch(reqs_to_exclude=[r for r in (local.chunked,) if r is not None])
        if not last.is_empty():  # (finished at their first token: gone)
            if running_batch.is_empty():
                running_batch = last
            else:
                running_batch.merge_batch(last)
    # the running streams advanced in the local step when it was mixed with their decode
    streams_wait = not running_batch.is_empty() and not (last is not None and local.last_mixed)
    sglang_waiting = after_local and (streams_wait or bool(scheduler.waiting_queue))
    if (local.queue or local.chunked is not None) and not sglang_waiting:
        step = _local_step(scheduler, local, running_batch)
        if step is not None:
            return step
    return original(scheduler, running_batch)


# the scheduler's attributes a local step sets for SGLang's prefill scheduling, and restores
_SWAPPED = (
    "waiting_queue", "chunked_req", "max_prefill_tokens", "chunked_prefill_size",
    "is_mixed_chunk", "enable_priority_preemption",
)  # fmt: skip


def _local_step(scheduler: Any, local: LocalPrefills, running_batch: Any) -> Any:
    """SGLang's prefill scheduling over the local queue, at most `step_tokens` prompt
    tokens (a longer suffix - the prediction was wrong, or a retracted request recomputes
    its output too - is chunked, one chunk per local step, as SGLang chunks prefills);
    None when nothing could be admitted (no free memory or request slot)."""
    saved = {name: getattr(scheduler, name) for name in _SWAPPED}
    # the running streams' decode rides in the same forward (SGLang's mixed chunk, which
    # it skips for logprob requests: those decode in the next step instead); preempting
    # running requests would hand remote ones back to the transfer queues
    for name, value in (
        ("waiting_queue", local.queue),
        ("chunked_req", local.chunked),
        ("max_prefill_tokens", local.step_tokens),
        ("chunked_prefill_size", local.step_tokens),
        ("is_mixed_chunk", True),
        ("enable_priority_preemption", False),
    ):
        setattr(scheduler, name, value)
    try:
        scheduler.process_pending_chunked_abort()  # (an abort `around_abort_request` saw)
        chunked = scheduler.chunked_req
        if chunked is not None and local.chunk_launched:
            if chunked.extend_end > chunked.prefix_len:
                scheduler.stash_chunked_request(chunked)  # its KV so far, for the next chunk
            local.chunk_launched = False
        plan = scheduler.get_new_batch_prefill(running_batch)
    finally:
        local.queue = scheduler.waiting_queue  # rebound without the admitted requests
        local.chunked = scheduler.chunked_req
        for name, value in saved.items():
            setattr(scheduler, name, value)
    batch = plan.batch_to_run
    if batch is None:
        return None
    local.launched = batch
    local.last_mixed = bool(getattr(batch, "decoding_reqs", None))
    local.chunk_launched = local.chunked is not None
    local.steps += 1
    batch = scheduler.dp_attn_adapter.maybe_prepare_mlp_sync_batch(batch)
    from sglang.srt.managers.schedule_batch import NextBatchPlan

    return NextBatchPlan(batch_to_run=batch, running_batch=plan.running_batch)


def around_pause_generation(original: Any, scheduler: Any, recv_req: Any) -> Any:
    """A retracting pause retracts SGLang's own request mid-prefill: the local one too."""
    local = _state(scheduler)
    if local is None or local.chunked is None or getattr(recv_req, "mode", None) != "retract":
        return original(scheduler, recv_req)
    chunked = local.chunked
    aborted = scheduler._pending_chunked_abort_req is chunked  # (its client is gone)
    saved, scheduler.chunked_req = scheduler.chunked_req, chunked
    try:
        return original(scheduler, recv_req)
    finally:
        local.chunked, local.chunk_launched = None, False
        scheduler.chunked_req = saved
        if aborted and chunked in local.queue:  # retracted into the queue: end it there
            from sglang.srt.managers.scheduler import _make_abort_req

            local.queue.remove(chunked)
            scheduler._pending_chunked_abort_req = None
            scheduler._release_aborted_request(chunked)
            scheduler.send_abort_output(_make_abort_req(chunked), chunked)


def around_hold_rebootstrap(original: Any, queue: Any, req: Any) -> Any:
    """A request a retracting pause took recomputes its KV on resume; a local one has no
    prefill server to do it, so it waits in the local queue with its output whole, as a
    retracted request does on a monolithic server."""
    local = _state(queue.scheduler)
    if local is None or not is_local(req):
        return original(queue, req)
    forced = getattr(req, "pd_rebootstrap_forced_output_id", None)
    if forced is not None:
        req.output_ids.append(forced)
        req.pd_rebootstrap_forced_output_id = None
    req.pd_rebootstrap_in_progress = False
    local.queue.append(req)
    return None


def around_abort_request(original: Any, scheduler: Any, recv_req: Any) -> Any:
    """Queued local requests hold nothing yet: they leave the queue and their client is
    told, as SGLang does for its own waiting queue. Running ones are SGLang's."""
    local = _state(scheduler)
    chunked = local.chunked if local is not None else None
    if chunked is not None and (recv_req.abort_all or chunked.rid.startswith(recv_req.rid)):
        scheduler._pending_chunked_abort_req = chunked  # ended at the next local step
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
