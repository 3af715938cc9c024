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
from sgl_pd.backend.decode.local_prefill import LocalPrefills, around_add_request_to_queue

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
            decode=SimpleNamespace(remote_cost=None),
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
    # the decoder's tree holds all but the last 40 tokens of every prompt
    monkeypatch.setattr(local_prefill, "_cached_tokens", lambda tree, req: 260)


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


def test_each_local_first_token_is_measured_against_its_prediction() -> None:
    """A request queued here with its first token predicted in p seconds, whose last
    chunk's step ended a seconds later, teaches the pacer a/p (a request still
    mid-prefill teaches nothing yet); the ratio is what placements scale later
    predictions by, once rank 0's models are synced."""
    from sgl_pd.core.local_budget import StepCoefficients

    local = LocalPrefills(512, prefix_cache=True)
    local.pacer.step_model = StepCoefficients(0.010, 0.0, 0.0005)
    now = [100.0]
    local.pacer._clock = lambda: now[0]
    scheduler = _Scheduler(local)
    whole, chunked = _router_request(20), _router_request(21)
    for req in (whole, chunked):
        req.origin_input_ids = list(range(40))
        around_add_request_to_queue(_never_queued, scheduler, req)
    assert local.queue == [whole, chunked]
    predicted = local.predicted[whole.rid][1]
    assert predicted > 0
    now[0] += 3 * predicted  # the step that ran both ends three times later than predicted
    local.chunked = chunked  # (only part of its prompt ran)
    local_prefill._first_tokens_came(local, SimpleNamespace(reqs=[whole, chunked]))
    assert local.pacer.bias.value == pytest.approx(3.0)
    assert whole.rid not in local.predicted and chunked.rid in local.predicted
    local.chunked, local.queue = None, []  # its last chunk: measured too
    local_prefill._first_tokens_came(local, SimpleNamespace(reqs=[chunked]))
    assert local.predicted == {}
