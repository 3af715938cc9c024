"""Router flow, local prefill: the prefill server's copy of a request the decoder
prefills itself is told to skip once - when a local step admits it, or when it ends
before one did - whatever the request's fallback rights; a request sent out instead is
never skipped. The decoder's scheduler is a stand-in here (SGLang's runs in the e2e
tests); these are the hooks' bookkeeping."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from sgl_pd.backend.decode import local_prefill
from sgl_pd.backend.decode.local_fallback import LOCAL_HOST
from sgl_pd.backend.decode.local_prefill import LocalPrefills, around_add_request_to_queue
from sgl_pd.core.local_budget import LocalStep, RemoteCost

BOOTSTRAP_PORT = 8998


class _Scheduler:
    def __init__(self, local: LocalPrefills, *, accept_priority: bool = True) -> None:
        setattr(self, local_prefill._STATE, local)
        self.skips: list[tuple[str, int]] = []
        self.queued: list[Any] = []
        self.running_batch = SimpleNamespace(reqs=[])
        self.max_queued_requests = None
        self.tree_cache = None
        self._accept_priority = accept_priority
        manager = SimpleNamespace(
            rank=0,
            skip_prefill=lambda addr, room: self.skips.append((addr, room)),
            decode=SimpleNamespace(remote_cost=RemoteCost()),
        )
        self.disagg_decode_prealloc_queue = SimpleNamespace(
            kv_manager=manager, add=self.queued.append, queue=[]
        )

    def _set_or_validate_priority(self, req: Any) -> bool:
        return self._accept_priority

    def _release_aborted_request(self, req: Any) -> None:
        pass


def _router_request(room: int) -> Any:
    return SimpleNamespace(
        rid=f"r{room}",
        bootstrap_host="10.0.0.11",
        bootstrap_port=BOOTSTRAP_PORT,
        bootstrap_room=room,
        output_ids=[],
        origin_input_ids=list(range(300)),
        return_logprob=False,
        lora_id=None,
        time_stats=SimpleNamespace(
            set_wait_queue_entry_time=lambda: None,
            set_decode_prealloc_queue_entry_time=lambda: None,
            wait_queue_entry_time=0.0,
        ),
    )


@pytest.fixture(autouse=True)
def _held_prompt(monkeypatch: pytest.MonkeyPatch) -> None:
    # the decoder's tree holds all but the last 40 tokens of every prompt (SGLang serves
    # a prompt held whole all but its last token)
    monkeypatch.setattr(
        local_prefill, "_cached_tokens", lambda tree, req: min(260, len(req.origin_input_ids) - 1)
    )


def _never_queued(req: Any) -> Any:
    raise AssertionError(f"{req.rid} went the transfer way")


@pytest.mark.parametrize("may_send_out", [True, False])
def test_an_admitted_router_request_has_its_prefill_copy_skipped_once(may_send_out: bool) -> None:
    """`may_send_out` False: the decoder does not sample first tokens (--pd-first-token
    prefill), so no request goes out after all - and still each copy is skipped."""
    local = LocalPrefills(128, prefix_cache=True, may_send_out=may_send_out)
    scheduler = _Scheduler(local)
    req = _router_request(7)
    around_add_request_to_queue(_never_queued, scheduler, req)
    assert local.queue == [req] and scheduler.skips == []  # not before it is admitted
    local.queue = []  # a local step admitted it
    local_prefill._forget_gone(scheduler, local)
    local_prefill._forget_gone(scheduler, local)
    assert scheduler.skips == [(f"10.0.0.11:{BOOTSTRAP_PORT}", 7)]


def test_a_router_request_refused_at_the_door_has_its_prefill_copy_skipped() -> None:
    local = LocalPrefills(128, prefix_cache=True)
    scheduler = _Scheduler(local, accept_priority=False)
    around_add_request_to_queue(_never_queued, scheduler, _router_request(8))
    assert local.queue == []
    assert scheduler.skips == [(f"10.0.0.11:{BOOTSTRAP_PORT}", 8)]


def test_a_request_sent_out_unadmitted_keeps_its_prefill_copy() -> None:
    local = LocalPrefills(128, prefix_cache=True)
    scheduler = _Scheduler(local)
    req = _router_request(9)
    around_add_request_to_queue(_never_queued, scheduler, req)
    for _ in range(local.wait.bound):  # no local step admits it
        local_prefill._send_out_unadmitted(scheduler, local)
    assert local.queue == [req]
    local_prefill._send_out_unadmitted(scheduler, local)  # one step past the bound
    assert scheduler.queued == [req]
    assert (req.bootstrap_host, req.bootstrap_port) == ("10.0.0.11", BOOTSTRAP_PORT)
    local_prefill._forget_gone(scheduler, local)
    assert scheduler.skips == []


def test_a_request_with_no_room_here_goes_out_at_once_and_keeps_its_prefill_copy() -> None:
    local = LocalPrefills(128, prefix_cache=True)
    scheduler = _Scheduler(local)
    req, pinned = _router_request(10), _router_request(11)
    around_add_request_to_queue(_never_queued, scheduler, req)
    local.queue.append(pinned)  # (no fallback: a retracted request recomputing here)
    local_prefill._send_out_for_room(scheduler, local)
    assert scheduler.queued == [req] and local.queue == [pinned]
    local_prefill._forget_gone(scheduler, local)
    assert scheduler.skips == []


def test_a_request_arriving_after_a_mixed_local_step_is_planned_with_its_streams() -> None:
    """Between a mixed local step and the next iteration the streams are in that step's
    batch and SGLang's running batch is empty: the plan counts them still, so a step
    that would break the ITL SLO at 64 streams sends the request out."""
    from sgl_pd.core.local_budget import StepCoefficients

    local = LocalPrefills(128, prefix_cache=True, itl_slo=1.25, page_size=16)
    # a page mixed into 64 streams, or alone, costs more than a quarter of their step
    local.pacer.step_model = StepCoefficients(0.010, 0.0005, 0.001, 0.0005, unmixed_offset=0.02)
    scheduler = _Scheduler(local)
    local.launched = SimpleNamespace(decoding_reqs=[object()] * 64)
    local.last_mixed = True
    req = _router_request(12)
    around_add_request_to_queue(_never_queued, scheduler, req)
    assert scheduler.queued == [req] and local.queue == []
    # with no stream decoding, the same request is prefilled here
    local.launched = None
    other = _router_request(13)
    around_add_request_to_queue(_never_queued, scheduler, other)
    assert local.queue == [other]


def _measuring(overlap: bool = False) -> tuple[LocalPrefills, _Scheduler, list[float]]:
    """A decoder whose step model is fitted, on a clock the test moves."""
    from sgl_pd.core.local_budget import StepCoefficients

    local = LocalPrefills(512, prefix_cache=True, overlap=overlap)
    local.pacer.step_model = StepCoefficients(0.010, 0.0, 0.0005)
    now = [100.0]
    local.pacer._clock = lambda: now[0]
    return local, _Scheduler(local), now


def _queued(local: LocalPrefills, scheduler: _Scheduler, *rooms: int) -> list[Any]:
    reqs = [_router_request(room) for room in rooms]
    for req in reqs:  # (40 tokens uncached: `_held_prompt`)
        around_add_request_to_queue(_never_queued, scheduler, req)
    assert local.queue[-len(reqs) :] == reqs
    return reqs


def _predicted(req: Any) -> float:
    return float(getattr(req, local_prefill._PREDICTION)[2])


def test_each_local_first_token_is_measured_against_its_prediction() -> None:
    """A request queued here with its first token predicted in p seconds, whose last
    chunk's step ended a seconds later, teaches the pacer a/p; the request still
    mid-prefill and the streams mixed into the step teach nothing yet."""
    local, scheduler, now = _measuring()
    whole, chunked = _queued(local, scheduler, 20, 21)
    stream = _router_request(22)  # a running stream, decoded in the same (mixed) step
    setattr(stream, local_prefill._PREDICTION, (0, 0.0, 1e-3))  # (its own, long ago)
    now[0] += 3 * _predicted(whole)  # the step that ran both ends three times later
    local.chunked = chunked  # (only part of its prompt ran)
    step = SimpleNamespace(reqs=[whole, chunked, stream], decoding_reqs=[stream])
    local_prefill._first_tokens_came(local, step)
    assert local.pacer.bias.value == pytest.approx(3.0)
    assert getattr(whole, local_prefill._PREDICTION) is None
    local.chunked = None  # its last chunk: measured too, on time
    now[0] = 100.0 + _predicted(chunked)
    local_prefill._first_tokens_came(local, SimpleNamespace(reqs=[chunked]))
    assert local.pacer.bias.value == pytest.approx((3.0 + 1.0) / 2)  # (the median of two)


def test_with_the_overlap_scheduler_a_first_token_is_measured_an_iteration_later() -> None:
    """The overlap scheduler processes a step's results in the next iteration: its
    first tokens are out only when the iteration after that begins."""
    local, scheduler, now = _measuring(overlap=True)
    (req,) = _queued(local, scheduler, 23)
    predicted = _predicted(req)
    now[0] += predicted
    local_prefill._first_tokens_came(local, SimpleNamespace(reqs=[req]))
    assert local.pacer.bias.value == 1.0 and len(local.first_tokens_due) == 1  # (not yet)
    now[0] += predicted  # one more step: twice the prediction in all
    local_prefill._first_tokens_came(local, None)  # (the next iteration ran no local step)
    assert local.pacer.bias.value == pytest.approx(2.0) and local.first_tokens_due == []


def test_requests_sent_out_retracted_or_caught_by_a_pause_teach_nothing() -> None:
    """What is measured is a local first token as predicted: not a request sent out
    (it comes back as a running stream), not a retracted one recomputing its output,
    not one whose wait spanned a pause."""
    local, scheduler, now = _measuring()
    out, paused = _queued(local, scheduler, 24, 25)
    local_prefill._sent_out(scheduler, local, out, local.fallbacks[out.rid], "unadmitted")
    assert getattr(out, local_prefill._PREDICTION) is None
    retracted = _router_request(26)  # a local request, retracted with its output so far
    retracted.bootstrap_host, retracted.output_ids = LOCAL_HOST, [5, 6]
    around_add_request_to_queue(_never_queued, scheduler, retracted, is_retracted=True)
    assert retracted in local.queue
    assert getattr(retracted, local_prefill._PREDICTION, None) is None
    pause = SimpleNamespace(mode="in_place")
    local_prefill.around_pause_generation(lambda scheduler, req: None, scheduler, pause)
    now[0] += 60.0
    local_prefill._first_tokens_came(local, SimpleNamespace(reqs=[out, paused, retracted]))
    assert local.pacer.bias.value == 1.0


def test_a_request_with_nothing_to_prefill_teaches_no_bias() -> None:
    """A stream's prompt sent again whole (its prefix all cached, nothing queued) took
    14 ms for a predicted 10 on this CPU, where follow-ups of 41 tokens came as
    predicted: its ratio, the median of many such, made every follow-up look 1.6x slower
    here and sent it to a prefill server that took twice as long."""
    local, scheduler, now = _measuring()
    cached = _router_request(27)
    cached.origin_input_ids = list(range(260))  # (all held: `_held_prompt`)
    around_add_request_to_queue(_never_queued, scheduler, cached)
    assert cached in local.queue and getattr(cached, local_prefill._PREDICTION, None) is None
    (follow_up,) = _queued(local, scheduler, 28)  # behind nothing, 40 tokens to compute
    now[0] += 1.2 * _predicted(follow_up)
    local_prefill._first_tokens_came(local, SimpleNamespace(reqs=[cached, follow_up]))
    assert local.pacer.bias.value == pytest.approx(1.2)


def test_the_bias_rank_zero_measured_moves_placements() -> None:
    """Placements scale their local prediction by the bias synced from rank 0: a
    follow-up sooner here at 1x goes out once local first tokens run 4x late."""
    from sgl_pd.core.local_budget import RemoteCoefficients

    local, scheduler, _ = _measuring()
    model = local.pacer.step_model
    remote = RemoteCoefficients(0.030, 0.0)
    local.pacer.remote_model = remote
    (here,) = _queued(local, scheduler, 27)  # 30 ms here; remote 30 ms, then a 10 ms step
    for _ in range(3):
        local.pacer.bias.observe(0.010, 0.040)
    local.pacer._sync(scheduler, None)  # (one rank: its own models, none fitted here)
    assert local.pacer.local_bias == pytest.approx(4.0)
    local.pacer.step_model, local.pacer.remote_model = model, remote
    other = _router_request(28)
    other.origin_input_ids = list(range(40))
    around_add_request_to_queue(_never_queued, scheduler, other)
    assert scheduler.queued == [other] and local.queue == [here]  # sent out: slower here


def _past_the_slo(burst_every: int, step_tokens: int = 64) -> tuple[LocalPrefills, _Scheduler]:
    """A decoder with 64 streams where not even a page of local work fits the ITL SLO,
    one burst step of `step_tokens` allowed now (`burst_every` > 0)."""
    from sgl_pd.core.local_budget import StepCoefficients

    local = LocalPrefills(
        256, step_tokens=step_tokens, prefix_cache=True, itl_slo=1.25, page_size=16,
        burst_every=burst_every,
    )  # fmt: skip
    local.pacer.step_model = StepCoefficients(0.010, 0.0005, 0.001, 0.0005, unmixed_offset=0.02)
    scheduler = _Scheduler(local)
    scheduler.running_batch = SimpleNamespace(reqs=[object()] * 64)
    return local, scheduler


def test_a_follow_up_one_burst_step_finishes_stays_here_where_the_slo_fits_no_page() -> None:
    local, scheduler = _past_the_slo(burst_every=200)
    req = _router_request(21)  # 40 uncached tokens: one burst step of 64
    around_add_request_to_queue(_never_queued, scheduler, req)
    assert local.queue == [req] and scheduler.queued == []
    local, scheduler = _past_the_slo(burst_every=0)
    req = _router_request(22)
    around_add_request_to_queue(_never_queued, scheduler, req)
    assert scheduler.queued == [req] and local.queue == []  # no burst: it goes out


def test_a_request_the_burst_cannot_finish_goes_out(monkeypatch: pytest.MonkeyPatch) -> None:
    """200 uncached tokens: 64 in the burst, the rest in steps each past the SLO."""
    monkeypatch.setattr(local_prefill, "_cached_tokens", lambda tree, req: 100)
    local, scheduler = _past_the_slo(burst_every=200)
    req = _router_request(23)
    around_add_request_to_queue(_never_queued, scheduler, req)
    assert scheduler.queued == [req] and local.queue == []


def test_the_work_ahead_counts_what_the_request_mid_prefill_has_left() -> None:
    """A request mid-prefill with 60 tokens left takes the burst step's first 60: a
    40-token follow-up would finish only in the steps after it, each past the SLO."""
    local, scheduler = _past_the_slo(burst_every=200)
    chunked = _router_request(24)
    chunked.extend_end = 240  # of 300 prompt tokens
    local.chunked = chunked
    assert local_prefill._work_ahead(local) == 60
    req = _router_request(25)
    around_add_request_to_queue(_never_queued, scheduler, req)
    assert scheduler.queued == [req] and local.queue == []


def test_queued_requests_a_burst_cannot_finish_go_out_before_it_runs() -> None:
    local, scheduler = _past_the_slo(burst_every=200)
    first, second = _router_request(26), _router_request(27)
    around_add_request_to_queue(_never_queued, scheduler, first)
    around_add_request_to_queue(_never_queued, scheduler, second)  # (placed: 80 > 64 ahead)
    assert local.queue == [first] and scheduler.queued == [second]
    local.queue.append(second)  # (as if both had been placed before the costs were known)
    local.uncached[second.rid] = 40
    assert local_prefill._past_the_burst(local, 64) == {second.rid}


@pytest.mark.parametrize("tp_size", [1, 2])
def test_a_request_is_judged_behind_the_remote_queue_in_flight_now_alike_on_every_rank(
    tp_size: int,
) -> None:
    """A follow-up of a token or so to compute is 10.5 ms here (one step) and the
    decode step's 10 ms remote, behind nothing at the last sync. Behind the 1000 tokens
    SGLang's transfer queue waits for now (0.5 ms each: 500 ms) it stays here, at one
    rank or several: that queue is the same on every rank. A rank's own count of its
    transfers is not (each ends when that rank's part landed), and judges nothing."""
    from sgl_pd.core.local_budget import RemoteCoefficients

    local, scheduler, _ = _measuring()
    scheduler.tp_size = tp_size  # type: ignore[attr-defined]
    local.pacer.remote_model = RemoteCoefficients(0.0, 0.0, per_queued_token=0.0005)
    remote = scheduler.disagg_decode_prealloc_queue.kv_manager.decode.remote_cost
    remote.started(1, 1000)  # (this rank's count: not judged by)
    req = _router_request(29)
    req.origin_input_ids = list(range(40))
    around_add_request_to_queue(lambda r: None, scheduler, req)
    assert local.queue == []  # sent out: nothing in the transfer queue
    waiting = [  # the KV each needs less what was held (`expected_kv_tokens`): 1000
        SimpleNamespace(  # the decoder samples its first token: all but the last
            req=SimpleNamespace(
                origin_input_ids=[0] * 1101, output_ids=[], pd_decode_samples_first=True
            ),
            prefix_match=SimpleNamespace(decode_prefix_len=100),
        ),
        SimpleNamespace(  # a prompt held whole
            req=SimpleNamespace(origin_input_ids=[0] * 300, output_ids=[]),
            prefix_match=SimpleNamespace(decode_prefix_len=300),
        ),
        SimpleNamespace(  # recomputed after a retraction, from the start: with its output
            req=SimpleNamespace(origin_input_ids=[0] * 400, output_ids=[0] * 100),
            prefix_match=None,
        ),
    ]
    scheduler.disagg_decode_transfer_queue = SimpleNamespace(queue=waiting)  # type: ignore[attr-defined]
    assert local_prefill._remote_tokens_in_flight(scheduler) == 1500
    waiting.pop()
    other = _router_request(30)
    other.origin_input_ids = list(range(40))
    around_add_request_to_queue(_never_queued, scheduler, other)
    assert local.queue == [other]


def _next_local_plan(
    monkeypatch: pytest.MonkeyPatch, local: LocalPrefills, scheduler: _Scheduler, running: int
) -> LocalStep:
    """The plan of the local step the next scheduling iteration runs, `running` streams
    decoding (SGLang's own scheduling is not run: the plan is what is judged)."""
    scheduler.last_batch = None
    scheduler.waiting_queue = []
    batch = SimpleNamespace(reqs=[object()] * running, is_empty=lambda: False, batch_is_full=False)
    planned: list[LocalStep] = []
    monkeypatch.setattr(
        local_prefill, "_local_step", lambda s, lp, rb, plan: planned.append(plan) or "step"
    )
    assert local_prefill._next_batch(lambda s, rb: "decode", scheduler, local, batch) == "step"
    (plan,) = planned
    return plan


def test_a_request_mid_prefill_past_the_slo_finishes_in_one_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The costs changed while a request was mid-prefill, and no step fits the SLO now.
    It cannot go out (part of its KV is here): its every step is past the SLO, so it
    finishes in one of the step's cap - one long gap of the streams, not a page a step
    (measured on the CPU: 41 one-token steps, its first token 1.1 s late, each of the
    streams' gaps past the SLO) - and that step spends the burst."""
    local, scheduler = _past_the_slo(burst_every=200, step_tokens=128)
    local.pacer.burst.spent()  # no burst allowed now
    chunked = _router_request(29)
    chunked.extend_end = 259  # 41 tokens left
    local.chunked = chunked
    plan = _next_local_plan(monkeypatch, local, scheduler, running=64)
    assert plan.tokens == 128 and plan.then is not None and not plan.then.within_slo
    assert local.pacer.burst.spends(plan, 64, 41)


def test_a_whole_prefix_hit_runs_in_the_slo_plan_and_leaves_the_burst(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A stream's prompt sent again (nothing uncached: one token to compute) while a
    burst is allowed: the step the SLO allows carries it, and the burst stays for a
    follow-up that needs it. (Here mixing costs the streams past the SLO - a mixed
    step's own 10 ms - and the burst of the cap runs mixed, the SLO's steps alone: a
    burst step of one token would have been of the other kind, which spends it.)"""
    from sgl_pd.core.local_budget import StepCoefficients

    monkeypatch.setattr(local_prefill, "_cached_tokens", lambda tree, req: 300)
    local = LocalPrefills(256, prefix_cache=True, itl_slo=1.25, page_size=1, burst_every=200)
    local.pacer.step_model = StepCoefficients(
        0.010, 0.001, 0.0001, mixed_offset=0.010, unmixed_offset=0.001, unmixed_per_token=0.001
    )
    scheduler = _Scheduler(local)
    scheduler.running_batch = SimpleNamespace(reqs=[object()] * 10)
    req = _router_request(30)
    around_add_request_to_queue(_never_queued, scheduler, req)
    assert local.queue == [req]
    plan = _next_local_plan(monkeypatch, local, scheduler, running=10)
    assert plan == LocalStep(4, mixed=False)
    local.pacer.launched(10 if plan.mixed else 0, 1)
    assert local.pacer.burst.ready


def test_a_retracted_request_counts_its_output_among_the_work_queued() -> None:
    """A local request retracted without a backup recomputes its prompt's uncached
    tokens and its whole output: the work the next plans and placements see."""
    local, scheduler, _ = _measuring()
    retracted = _router_request(31)  # 40 tokens uncached of 300
    retracted.bootstrap_host, retracted.output_ids = LOCAL_HOST, list(range(25))
    around_add_request_to_queue(_never_queued, scheduler, retracted, is_retracted=True)
    assert local.queue == [retracted]
    assert local_prefill._work_ahead(local) == 40 + 25


def test_the_offer_lists_the_direct_requests_past_the_local_queue(tmp_path: Any) -> None:
    """The HTTP process learns from the offer that a request it placed on the burst left
    the local queue (`local_offer.OfferReader.claim_burst_if_ready`): direct requests
    only, of the newest `ARRIVALS_OFFERED` to arrive, and none still queued - an offer
    written in the iteration a request arrives, before its step launches, still says the
    burst is ready."""
    from sgl_pd.core.local_budget import ARRIVALS_OFFERED, LocalOffer

    local, scheduler, _ = _measuring()
    _queued(local, scheduler, 1)  # (a router request: its HTTP process placed nothing)
    for room in range(10, 12 + ARRIVALS_OFFERED):
        direct = _router_request(room)
        direct.bootstrap_host = LOCAL_HOST  # (placed here by the HTTP process)
        around_add_request_to_queue(_never_queued, scheduler, direct)
    path = tmp_path / "offer.json"

    def offered() -> tuple[int, ...]:
        local_prefill._offer(scheduler, local, path)
        return LocalOffer.from_json(path.read_text()).arrived_rooms

    assert offered() == ()  # all still queued
    launched = [r for r in local.queue if r.bootstrap_room in (12, 20)]
    local.queue = [r for r in local.queue if r not in launched]  # (as a local step takes them)
    assert offered() == (12, 20)
    local.queue = []
    assert offered() == tuple(range(12, 12 + ARRIVALS_OFFERED))


def test_a_room_no_offer_may_hold_never_spoils_the_offer(tmp_path: Any) -> None:
    """A request that reaches the scheduler marked as placed here by the HTTP process,
    with a room the HTTP process never makes (a client's, sent straight to the
    scheduler's door): the offer stays one its HTTP process reads."""
    from sgl_pd.core.local_budget import LocalOffer

    local, scheduler, _ = _measuring()
    for room in (-(2**40), 7):
        forged = _router_request(0)
        forged.bootstrap_room, forged.bootstrap_host = room, LOCAL_HOST
        around_add_request_to_queue(_never_queued, scheduler, forged)
    local.queue = []
    path = tmp_path / "offer.json"
    local_prefill._offer(scheduler, local, path)
    assert LocalOffer.from_json(path.read_text()).arrived_rooms == (7,)
