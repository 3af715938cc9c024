"""Decoder, local prefill: a request whose uncached suffix is short is prefilled by the
decode server itself instead of crossing the wire (`core.placement.prefill_locally`
decides; the request arrives with `LOCAL_HOST` as its bootstrap host).

SGLang's disaggregated decode loop runs only decode batches and the pre-built batches
of transferred requests. Here its scheduling step also runs SGLang's own prefill
scheduling (prefix match in the decoder's tree cache, `PrefillAdder`, `ScheduleBatch`,
sampling with the request's full state, as a monolithic server does) over a queue of
its own, with limits that keep the running streams flowing - the reason PD exists:

- a local step computes at most the local tokens its ITL SLO allows
  (`local_pacing.StepPacer.plan`, from the steps this decoder measured), at least one
  page and at most `step_tokens` - except once in `burst_every` of the streams' gaps,
  when a step may carry `step_tokens` past the SLO (`core.local_budget.BurstAllowance`:
  the SLO holds for the streams' p99 gap) where that finishes the local work it
  carries; a longer suffix is chunked over several steps. SGLang's
  `max_prefill_tokens` and chunk size for the step are that budget plus, in a mixed step,
  the running streams' decode tokens, which SGLang's adder takes out again
  (`core.local_budget.adder_budget`): any number of streams admits local work;
- the running streams decode in the same forward as the local chunk (SGLang's mixed
  chunk) where that carries more local tokens within the SLO; otherwise, and where
  SGLang does not mix (logprob requests), the local chunk runs alone and the next step
  is their decode step; it is SGLang's own whenever transferred requests wait to be
  admitted. Local requests that no step could carry within the SLO go to a prefill
  server (`itl_slo`);
- a request goes local only while its first token is predicted sooner here than remote
  (`core.local_budget.why_sent_out`), and one that no step admitted within
  `ADMISSION_STEPS` steps, or that finds the local queue full (SGLang's
  --max-queued-requests), goes to a prefill server after all (`local_fallback`).

The finished local batch joins the running batch at the next step, exactly as SGLang's
monolithic loop merges its last prefill batch. Nothing of sgl_pd's transfer machinery
is involved: no room, no receiver, no prefill server.

Hooks (registered in `backend/registration.py`): ``Scheduler._add_request_to_queue``
routes local requests here, ``get_next_disagg_decode_batch_to_run`` interleaves local
steps and times every step, ``Scheduler.is_fully_idle`` sees local work,
``Scheduler.abort_request`` removes queued local requests (and ends one mid-prefill at
the next local step, as SGLang ends its own), ``pause_generation`` and
``DecodePreallocQueue.hold_rebootstrap`` give requests a retracting pause took back to
the local queue, to be recomputed here on resume.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from collections import deque
from pathlib import Path
from typing import Any

from sgl_pd.backend.decode.local_fallback import (
    LOCAL_HOST,
    Fallback,
    direct_fallback,
    is_local,
    send_out,
    skip_pending,
)
from sgl_pd.backend.decode.local_offer import offer_path, write_offer
from sgl_pd.backend.decode.local_pacing import StepPacer, step_shape, tp_rank
from sgl_pd.backend.first_token import (
    expected_kv_tokens,
    queued_request_flags,
    whole_prompt_reason,
)
from sgl_pd.backend.metrics import PlacementMetrics
from sgl_pd.core.dispatch import PrefillerLoad
from sgl_pd.core.local_budget import (
    ARRIVALS_OFFERED,
    LocalOffer,
    LocalStep,
    LocalWait,
    Models,
    RemoteCoefficients,
    adder_budget,
    burst_if_it_fits,
    local_first_token_s,
    offerable_room,
    why_sent_out,
)
from sgl_pd.core.placement import is_direct_room, prefill_locally

logger = logging.getLogger("sgl_pd.local_prefill")

_STATE = "_sgl_pd_local_prefills"  # the Scheduler attribute holding `LocalPrefills`
# rank 0 writes its offer at every model sync and at least this often: at 300 streams
# on this CPU a step takes 0.5 s, 32 of them 16 s, and the HTTP process takes no offer
# older than `local_offer.MAX_AGE_S` (every request would reach the scheduler unjudged)
OFFER_EVERY_S = 0.25


class LocalPrefills:
    """One decode scheduler's local prefill queue and its per-step token budget."""

    def __init__(
        self,
        max_tokens: int,
        *,
        step_tokens: int | None = None,
        itl_slo: float = 0.0,
        burst_every: int = 0,
        page_size: int = 1,
        overlap: bool = False,
        prefix_cache: bool = False,
        metrics: bool = False,
        tracing: bool = False,
        may_send_out: bool = True,
        offer_path: Path | None = None,
    ) -> None:
        # the largest uncached suffix prefilled here; turned down at run time to as low as
        # 0 and up to what it started with (`local_switch`)
        self.max_tokens = self.start_max_tokens = max_tokens
        self.step_tokens = step_tokens or max_tokens  # prompt tokens a step carries, at most
        self.pacer = StepPacer(
            cap=self.step_tokens,
            slo_factor=itl_slo,
            page_size=page_size,
            burst_every=burst_every,
            overlap=overlap,
        )
        # requests may go to a prefill server after all (`local_fallback`): the decoder
        # samples first tokens, so a prefill server's copy only computes KV
        self.may_send_out = may_send_out
        # direct mode, rank 0: where the HTTP process reads what a local request would
        # meet here (`local_offer`), to send one sooner remote at once
        self.offer_path = offer_path
        self.offer_written_s = -OFFER_EVERY_S  # (the pacer's clock)
        # the rooms of the last direct requests that reached this scheduler (`_offer`)
        self.arrived_rooms: deque[int] = deque(maxlen=ARRIVALS_OFFERED)
        self.fallbacks: dict[str, Fallback] = {}  # rid -> where it goes if not admitted
        self.uncached: dict[str, int] = {}  # rid -> its tokens to prefill here (queued)
        # (when queued, predicted seconds) of local requests whose last chunk ran in the
        # step just launched: observed once its results are out (the overlap scheduler
        # processes them an iteration later); how far predictions fall short
        self.first_tokens_due: list[tuple[float, float]] = []
        self.pauses = 0  # predictions made before a pause measure the pause: dropped
        self.wait = LocalWait()
        self.prefix_cache = prefix_cache  # the decoder's tree cache holds conversations
        self.metrics = PlacementMetrics(metrics)  # router flow's local prefills
        self.tracing = tracing  # SGLang's --enable-trace: decisions go into request spans
        self.queue: list[Any] = []  # SGLang Reqs waiting for a local step, in arrival order
        self.launched: Any = None  # the last local step's ScheduleBatch, until merged
        self.chunked: Any = None  # the local request mid-prefill (SGLang's chunked_req)
        self.chunk_launched = False  # a chunk of it ran since its KV was last stashed
        self.last_mixed = False  # the last local step also decoded the running streams
        self.steps = 0  # local steps run

    def busy(self, *, waiting: bool = True) -> bool:
        """Local work holds pages (a chunked request, a batch not merged yet) or, with
        `waiting`, requests wait for a step."""
        held = self.chunked is not None or self.launched is not None
        return held or (waiting and bool(self.queue))


def local_prefills_of(scheduler: Any) -> LocalPrefills | None:
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
    limit = local_prefill_limit(
        server_args, config.local_prefill_max_tokens, getattr(scheduler, "model_config", None)
    )
    if limit <= 0:
        return None
    step = config.local_prefill_step_tokens if config.local_prefill_step_tokens > 0 else limit
    slo, burst = config.local_prefill_itl_slo, config.local_prefill_burst_every
    within = f", steps within {slo:g}x a decode step" if slo else ""
    if slo and burst:
        within += f" but one in {burst}"
    logger.info(
        "local prefill on: suffixes of at most %d prompt tokens, at most %d per decode step%s",
        limit, step, within,
    )  # fmt: skip
    return LocalPrefills(
        limit,
        step_tokens=step,
        itl_slo=slo,
        burst_every=burst,
        page_size=int(getattr(scheduler, "page_size", 1) or 1),
        overlap=bool(getattr(scheduler, "enable_overlap", False)),
        prefix_cache=bool(getattr(server_args, "disaggregation_decode_enable_radix_cache", False)),
        metrics=bool(getattr(server_args, "enable_metrics", False)),
        tracing=bool(getattr(server_args, "enable_trace", False)),
        may_send_out=config.first_token == "decode",
        offer_path=(
            offer_path(int(server_args.port))
            if config.prefill_bootstrap and tp_rank(scheduler) == 0
            else None
        ),
    )


def around_add_request_to_queue(
    original: Any, scheduler: Any, req: Any, is_retracted: bool = False
) -> Any:
    """A local request waits in the local queue instead of the transfer queues - unless
    its first token is predicted sooner remote, or the local queue is full: then it goes
    to a prefill server (`local_fallback`). A local request retracted without a KV backup
    (it resumes by recomputing its KV) is recomputed here too: it has no prefill server
    to do it."""
    local = local_prefills_of(scheduler)
    if local is None:
        return original(scheduler, req, is_retracted)
    if is_retracted:
        if not is_local(req) or getattr(getattr(req, "kv", None), "retraction_backup", None):
            return original(scheduler, req, is_retracted)  # (a backup: from its host copy)
        fallback = None
    elif is_local(req):  # direct mode: placed by the HTTP process
        if offerable_room(req.bootstrap_room):  # (the offer tells it arrived)
            local.arrived_rooms.append(req.bootstrap_room)
        fallback = direct_fallback(req)
        if fallback is not None and not _sendable(local, req):
            fallback = None  # (its prefill server never saw it: nothing to skip)
    else:
        fallback = _router_request_here(scheduler, local, req)
        if fallback is None:
            return original(scheduler, req, is_retracted)
        if not _sendable(local, req):  # its prefill copy is still skipped once admitted
            fallback = dataclasses.replace(fallback, may_send=False)
    if not scheduler._set_or_validate_priority(req):
        scheduler._release_aborted_request(req)
        if fallback is not None:
            skip_pending(scheduler, fallback)
        return None
    # (a retracted request recomputes its output as well)
    uncached = (
        len(req.origin_input_ids)
        + len(req.output_ids or ())
        - (_cached_tokens(scheduler.tree_cache, req) if local.prefix_cache else 0)
    )
    # what the request meets here: the streams, the next step's plan, the local tokens
    # queued before it (for the placement and for the prediction it is measured by)
    streams = _streams(scheduler, local)
    ahead = _work_ahead(local)
    plan = burst_if_it_fits(
        local.pacer.plan(streams, can_mix=_can_mix(scheduler, req)), ahead + max(1, uncached)
    )
    if fallback is not None and fallback.may_send:
        pacer = local.pacer
        why = why_sent_out(
            pacer.step_model, _remote_now(scheduler, pacer), running=streams, tokens_ahead=ahead,
            tokens=uncached, plan=plan, local_share=pacer.share.value,
            local_bias=pacer.local_bias,
        )  # fmt: skip
        if why is None and _queue_full(scheduler, local):
            why = "queue_full"
        if why is not None:
            _sent_out(scheduler, local, req, fallback, why)
            return None
    elif (
        not is_retracted
        and _queue_full(scheduler, local)
        and _refused_for_space(scheduler, local, req)
    ):
        return None
    local.queue.append(req)
    if fallback is not None:
        local.fallbacks[req.rid] = fallback
    local.uncached[req.rid] = max(0, uncached)
    if not is_retracted and not req.output_ids:  # (a retracted one recomputes its output too)
        _remember_prediction(local, req, streams, ahead, max(0, uncached), plan)
    req.time_stats.set_wait_queue_entry_time()
    return None


def _work_ahead(local: LocalPrefills) -> int:
    """The local tokens a step computes before those of a request queued now: what the
    request mid-prefill has left, and each queued request's uncached tokens (a request
    a pause handed back recomputes its whole prompt and output)."""
    return _chunked_left(local) + sum(_queued_work(local, r) for r in local.queue)


def _step_work(local: LocalPrefills) -> int:
    """The local tokens the next steps compute for the work waiting: `_work_ahead`, but
    a whole prefix hit counts as the one token SGLang computes again."""
    return _chunked_left(local) + sum(max(1, _queued_work(local, r)) for r in local.queue)


def _chunked_left(local: LocalPrefills) -> int:
    """What the request mid-prefill has left to compute (none: 0)."""
    return 0 if local.chunked is None else _tokens_left(local.chunked)


def _queued_work(local: LocalPrefills, req: Any) -> int:
    """The local tokens a queued request needs: its uncached tokens as placed (a request
    a pause handed back was never placed: its whole prompt and output)."""
    return local.uncached.get(req.rid, _tokens_left(req))


def _tokens_left(req: Any) -> int:
    """The tokens of `req`'s prompt and output no step computed yet (none scheduled: all;
    a chunked request: from the end of its last chunk on)."""
    done = getattr(req, "extend_end", None) or getattr(req, "prefix_len", 0) or 0
    return max(0, len(req.origin_input_ids) + len(req.output_ids or ()) - int(done))


def _sendable(local: LocalPrefills, req: Any) -> bool:
    """Whether a prefill server may prefill `req` instead: a fresh request whose answer
    needs nothing only a whole-prompt prefill gives (its copy there computes KV only;
    output logprobs come from the decoder's steps, the first one's included)."""
    if not local.may_send_out or req.output_ids:
        return False
    if getattr(req, "lora_id", None) is not None:
        return False  # (SGLang's recompute body, which a sent-out request uses, has no adapter)
    return whole_prompt_reason(len(req.origin_input_ids), **queued_request_flags(req)) is None


def _streams(scheduler: Any, local: LocalPrefills) -> int:
    """The streams decoding on this decoder now. Between a mixed local step and the next
    iteration they are in that step's batch, and SGLang's running batch is empty."""
    running = len(scheduler.running_batch.reqs)
    if local.launched is not None and local.last_mixed:
        running += len(getattr(local.launched, "decoding_reqs", None) or ())
    return running


_PREDICTION = "_sgl_pd_first_token_predicted"  # Req attribute: (pauses, queued at, seconds)


def _remember_prediction(
    local: LocalPrefills, req: Any, streams: int, ahead: int, uncached: int, plan: LocalStep
) -> None:
    """When `req` (just queued behind `ahead` local tokens, `streams` running, the next
    step as `plan`) was queued and its first token's predicted seconds, on the request
    itself (it leaves with it: sent out, aborted or answered). Not for a request with
    nothing to prefill but what SGLang computes again of a prompt held whole (its last
    token, or page; two tokens over EAGLE's bigram keys) and nothing queued before it:
    its first token is one step's fixed costs, whose error would scale every prefill's
    prediction (`LocalBias` is a ratio), and one step here is always far sooner than
    remote."""
    pacer = local.pacer
    if pacer.step_model is None or (ahead == 0 and uncached <= max(2, pacer.page_size)):
        return
    seconds = local_first_token_s(
        pacer.step_model, streams, ahead, uncached, plan, pacer.share.value
    )
    setattr(req, _PREDICTION, (local.pauses, pacer.now(), seconds))


def _first_tokens_came(local: LocalPrefills, batch: Any | None) -> None:
    """A scheduling iteration begins after `batch` (None: not a local step): each local
    request whose last chunk it ran is due its first token - now without the overlap
    scheduler (the step's results were processed), an iteration later with it. The due
    ones are measured against their predictions (not the running streams mixed in, nor
    the request still mid-prefill, nor predictions made before a pause)."""
    now = local.pacer.now()
    if local.pacer.overlap:  # the last iteration's due ones: their results are out now
        for queued_s, predicted_s in local.first_tokens_due:
            local.pacer.bias.observe(predicted_s, now - queued_s)
        local.first_tokens_due = []
    if batch is None:
        return
    decoding = {id(r) for r in getattr(batch, "decoding_reqs", None) or ()}
    due = []
    for req in batch.reqs:
        if id(req) in decoding or req is local.chunked:
            continue
        prediction = getattr(req, _PREDICTION, None)
        if prediction is not None:
            setattr(req, _PREDICTION, None)
            pauses, queued_s, predicted_s = prediction
            if pauses == local.pauses:
                due.append((queued_s, predicted_s))
    if local.pacer.overlap:
        local.first_tokens_due = due
    else:
        for queued_s, predicted_s in due:
            local.pacer.bias.observe(predicted_s, now - queued_s)


def _can_mix(scheduler: Any, *reqs: Any) -> bool:
    """Whether SGLang would mix a local step of `reqs` into the running streams' decode:
    not where either side asks for logprobs. (SGLang has rarer reasons not to - input
    embeddings, too little memory for the streams' next tokens: such a step runs unmixed
    at a mixed step's size, past the SLO by a decode step.)"""
    if getattr(scheduler.running_batch, "return_logprob", False):
        return False
    return not any(getattr(r, "return_logprob", False) for r in reqs if r is not None)


def _queue_full(scheduler: Any, local: LocalPrefills) -> bool:
    limit = getattr(scheduler, "max_queued_requests", None)
    return limit is not None and len(local.queue) + 1 > limit


def _refused_for_space(scheduler: Any, local: LocalPrefills, req: Any) -> bool:
    """SGLang's queue limit over the local queue (it may end a queued request of lower
    priority instead): True when `req` itself was refused."""
    saved, scheduler.waiting_queue = scheduler.waiting_queue, local.queue
    try:
        refused = bool(scheduler._abort_on_queued_limit(req))
    finally:
        local.queue, scheduler.waiting_queue = scheduler.waiting_queue, saved
    if refused:
        scheduler._release_aborted_request(req)
    _forget_gone(scheduler, local)
    return refused


def _sent_out(scheduler: Any, local: LocalPrefills, req: Any, fallback: Fallback, why: str) -> None:
    setattr(req, _PREDICTION, None)  # (its first token will not be a local one)
    local.fallbacks.pop(req.rid, None)
    local.uncached.pop(req.rid, None)
    local.wait.forget(req.rid)
    if scheduler.disagg_decode_prealloc_queue.kv_manager.rank == 0:
        local.metrics.sent_out(why)
    send_out(scheduler, req, fallback, why)


def _forget_gone(scheduler: Any, local: LocalPrefills) -> None:
    """Requests no longer queued were admitted or ended: a router request's prefill
    server is told to skip its copy (`local_fallback.skip_pending`), and the local
    bookkeeping of each is dropped."""
    queued = {r.rid for r in local.queue}
    for rid in [rid for rid in local.fallbacks if rid not in queued]:
        skip_pending(scheduler, local.fallbacks.pop(rid))
    for rid in [rid for rid in local.uncached if rid not in queued]:
        del local.uncached[rid]


def _router_request_here(scheduler: Any, local: LocalPrefills, req: Any) -> Fallback | None:
    """Router flow: whether to prefill this request here, as its uncached suffix is
    short (`core.placement.prefill_locally`, with what this decoder's tree cache really
    holds); if so the request becomes a local one, and its prefill server - which has
    the request too, waiting for this decoder - is its fallback: told to skip its copy
    once a local step admitted it (`local_fallback`). Requests whose answer holds
    something the router takes from the prefill server's (input logprobs, whole-prompt
    features) are not."""
    from sglang.srt.disaggregation.utils import FAKE_BOOTSTRAP_HOST

    room = getattr(req, "bootstrap_room", None)
    if not local.prefix_cache or room is None or is_direct_room(int(room)):
        return None  # (direct mode decided where, in the HTTP process)
    if getattr(req, "bootstrap_host", None) in (None, FAKE_BOOTSTRAP_HOST) or req.output_ids:
        return None
    if getattr(req, "return_logprob", False):
        return None  # the router merges the prefill server's input logprobs
    if whole_prompt_reason(len(req.origin_input_ids), **queued_request_flags(req)) is not None:
        return None
    prompt = len(req.origin_input_ids)
    cached = _cached_tokens(scheduler.tree_cache, req)
    reason = prefill_locally(
        prompt, cached,
        max_tokens=local.max_tokens, loads=_UNKNOWN_PREFILLERS, saturated_tokens=sys.maxsize,
    )  # fmt: skip
    if reason is None:
        return None
    fallback = Fallback(req.bootstrap_host, int(req.bootstrap_port), int(room), submit=False)
    req.bootstrap_host = LOCAL_HOST
    if scheduler.disagg_decode_prealloc_queue.kv_manager.rank == 0:
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
    return fallback


# the router flow's decoder does not see the prefill servers' queues
_UNKNOWN_PREFILLERS = {"router": PrefillerLoad(available=True, outstanding_tokens=0)}


def _cached_tokens(tree_cache: Any, req: Any) -> int:
    """The tokens of `req` (its prompt, and the output of one retracted) this decoder's
    tree cache serves it, as SGLang's own match will find them (a lookup: nothing
    locked): what the tree holds up to SGLang's limit - never the last token, nor any
    from a `logprob_start_len` on (those logprobs are computed) - in whole pages, over
    EAGLE's bigram keys where it drafts."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.common import _req_radix_key

    tokens = req.origin_input_ids + req.output_ids if req.output_ids else req.origin_input_ids
    limit = req._compute_max_prefix_len(len(tokens))
    key = _req_radix_key(tree_cache, req, tokens, limit)
    return int(tree_cache.match_prefix(MatchPrefixParams(key=key, req=req)).device_prefix_len)


def around_get_next_batch(original: Any, scheduler: Any, running_batch: Any) -> Any:
    """AROUND hook of ``get_next_disagg_decode_batch_to_run``: times the step that just
    ended, merges the last local batch into the running one, sends out local requests
    that waited too long, then runs either a local step or SGLang's decode step."""
    local = local_prefills_of(scheduler)
    if local is None:
        return original(scheduler, running_batch)
    manager = scheduler.disagg_decode_prealloc_queue.kv_manager
    local.pacer.stepped(scheduler, manager.decode.remote_cost)
    if local.offer_path is not None and _offer_due(local):
        _offer(scheduler, local, local.offer_path)
    waiting = bool(local.queue) or local.chunked is not None
    plan = _next_batch(original, scheduler, local, running_batch)
    ran_local = local.launched is not None  # (set by a local step only)
    if waiting and (ran_local or local.queue or local.chunked is not None):
        # (an iteration that sent every waiting request out had no local work left)
        local.pacer.share.observe(ran_local)
    if plan.batch_to_run is not None:
        local.pacer.launched(*step_shape(plan.batch_to_run))
    return plan


def _remote_now(scheduler: Any, pacer: StepPacer) -> RemoteCoefficients | None:
    """The remote model a request is judged by: as rank 0 last synced it, behind the
    remote prefills in flight now (`_remote_tokens_in_flight`: alike on every rank of a
    TP group, which must judge alike)."""
    remote = pacer.remote_model
    if remote is None:
        return None
    return remote.behind(_remote_tokens_in_flight(scheduler))


def _remote_tokens_in_flight(scheduler: Any) -> int:
    """The tokens this decoder waits for remote prefills to compute now: of its requests
    in SGLang's transfer queue (pages held, KV awaited), the KV each needs less what its
    prefix cache held - the count `RemoteCost.started` learns the queue's cost by. The
    same on every rank of a TP group: SGLang takes a request off that queue only when
    every rank's KV has landed (a poll all-reduced over the group), and each rank's
    tree holds the same prefixes. (Each rank's own in-flight count ends a transfer when
    its own part landed: it differs between ranks.)"""
    queue = getattr(scheduler, "disagg_decode_transfer_queue", None)
    tokens = 0
    for decode_req in getattr(queue, "queue", None) or ():
        match = getattr(decode_req, "prefix_match", None)
        held = int(getattr(match, "decode_prefix_len", 0) or 0) if match is not None else 0
        tokens += max(0, expected_kv_tokens(decode_req.req) - held)
    return tokens


def _offer_due(local: LocalPrefills) -> bool:
    """Whether rank 0 writes its offer in this iteration (then it counts as written):
    the models were just synced, or `OFFER_EVERY_S` passed since the last."""
    now = local.pacer.now()
    if not local.pacer.synced_now and now - local.offer_written_s < OFFER_EVERY_S:
        return False
    local.offer_written_s = now
    return True


def _offer(scheduler: Any, local: LocalPrefills, path: Path) -> None:
    """What a local request would meet here now, for the HTTP process (`local_offer`)."""
    pacer = local.pacer
    offer = LocalOffer(
        written_s=time.time(),
        models=Models(pacer.step_model, pacer.remote_model, pacer.local_bias),
        running=_streams(scheduler, local),
        tokens_ahead=_work_ahead(local),
        local_share=pacer.share.value,
        burst_ready=pacer.burst.ready,
        slo_factor=pacer.slo_factor,
        cap=pacer.cap,
        page_size=pacer.page_size,
        can_mix=_can_mix(scheduler),
        may_send_out=local.may_send_out,
        arrived_rooms=_past_the_queue(local),
    )
    write_offer(path, offer)


def _past_the_queue(local: LocalPrefills) -> tuple[int, ...]:
    """The rooms of the direct requests that reached this scheduler and left its local
    queue since (launched in a local step, sent out, aborted): the burst the offer tells
    of accounts for them. A request still queued is left out - its step, which may spend
    the burst, is yet to launch."""
    queued = {getattr(req, "bootstrap_room", None) for req in local.queue}
    return tuple(room for room in local.arrived_rooms if room not in queued)


def _next_batch(original: Any, scheduler: Any, local: LocalPrefills, running_batch: Any) -> Any:
    last, local.launched = local.launched, None  # (it may become the running batch)
    # A retracting pause took the launched batch's requests (and cleared last_batch):
    # they are SGLang's to resume (`around_hold_rebootstrap`), not to merge.
    after_local = last is not None and last is scheduler.last_batch
    _first_tokens_came(local, last if after_local else None)
    if after_local:
        # the request still mid-prefill stays out, as SGLang's own loop keeps it out
        last.filter_batch(reqs_to_exclude=[r for r in (local.chunked,) if r is not None])
        if not last.is_empty():  # (finished at their first token: gone)
            if running_batch.is_empty():
                running_batch = last
            else:
                running_batch.merge_batch(last)
    _send_out_unadmitted(scheduler, local)
    # the running streams advanced in the local step when it was mixed with their decode
    streams_wait = not running_batch.is_empty() and not (last is not None and local.last_mixed)
    sglang_waiting = after_local and (streams_wait or bool(scheduler.waiting_queue))
    if (local.queue or local.chunked is not None) and not sglang_waiting:
        plan = _plan(scheduler, local, running_batch)
        if not plan.within_slo:  # (the costs changed since they were placed here)
            _send_out_queued(scheduler, local, {r.rid for r in local.queue}, "itl_slo")
            plan = _plan(scheduler, local, running_batch)
            if not plan.within_slo:  # what may not go out (a request mid-prefill too)
                plan = _plan(scheduler, local, running_batch, past_slo=True)
        elif plan.then is not None and not plan.then.within_slo:
            # a burst, after which no step fits the SLO: what it cannot finish goes out
            _send_out_queued(scheduler, local, _past_the_burst(local, plan.tokens), "itl_slo")
            plan = _plan(scheduler, local, running_batch)
        if local.queue or local.chunked is not None:  # (those that may not go out)
            step = _local_step(scheduler, local, running_batch, plan)
            if step is not None:
                return step
            if running_batch.batch_is_full:
                _send_out_for_room(scheduler, local)
    return original(scheduler, running_batch)


def _plan(
    scheduler: Any, local: LocalPrefills, running_batch: Any, *, past_slo: bool = False
) -> LocalStep:
    """The next local step's plan (`past_slo`: `StepPacer.plan`'s). Mixed only where
    SGLang will mix whatever the step admits: no request waiting (or mid-prefill) asks
    for logprobs."""
    can_mix = _can_mix(scheduler, local.chunked, *local.queue)
    return local.pacer.plan(
        len(running_batch.reqs),
        can_mix=can_mix,
        to_run=True,
        past_slo=past_slo,
        work=_step_work(local),
    )


def _past_the_burst(local: LocalPrefills, burst_tokens: int) -> set[str]:
    """The queued requests a burst step of `burst_tokens` would not finish (the request
    mid-prefill comes first, then the queue in its order)."""
    done = _chunked_left(local)
    past = set()
    for req in local.queue:
        done += max(1, _queued_work(local, req))
        if done > burst_tokens:
            past.add(req.rid)
    return past


def _send_out_unadmitted(scheduler: Any, local: LocalPrefills) -> None:
    """One more scheduling step passed: the local requests no step admitted within
    `ADMISSION_STEPS` go to a prefill server (those that may: the rest wait, as SGLang's
    own queue waits for memory)."""
    late = set(local.wait.waited([r.rid for r in local.queue]))
    _send_out_queued(scheduler, local, late, "unadmitted")


def _send_out_for_room(scheduler: Any, local: LocalPrefills) -> None:
    """A local step admitted nothing for want of a request slot or memory (SGLang's
    `batch_is_full`, cleared when a request leaves). Transferred requests take the room
    that frees first (SGLang admits them before this step runs), so a local request would
    lose every race until the transfer queues are empty: those that may go out join the
    transfer queue's order now instead of after `ADMISSION_STEPS` lost steps."""
    _send_out_queued(scheduler, local, {r.rid for r in local.queue}, "no_room")


def _send_out_queued(scheduler: Any, local: LocalPrefills, rids: set[str], why: str) -> None:
    """The queued requests of `rids` that may go to a prefill server go there."""
    for req in [r for r in local.queue if r.rid in rids]:
        fallback = local.fallbacks.get(req.rid)
        if fallback is not None and fallback.may_send:
            local.queue.remove(req)
            _sent_out(scheduler, local, req, fallback, why)


# the scheduler's attributes a local step sets for SGLang's prefill scheduling, and
# restores; what each swap protects:
# - waiting_queue, chunked_req: SGLang's prefill scheduling runs over the local queue and
#   its request mid-prefill, never over SGLang's own (empty on a decoder);
# - max_prefill_tokens, chunked_prefill_size: the step's local tokens (plus the mixed
#   decode tokens SGLang's adder takes out again), not a prefill server's chunk;
# - is_mixed_chunk: whether the running streams decode in the same forward (the step's
#   plan), not the server's --enable-mixed-chunk;
# - enable_priority_preemption: preempting running requests would hand remote ones back
#   to the transfer queues.
_SWAPPED = (
    "waiting_queue", "chunked_req", "max_prefill_tokens", "chunked_prefill_size",
    "is_mixed_chunk", "enable_priority_preemption",
)  # fmt: skip


def _local_step(scheduler: Any, local: LocalPrefills, running_batch: Any, plan: LocalStep) -> Any:
    """SGLang's prefill scheduling over the local queue, at most the step's local token
    budget (a longer suffix - the prediction was wrong, or a retracted request recomputes
    its output too - is chunked, one chunk per local step, as SGLang chunks prefills),
    mixed into the streams' decode as `plan` says; None when nothing could be admitted
    (no free memory or request slot)."""
    budget = adder_budget(plan.tokens, len(running_batch.reqs), mixed=plan.mixed)
    saved = {name: getattr(scheduler, name) for name in _SWAPPED}
    for name, value in (
        ("waiting_queue", local.queue),
        ("chunked_req", local.chunked),
        ("max_prefill_tokens", budget),
        ("chunked_prefill_size", budget),
        ("is_mixed_chunk", plan.mixed),
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
        prefill = scheduler.get_new_batch_prefill(running_batch)
    finally:
        local.queue = scheduler.waiting_queue  # rebound without the admitted requests
        local.chunked = scheduler.chunked_req
        for name, value in saved.items():
            setattr(scheduler, name, value)
    batch = prefill.batch_to_run
    if batch is None:
        return None
    _forget_gone(scheduler, local)  # admitted: a router request's prefill copy goes
    mixed = {id(r) for r in getattr(batch, "decoding_reqs", None) or ()}
    local.launched = batch
    local.last_mixed = bool(mixed)
    local.chunk_launched = local.chunked is not None
    local.steps += 1
    if scheduler.disagg_decode_prealloc_queue.kv_manager.rank == 0:
        local.metrics.stepped(local.last_mixed)
    batch = scheduler.dp_attn_adapter.maybe_prepare_mlp_sync_batch(batch)
    from sglang.srt.managers.schedule_batch import NextBatchPlan

    return NextBatchPlan(batch_to_run=batch, running_batch=prefill.running_batch)


def around_is_fully_idle(original: Any, scheduler: Any, *args: Any, **kw: Any) -> bool:
    """SGLang's idle check (health, cache flush, weight updates) sees local work: a
    chunked request or an unmerged local batch holds pages, queued requests wait."""
    idle = bool(original(scheduler, *args, **kw))
    local = getattr(scheduler, _STATE, None)
    if not idle or local is None:
        return idle
    ignore_waiting = bool(kw.get("ignore_waiting", args[1] if len(args) > 1 else False))
    return not local.busy(waiting=not ignore_waiting)


def around_pause_generation(original: Any, scheduler: Any, recv_req: Any) -> Any:
    """A retracting pause retracts SGLang's own request mid-prefill: the local one too.
    Any pause ends the step timing in flight, and a retracting one the last local batch
    (its requests retracted)."""
    local = local_prefills_of(scheduler)
    if local is not None:
        local.pacer.paused()  # (the step in flight is not timed across the pause)
        local.pauses += 1  # (nor is a first token predicted before it)
        local.first_tokens_due = []
        if getattr(recv_req, "mode", None) == "retract":
            local.launched = None  # its requests are retracted: SGLang's to resume
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
    local = local_prefills_of(queue.scheduler)
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
    local = local_prefills_of(scheduler)
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
        _forget_gone(scheduler, local)
    return original(scheduler, recv_req)
