"""The local prefill budget (pure): the step-cost fit, the tokens an ITL SLO allows, the
local-or-remote choice by predicted first token, and the admission wait."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from sgl_pd.core.local_budget import (
    ADMISSION_STEPS,
    MAX_BIAS,
    MIN_REMOTE_SAMPLES,
    MIN_SAMPLES,
    MODEL_WORDS,
    PROBE_EVERY,
    REMOTE_WINDOW_S,
    BurstAllowance,
    LocalBias,
    LocalStep,
    LocalWait,
    Models,
    RemoteCoefficients,
    RemoteCost,
    StepCoefficients,
    StepCost,
    adder_budget,
    burst_if_it_fits,
    burst_if_needed,
    local_first_token_s,
    pack_models,
    plan_local_step,
    prefill_here_is_sooner,
    unpack_models,
    why_sent_out,
)


def test_the_step_cost_fit_recovers_a_linear_cost_from_noisy_steps() -> None:
    truth = StepCoefficients(offset=0.010, per_request=0.0002, per_local_token=0.0005)
    rng = random.Random(7)
    cost = StepCost()
    for _ in range(400):
        running, local = rng.randint(1, 300), rng.choice([0, 0, 0, rng.randint(1, 128)])
        cost.observe(running, local, truth.seconds(running, local) * rng.uniform(0.95, 1.05))
    fitted = cost.coefficients()
    assert fitted is not None
    assert math.isclose(fitted.per_local_token, truth.per_local_token, rel_tol=0.1)
    assert math.isclose(fitted.per_request, truth.per_request, rel_tol=0.1)
    assert math.isclose(fitted.seconds(100, 0), truth.seconds(100, 0), rel_tol=0.05)


def test_the_fit_follows_a_change_and_forgets_the_old_cost() -> None:
    # (local steps of two sizes: at one size and one batch a token's cost and the
    # streams' mixing cost are one sum, which no fit can split)
    cost = StepCost()
    for i in range(200):
        local = (16, 0, 48, 0)[i % 4]
        cost.observe(10, local, 0.01 + 0.001 * local)
    for i in range(400):  # the same steps became four times cheaper per local token
        local = (16, 0, 48, 0)[i % 4]
        cost.observe(10, local, 0.01 + 0.00025 * local)
    fitted = cost.coefficients()
    assert fitted is not None and math.isclose(fitted.per_local_token, 0.00025, rel_tol=0.05)


def test_no_model_before_local_steps_were_measured() -> None:
    cost = StepCost()
    for _ in range(50):
        cost.observe(8, 0, 0.02)
    assert cost.coefficients() is None  # (the cost of a local token is not known yet)
    for _ in range(MIN_SAMPLES):
        cost.observe(8, 32, 0.03)
    assert cost.coefficients() is not None


def test_the_fit_tells_the_cost_of_mixing_streams_from_that_of_local_tokens() -> None:
    """A mixed step's streams go through the extend path (on SGLang's `torch_native`
    backend each attends over its whole context again): a cost per stream that only
    mixed steps pay. Unmixed local steps decode no stream and pay their own offset."""
    truth = StepCoefficients(0.010, 0.0002, 0.0005, per_mixed_request=0.0008, unmixed_offset=0.006)
    rng = random.Random(11)
    cost = StepCost()
    for i in range(600):
        running = rng.randint(1, 300)
        local = rng.randint(1, 128) if i % 3 else 0
        if local and i % 2:
            running = 0  # an unmixed local step
        cost.observe(running, local, truth.seconds(running, local) * rng.uniform(0.97, 1.03))
    fitted = cost.coefficients()
    assert fitted is not None and fitted.unmixed_offset is not None
    assert math.isclose(fitted.per_mixed_request, truth.per_mixed_request, rel_tol=0.1)
    assert math.isclose(fitted.per_local_token, truth.per_local_token, rel_tol=0.1)
    assert math.isclose(fitted.unmixed_offset, 0.006, rel_tol=0.1)
    assert math.isclose(fitted.seconds(64, 16), truth.seconds(64, 16), rel_tol=0.05)
    assert math.isclose(fitted.seconds(0, 16), truth.seconds(0, 16), rel_tol=0.05)


def test_a_mixed_step_has_a_cost_of_its_own_besides_its_tokens_and_streams() -> None:
    """Measured on this CPU: a mixed step of one stream and one local token (a stream's
    cached prompt sent again) took 14 ms where the decode step took 9, and one of two
    streams and 41 tokens took 44. Without a cost of its own per mixed step the fit
    spreads it over tokens and streams, and a local first token is predicted late for
    some requests and early for others (the multiplier learnt from their median then
    moves every prediction)."""
    truth = StepCoefficients(0.004, 0.0025, 0.0007, per_mixed_request=0.0005, mixed_offset=0.004)
    rng = random.Random(5)
    cost = StepCost()
    for i in range(600):
        running = rng.randint(1, 4)
        local = 0 if i % 3 == 0 else rng.choice([1, 1, 1, 20, 41, 128])
        cost.observe(running, local, truth.seconds(running, local) * rng.uniform(0.98, 1.02))
    fitted = cost.coefficients()
    assert fitted is not None
    assert math.isclose(fitted.mixed_offset, truth.mixed_offset, rel_tol=0.15)
    for running, local in [(1, 1), (2, 41), (4, 128)]:
        assert math.isclose(
            fitted.seconds(running, local), truth.seconds(running, local), rel_tol=0.03
        )
    assert fitted.mixing_s(2) == pytest.approx(truth.mixed_offset + 2 * 0.0005, rel=0.15)
    # at a steady stream count the fit may split the cost into an offset and a negative
    # cost a stream: what it measured is their sum
    split = StepCoefficients(0.004, 0.00025, 0.0007, per_mixed_request=-1e-4, mixed_offset=0.0142)
    assert split.mixing_s(64) == pytest.approx(0.0078)


def test_the_unmixed_offset_is_measured_not_read_off_the_decode_fit() -> None:
    """At a steady stream count a decode step's offset and per-stream cost are one sum
    (a + b * 64): an unmixed step's cost cannot be had from them, only from its own
    steps - until then it is not measured."""
    truth = StepCoefficients(0.010, 0.0005, 0.0001, 0.00005, unmixed_offset=0.010)
    rng = random.Random(5)
    cost = StepCost()
    for i in range(300):
        running = 64 + rng.randint(-2, 2)
        local = 16 if i % 2 else 0  # mixed steps of one size among decode steps
        cost.observe(running, local, truth.seconds(running, local) * rng.uniform(0.97, 1.03))
    fitted = cost.coefficients()
    assert fitted is not None and fitted.unmixed_offset is None
    for _ in range(MIN_SAMPLES):
        cost.observe(0, 16, truth.seconds(0, 16))
    fitted = cost.coefficients()
    assert fitted is not None and fitted.unmixed_offset is not None
    assert math.isclose(fitted.seconds(0, 16), truth.seconds(0, 16), rel_tol=0.05)


def test_while_no_local_step_runs_the_fit_keeps_what_they_cost() -> None:
    """Where no local step fits the SLO every request goes out and no local step is
    timed: the decode steps that run meanwhile must not fade the local costs to free
    (which would plan the cap on the next request: a step of many times the SLO)."""
    truth = StepCoefficients(0.010, 0.0005, 0.001, per_mixed_request=0.0005, unmixed_offset=0.012)
    rng = random.Random(3)
    cost = StepCost()
    for i in range(200):
        k = (16, 32, 48)[i % 3]
        cost.observe(64, k, truth.seconds(64, k) * rng.uniform(0.97, 1.03))
        cost.observe(0, k, truth.seconds(0, k) * rng.uniform(0.97, 1.03))
        cost.observe(64, 0, truth.seconds(64, 0) * rng.uniform(0.97, 1.03))
    plan = plan_local_step(cost.coefficients(), 64, slo_factor=1.25, cap=512, page_size=16)
    assert not plan.within_slo
    for _ in range(5000):  # only decode steps
        running = 64 + rng.randint(-3, 3)
        cost.observe(running, 0, truth.seconds(running, 0) * rng.uniform(0.97, 1.03))
    plan = plan_local_step(cost.coefficients(), 64, slo_factor=1.25, cap=512, page_size=16)
    assert not plan.within_slo


def _closed_loop(truth: StepCoefficients, running: int, steps: int) -> tuple[list[int], int]:
    """A decoder planning its local steps from what it measured, always with local work
    waiting: (the steps past the SLO in truth, how many ran unmixed)."""
    rng = random.Random(running)
    cost, past, unmixed, slo = StepCost(), [], 0, 1.25
    for i in range(steps):
        plan = plan_local_step(
            cost.coefficients(), running, slo_factor=slo, cap=128, page_size=1,
            probe=i % PROBE_EVERY == 0,
        )  # fmt: skip
        decode = truth.seconds(running, 0)
        if plan.mixed:
            wait = truth.seconds(running, plan.tokens)
            cost.observe(running, plan.tokens, wait * rng.uniform(0.98, 1.02))
        else:
            unmixed += 1
            alone = truth.seconds(0, plan.tokens)
            cost.observe(0, plan.tokens, alone * rng.uniform(0.98, 1.02))
            wait = alone + decode
        if wait > slo * decode * 1.05:
            past.append(i)
        cost.observe(running, 0, decode * rng.uniform(0.98, 1.02))  # the streams' own step
    return past, unmixed


def test_in_a_closed_loop_the_plan_settles_within_the_slo() -> None:
    """Past the measurements at the start (the cap, before anything is fitted; a page
    alone, before that is), the kind is the right one and steps break the SLO only as
    rarely as a kind not run for about a thousand local steps (its cost forgotten as
    the other's steps are fitted) is tried again."""
    settled = 4 * MIN_SAMPLES
    # cheap mixing (a GPU-like step): mixed steps throughout
    cheap = StepCoefficients(0.010, 0.0005, 0.0001, per_mixed_request=0.00001, unmixed_offset=0.01)
    past, unmixed = _closed_loop(cheap, 64, 3000)
    assert unmixed == 0 and all(i < settled for i in past)
    # costly mixing (this CPU): a page mixed into 64 streams breaks the SLO, one alone not
    costly = StepCoefficients(0.010, 0.0005, 0.0001, per_mixed_request=0.0005, unmixed_offset=0.004)
    past, unmixed = _closed_loop(costly, 64, 3000)
    assert unmixed > 3000 - settled
    assert len([i for i in past if i >= settled]) <= 3  # (one try of mixing per ~1,000)


def test_the_slo_sizes_the_local_tokens_to_the_measured_costs() -> None:
    # decode step 20 ms at 10 streams, 1 ms per local token: 1.25x allows 5 tokens mixed
    # (an unmixed step pays its 10 ms offset: none)
    cpu = StepCoefficients(0.010, 0.001, 0.001, unmixed_offset=0.010)
    assert plan_local_step(cpu, 10, slo_factor=1.25, cap=512, page_size=1) == LocalStep(5, True)
    # extend tokens nearly free (a GPU): the cap
    gpu = StepCoefficients(0.010, 0.0001, 1e-7, unmixed_offset=0.010)
    assert plan_local_step(gpu, 10, slo_factor=1.25, cap=512, page_size=1) == LocalStep(512, True)
    # whole pages
    assert plan_local_step(cpu, 10, slo_factor=2.0, cap=512, page_size=16).tokens == 16


def test_where_mixing_the_streams_costs_more_than_a_step_the_local_chunk_runs_alone() -> None:
    # 64 streams: decode 42 ms; mixing them costs 0.5 ms each (32 ms), past the 10.5 ms a
    # 1.25x SLO leaves; alone a chunk pays a 10 ms offset and 0.1 ms a token
    costly_mix = StepCoefficients(0.010, 0.0005, 0.0001, 0.0005, unmixed_offset=0.010)
    plan = plan_local_step(costly_mix, 64, slo_factor=1.25, cap=512, page_size=1)
    assert plan == LocalStep(5, mixed=False)
    # not measured alone yet: one page alone, to measure it
    unmeasured = StepCoefficients(0.010, 0.0005, 0.0001, 0.0005)
    plan = plan_local_step(unmeasured, 64, slo_factor=1.25, cap=512, page_size=16)
    assert plan == LocalStep(16, mixed=False)
    # a request SGLang does not mix (logprobs) gets the unmixed plan whatever mixing costs
    cheap_mix = StepCoefficients(0.010, 0.0005, 0.0001, unmixed_offset=0.010)
    assert plan_local_step(cheap_mix, 64, slo_factor=1.25, cap=512, page_size=1).mixed
    assert not plan_local_step(
        cheap_mix, 64, slo_factor=1.25, cap=512, page_size=1, can_mix=False
    ).mixed


def test_a_step_no_kind_of_which_fits_the_slo_carries_a_page_and_says_so() -> None:
    cpu = StepCoefficients(0.010, 0.001, 0.001, unmixed_offset=0.010)
    plan = plan_local_step(cpu, 10, slo_factor=1.01, cap=512, page_size=16)
    assert plan.tokens == 16 and not plan.within_slo
    # the unmixed kind where it cannot mix: a page costs 26 ms, past 0.25 x 20 ms
    assert not plan_local_step(
        cpu, 10, slo_factor=1.25, cap=512, page_size=16, can_mix=False
    ).within_slo
    assert plan_local_step(cpu, 10, slo_factor=3.0, cap=512, page_size=1, can_mix=False).within_slo


def test_without_a_model_or_streams_or_slo_a_step_carries_its_cap() -> None:
    cpu = StepCoefficients(0.010, 0.001, 0.001, unmixed_offset=0.010)
    assert plan_local_step(None, 10, slo_factor=1.25, cap=64, page_size=1) == LocalStep(64, True)
    assert plan_local_step(cpu, 0, slo_factor=1.25, cap=64, page_size=1) == LocalStep(64, True)
    assert plan_local_step(cpu, 10, slo_factor=0, cap=64, page_size=1) == LocalStep(64, True)
    assert plan_local_step(None, 10, slo_factor=1.25, cap=64, page_size=1, can_mix=False) == (
        LocalStep(64, False)
    )


@given(
    offset=st.floats(-0.01, 1.0),
    per_request=st.floats(-1e-3, 1e-2),
    per_token=st.floats(-1e-4, 1e-2),
    per_mixed=st.floats(-1e-3, 1e-2),
    unmixed=st.floats(-0.01, 1.0),
    running=st.integers(1, 2000),
    slo=st.floats(1.01, 4.0),
    cap=st.integers(1, 4096),
    page=st.sampled_from([1, 16, 64]),
    can_mix=st.booleans(),
)
def test_a_step_within_the_slo_keeps_the_streams_within_it_and_carries_the_most_it_can(
    offset: float,
    per_request: float,
    per_token: float,
    per_mixed: float,
    unmixed: float,
    running: int,
    slo: float,
    cap: int,
    page: int,
    can_mix: bool,
) -> None:
    model = StepCoefficients(offset, per_request, per_token, per_mixed, unmixed)
    plan = plan_local_step(model, running, slo_factor=slo, cap=cap, page_size=page, can_mix=can_mix)
    top = max(cap - cap % page, page)
    assert page <= plan.tokens <= top
    assert plan.tokens % page == 0
    assert can_mix or not plan.mixed
    decode = model.seconds(running, 0)

    def waits(tokens: int, mixed: bool) -> float:
        """What the streams wait between two tokens through a local step."""
        if mixed:
            return model.seconds(running, tokens)
        return model.seconds(0, tokens) + decode

    def fits(tokens: int, mixed: bool) -> bool:
        return waits(tokens, mixed) <= slo * decode * (1 + 1e-9)

    kinds = [True, False] if can_mix else [False]
    if plan.within_slo:
        assert fits(plan.tokens, plan.mixed)
        # neither kind carries a page more within the SLO
        for mixed in kinds:
            more = plan.tokens + page
            assert plan.tokens == top or waits(more, mixed) > slo * decode * (1 - 1e-9)
    else:
        for mixed in kinds:
            assert not fits(page, mixed) or waits(page, mixed) > slo * decode * (1 - 1e-9)
        # the cheaper kind
        assert waits(page, plan.mixed) <= min(waits(page, m) for m in kinds) * (1 + 1e-9)


@given(local=st.integers(1, 4096), running=st.integers(0, 4096))
def test_the_adder_gets_the_streams_back_only_when_the_step_mixes(local: int, running: int) -> None:
    assert adder_budget(local, running, mixed=True) - running == local
    assert adder_budget(local, running, mixed=False) == local


def test_a_follow_up_goes_where_its_first_token_comes_sooner() -> None:
    step = StepCoefficients(offset=0.010, per_request=0.0, per_local_token=0.0005)
    remote = RemoteCoefficients(offset=0.060, per_token=0.0001)
    sooner = {"running": 4, "tokens_ahead": 0, "plan": LocalStep(64, True)}
    # 40 tokens: one 30 ms step samples the first token here; remote 64 ms of prefill and
    # transfer, then the 10 ms decode step that samples it
    assert prefill_here_is_sooner(step, remote, tokens=40, **sooner)
    # behind 600 queued local tokens: 10 steps here
    assert not prefill_here_is_sooner(step, remote, tokens=40, **{**sooner, "tokens_ahead": 600})
    # at 4 tokens a step (a tight SLO) 40 tokens take 10 steps of 12 ms: remote is sooner
    assert not prefill_here_is_sooner(
        step, remote, tokens=40, **{**sooner, "plan": LocalStep(4, True)}
    )
    # 120 tokens: two steps here (42 + 38 ms = 80 ms), remote 72 ms of prefill and
    # transfer - later once its own 10 ms decode step is counted
    assert local_first_token_s(step, 4, 0, 120, LocalStep(64, True)) == pytest.approx(0.080)
    assert prefill_here_is_sooner(step, remote, tokens=120, **sooner)
    assert not prefill_here_is_sooner(step, remote, tokens=130, **sooner)  # three steps here
    # without both models the placement rules decide (here)
    assert prefill_here_is_sooner(None, remote, tokens=4000, **sooner)
    assert prefill_here_is_sooner(step, None, tokens=4000, **sooner)
    mixed = LocalStep(64, True)
    assert local_first_token_s(step, 4, 0, 40, mixed) == step.seconds(4, 40)
    assert local_first_token_s(step, 4, 30, 40, mixed) == step.seconds(4, 64) + step.seconds(4, 6)
    # a whole prefix hit still computes its last prompt token
    assert local_first_token_s(step, 4, 0, 0, mixed) == step.seconds(4, 1)
    # unmixed: each local step runs alone; the streams' decode steps between local steps
    # are the share of iterations that ran none (measured, `LocalShare`)
    alone = LocalStep(64, False)
    assert local_first_token_s(step, 4, 0, 40, alone) == step.seconds(0, 40)
    assert math.isclose(
        local_first_token_s(step, 4, 0, 40, alone, local_share=0.5),
        step.seconds(0, 40) + step.seconds(4, 0),
    )


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_remote_prefills_are_their_tokens_compute_plus_the_recent_median_overhead() -> None:
    clock = _Clock()
    remote = RemoteCost(clock)
    per_token = 1e-4  # the decoder's own cost of a local token
    for i in range(MIN_REMOTE_SAMPLES - 1):
        remote.observe(1000 + 10 * i, 0.05 + per_token * (1000 + 10 * i))
    assert remote.coefficients(per_token) is None  # too few yet
    remote.observe(48, 0.05 + per_token * 48)
    assert remote.coefficients(None) is None  # the decoder's token cost not known yet
    fitted = remote.coefficients(per_token)
    assert fitted is not None and math.isclose(fitted.offset, 0.05)
    assert math.isclose(fitted.seconds(48), 0.05 + 48 * per_token)


def test_a_slow_spell_of_the_prefill_servers_is_forgotten_once_it_is_over() -> None:
    clock = _Clock()
    remote = RemoteCost(clock)
    for _ in range(20):  # slow for a while (another decoder's burst: not in this queue)
        remote.observe(48, 0.4)
    clock.now += REMOTE_WINDOW_S / 2
    for _ in range(3):
        remote.observe(48, 0.06)
    burst = remote.coefficients(1e-4)
    assert burst is not None and burst.offset > 0.3  # (the median is still the burst's)
    clock.now += REMOTE_WINDOW_S / 2 + 1
    for _ in range(MIN_REMOTE_SAMPLES):
        remote.observe(48, 0.06)
    calm = remote.coefficients(1e-4)
    assert calm is not None and math.isclose(calm.seconds(48), 0.06, rel_tol=1e-6)


def test_a_request_waits_a_bounded_number_of_steps() -> None:
    wait = LocalWait()
    late: list[str] = []
    for _ in range(ADMISSION_STEPS):
        late = wait.waited(["a", "b"])
    assert late == []
    assert wait.waited(["a", "b", "c"]) == ["a", "b"]  # c is new
    assert wait.waited(["c"]) == []  # a and b left the queue: forgotten
    wait.forget("c")
    assert wait.waited(["a"]) == []  # back again: counted afresh


def test_models_cross_to_other_ranks_whole_or_as_unfitted() -> None:
    step = StepCoefficients(0.01, 0.0002, 0.0005, 0.0003, unmixed_offset=0.004, mixed_offset=0.003)
    remote = RemoteCoefficients(0.05, 0.0001, queue_s=0.12, per_queued_token=1e-4)
    unmeasured = StepCoefficients(0.01, 0.0002, 0.0005, 0.0003, mixed_offset=-0.001)
    for models in (
        Models(step, remote, 1.3),
        Models(unmeasured, None),
        Models(None, remote, 0.7),
        Models(step, None),
        Models(),
    ):
        words = pack_models(models)
        assert len(words) == MODEL_WORDS
        assert unpack_models(words) == models


def test_local_predictions_that_fell_short_are_scaled_up_by_what_they_missed() -> None:
    now = [0.0]
    bias = LocalBias(clock=lambda: now[0])
    assert bias.value == 1.0
    for _ in range(5):
        bias.observe(predicted_s=0.100, actual_s=0.150)  # each local first token 1.5x late
    assert bias.value == pytest.approx(1.5)
    bias.observe(predicted_s=0.0, actual_s=0.1)  # (nothing predicted: nothing learnt)
    bias.observe(predicted_s=0.1, actual_s=float("nan"))
    assert bias.value == pytest.approx(1.5)
    for _ in range(7):
        bias.observe(predicted_s=0.1, actual_s=60.0)  # a pause, not a step's cost
    assert bias.value == pytest.approx(1.5)
    for _ in range(7):
        bias.observe(predicted_s=0.1, actual_s=0.1 * MAX_BIAS)
    assert bias.value == MAX_BIAS
    now[0] += REMOTE_WINDOW_S + 1  # none lately: the model's own predictions again
    assert bias.value == 1.0
    # a follow-up sooner here as predicted goes out once predictions run 2.1x late
    step = StepCoefficients(offset=0.010, per_request=0.0, per_local_token=0.0005)
    remote = RemoteCoefficients(offset=0.050, per_token=0.0)
    placement = {"running": 4, "tokens_ahead": 0, "tokens": 40, "plan": LocalStep(64, True)}
    # here one 30 ms step; remote 50 ms, then the 10 ms decode step that samples it
    assert prefill_here_is_sooner(step, remote, **placement)
    assert prefill_here_is_sooner(step, remote, **placement, local_bias=2.0)  # 60 ms: a tie
    assert not prefill_here_is_sooner(step, remote, **placement, local_bias=2.1)


@given(
    offset=st.floats(1e-4, 0.1),
    per_request=st.floats(0, 1e-3),
    per_token=st.floats(1e-6, 1e-2),
    per_mixed=st.floats(0, 1e-3),
    unmixed=st.one_of(st.none(), st.floats(0, 0.1)),
    running=st.integers(0, 600),
    slo=st.floats(1.01, 3.0),
    cap=st.integers(1, 1024),
    page=st.sampled_from([1, 16, 64]),
    can_mix=st.booleans(),
)
def test_a_probe_only_halves_a_step_that_keeps_a_page(
    offset: float,
    per_request: float,
    per_token: float,
    per_mixed: float,
    unmixed: float | None,
    running: int,
    slo: float,
    cap: int,
    page: int,
    can_mix: bool,
) -> None:
    """A probe step (half the tokens, so the fit sees more than one size) neither sends
    requests out (the SLO verdict is the plan's) nor drops below a page."""
    model = StepCoefficients(offset, per_request, per_token, per_mixed, unmixed, unmixed)
    args = {"slo_factor": slo, "cap": cap, "page_size": page, "can_mix": can_mix}
    plain = plan_local_step(model, running, **args)
    probe = plan_local_step(model, running, probe=True, **args)
    assert probe.within_slo == plain.within_slo and probe.mixed == plain.mixed
    assert page <= probe.tokens <= plain.tokens and probe.tokens % page == 0
    assert probe.tokens == plain.tokens or probe.tokens >= page


def test_each_kind_of_local_step_keeps_its_cost_while_the_other_runs() -> None:
    """Mixed and unmixed local steps are fitted apart: thousands of one kind do not fade
    what the other costs (which would make it look free, and plan it past the SLO)."""
    truth = StepCoefficients(0.010, 0.0005, 0.0001, 0.0005, unmixed_offset=0.012)
    rng = random.Random(9)
    cost = StepCost()
    for i in range(100):
        cost.observe(64, 0, truth.seconds(64, 0) * rng.uniform(0.98, 1.02))
        k = (16, 32)[i % 2]
        cost.observe(64, k, truth.seconds(64, k) * rng.uniform(0.98, 1.02))
        cost.observe(0, k, truth.seconds(0, k) * rng.uniform(0.98, 1.02))
    for i in range(5000):  # only unmixed local steps (and decode steps) from now on
        k = (16, 32)[i % 2]
        cost.observe(0, k, truth.seconds(0, k) * rng.uniform(0.98, 1.02))
        cost.observe(64, 0, truth.seconds(64, 0) * rng.uniform(0.98, 1.02))
    fitted = cost.coefficients()
    assert fitted is not None
    assert math.isclose(fitted.per_mixed_request, truth.per_mixed_request, rel_tol=0.1)


def test_a_burst_step_carries_the_cap_once_and_then_the_slo_plan() -> None:
    # decode 20 ms at 10 streams, 1 ms a local token: the SLO allows 5 tokens a step
    cpu = StepCoefficients(0.010, 0.001, 0.001, unmixed_offset=0.010)
    within = plan_local_step(cpu, 10, slo_factor=1.25, cap=64, page_size=1)
    burst = plan_local_step(cpu, 10, slo_factor=1.25, cap=64, page_size=1, burst=True)
    assert burst == LocalStep(64, True, then=within)
    assert (burst.slo_tokens, within.slo_tokens) == (5, 5)
    # where the SLO allows the cap anyway, no burst is spent
    gpu = StepCoefficients(0.010, 0.0001, 1e-7, unmixed_offset=0.010)
    assert plan_local_step(gpu, 10, slo_factor=1.25, cap=64, page_size=1, burst=True).then is None
    # where not even a page fits, every local token is past the SLO
    tight = plan_local_step(cpu, 10, slo_factor=1.01, cap=64, page_size=16, burst=True)
    assert tight.tokens == 64 and tight.within_slo and tight.slo_tokens == 0
    # the kind the streams wait least through: mixing 10 streams at 5 ms each costs more
    # than the 64 tokens alone (10 + 64 ms) then their decode (20 ms)
    costly_mix = StepCoefficients(0.010, 0.001, 0.001, 0.005, unmixed_offset=0.010)
    plan = plan_local_step(costly_mix, 10, slo_factor=1.25, cap=64, page_size=1, burst=True)
    assert not plan.mixed
    # a follow-up of 40 tokens: one burst step, where the SLO would take 8 steps
    one = local_first_token_s(cpu, 10, 0, 40, burst)
    assert one == pytest.approx(cpu.seconds(10, 40))
    assert local_first_token_s(cpu, 10, 0, 40, within) == pytest.approx(8 * cpu.seconds(10, 5))
    # past the cap: the burst step, then steps within the SLO for the rest
    assert local_first_token_s(cpu, 10, 0, 74, burst) == pytest.approx(
        cpu.seconds(10, 64) + 2 * cpu.seconds(10, 5)
    )


def test_a_burst_is_allowed_once_in_every_n_gaps_of_the_streams() -> None:
    allowance = BurstAllowance(200)
    assert allowance.ready  # (from the start)
    allowance.spent()
    for _ in range(199):
        allowance.gap()
        assert not allowance.ready
    allowance.gap()
    assert allowance.ready
    assert not BurstAllowance(0).ready


def test_a_step_past_the_slo_spends_the_burst_by_its_tokens_or_its_kind() -> None:
    allowance = BurstAllowance(200)
    within = LocalStep(5, mixed=True)
    burst = LocalStep(64, mixed=False, then=within)
    assert not allowance.spends(burst, 10, 5)  # the SLO's tokens, the SLO's kind (mixed)
    assert allowance.spends(burst, 10, 6)  # more tokens than the SLO allows
    assert allowance.spends(burst, 0, 4)  # the burst's kind (alone), which the SLO did not plan
    assert not allowance.spends(burst, 10, 0)  # nothing local ran
    assert not allowance.spends(within, 10, 64)  # not a burst plan
    # no page fits the SLO: every local token is past it
    assert allowance.spends(LocalStep(64, True, then=LocalStep(16, True, False)), 10, 16)


def test_a_probe_neither_makes_nor_spends_a_burst() -> None:
    """A probe halves the SLO's plan; the burst compares the cap with the whole plan."""
    gpu = StepCoefficients(0.010, 0.0001, 1e-7, unmixed_offset=0.010)  # the SLO allows the cap
    probe = plan_local_step(gpu, 10, slo_factor=1.25, cap=64, page_size=1, probe=True, burst=True)
    assert probe == LocalStep(32, True)  # a probe, not a burst
    cpu = StepCoefficients(0.010, 0.001, 0.001, unmixed_offset=0.010)  # the SLO allows 5
    burst = plan_local_step(cpu, 10, slo_factor=1.25, cap=64, page_size=1, probe=True, burst=True)
    assert burst.slo_tokens == 5 and not BurstAllowance(200).spends(burst, 10, 4)


def test_why_a_local_request_goes_out() -> None:
    """One check for the scheduler and for its offer to the HTTP process."""
    step = StepCoefficients(offset=0.010, per_request=0.0, per_local_token=0.0005)
    remote = RemoteCoefficients(offset=0.060, per_token=0.0001)
    at = {"running": 4, "tokens_ahead": 0}
    assert why_sent_out(step, remote, tokens=40, plan=LocalStep(64, True), **at) is None
    assert why_sent_out(step, remote, tokens=40, plan=LocalStep(4, True), **at) == "slower"
    past = LocalStep(16, True, within_slo=False)
    assert why_sent_out(step, remote, tokens=8, plan=past, **at) == "itl_slo"
    assert why_sent_out(step, None, tokens=8, plan=past, **at) == "itl_slo"


def test_a_quiet_window_keeps_the_last_remote_prefills_model() -> None:
    """No remote prefill ended in the last 30 s (every request stayed here): the last
    four still say what one takes, behind the queue in flight now; without a model
    every request would stay here however slow the ITL SLO makes its steps."""
    clock = _Clock()
    remote = RemoteCost(clock)
    for _ in range(MIN_REMOTE_SAMPLES - 1):
        remote.observe(500, 0.5)
    for _ in range(MIN_REMOTE_SAMPLES):
        remote.observe(48, 0.06)
    before = remote.coefficients(1e-4)
    assert before is not None and before.seconds(48) == pytest.approx(0.06)
    clock.now += 10 * REMOTE_WINDOW_S
    remote.started(1, 100)
    quiet = remote.coefficients(1e-4)
    assert quiet is not None
    assert quiet.offset == pytest.approx(before.offset) and quiet.queue_s == pytest.approx(1e-2)
    assert RemoteCost(clock).coefficients(1e-4) is None  # (none ever seen)


def test_a_burst_of_prefills_at_once_is_learnt_as_a_queue_not_as_overhead() -> None:
    """Twenty prefills begun at once each wait for those before them: net of that queue
    their overhead is the calm one, and a prefill begun now waits only for the queue in
    flight now - none once the burst ended, all of it while it runs."""
    clock = _Clock()
    remote = RemoteCost(clock)
    per_token, overhead, tokens = 1e-4, 0.05, 100
    for room in range(20):
        remote.started(room, tokens)
    assert remote.in_flight_tokens == 20 * tokens
    during = None
    for room in range(20):  # served in turn: room i after the i before it
        remote.ended(room, overhead + per_token * tokens * (room + 1))
        if room == 9:
            during = remote.coefficients(per_token)
    assert during is not None and math.isclose(during.offset, overhead)
    assert math.isclose(during.seconds(48), overhead + per_token * (48 + 10 * tokens))
    calm = remote.coefficients(per_token)
    assert calm is not None and remote.in_flight_tokens == 0
    assert math.isclose(calm.seconds(48), overhead + per_token * 48)


def test_a_remote_prefill_let_go_teaches_nothing_and_leaves_the_queue() -> None:
    remote = RemoteCost(_Clock())
    remote.started(1, 500)
    remote.started(2, 40)
    remote.started(2, 60)  # a retried room: afresh
    assert remote.in_flight_tokens == 560
    remote.ended(1)  # failed, or SGLang let go of it
    remote.ended(1, 0.5)  # (ended twice: nothing more)
    remote.ended(7, 0.5)  # never started here
    assert remote.in_flight_tokens == 60
    for _ in range(MIN_REMOTE_SAMPLES):
        remote.observe(48, 0.06)
    fitted = remote.coefficients(1e-4)
    assert fitted is not None and math.isclose(fitted.queue_s, 60 * 1e-4)
    assert math.isclose(fitted.offset, 0.06 - 48e-4)


def test_the_wait_per_queued_token_is_learnt_where_the_prefill_server_is_faster() -> None:
    """The prefill server clears its queue at half the decoder's own cost a token: the
    prefills that began behind others, against those that began alone, say so, and the
    calm overhead is not pushed to zero by a queue counted at the decoder's rate."""
    clock = _Clock()
    remote = RemoteCost(clock)
    per_token, served, overhead = 1e-4, 0.5e-4, 0.05
    for room in range(MIN_REMOTE_SAMPLES):  # alone, one after another
        remote.started(room, 48)
        remote.ended(room, overhead + per_token * 48)
    for room in range(100, 120):  # twenty at once, each behind those before it
        remote.started(room, 100)
    for i, room in enumerate(range(100, 120)):
        remote.ended(room, overhead + per_token * 100 + served * 100 * i)
    remote.started(200, 1000)  # in flight now
    fitted = remote.coefficients(per_token)
    assert fitted is not None
    assert math.isclose(fitted.offset, overhead, rel_tol=1e-6)
    assert math.isclose(fitted.queue_s, served * 1000, rel_tol=1e-6)
    assert math.isclose(fitted.per_queued_token, served, rel_tol=1e-6)
    assert math.isclose(fitted.behind(400).queue_s, served * 400, rel_tol=1e-6)


def test_a_remote_prefill_is_a_fixed_cost_plus_the_prefill_servers_own_rate() -> None:
    """Measured through a decoder (a 1024-token prompt remote in 615 ms, a 41-token one
    in 100 ms) where its own mixed steps cost 0.70 ms a local token: at that rate the
    long prompt leaves no overhead, and a short follow-up was predicted remote in 29 ms
    and sent out, to take 100. The rate between the two lengths says both."""
    clock = _Clock()
    remote = RemoteCost(clock)
    decoder_per_token = 0.70e-3
    for _ in range(MIN_REMOTE_SAMPLES):
        remote.observe(1024, 0.615)
    fitted = remote.coefficients(decoder_per_token)
    assert fitted is not None and fitted.per_token == decoder_per_token  # (one length: no rate)
    remote.observe(41, 0.100)
    remote.observe(41, 0.100)
    fitted = remote.coefficients(decoder_per_token)
    assert fitted is not None
    assert math.isclose(fitted.per_token, 0.515 / 983, rel_tol=1e-6)
    assert math.isclose(fitted.seconds(41), 0.100, rel_tol=1e-6)
    assert math.isclose(fitted.seconds(1024), 0.615, rel_tol=1e-6)
    # the rate outlives the window of the overhead: it is the servers', not the load's
    clock.now += 2 * REMOTE_WINDOW_S
    for _ in range(MIN_REMOTE_SAMPLES):
        remote.observe(1024, 0.715)  # 100 ms more overhead now
    later = remote.coefficients(decoder_per_token)
    assert later is not None and math.isclose(later.seconds(41), 0.200, rel_tol=0.05)


def test_a_rate_needs_two_prefills_apart_on_each_side_begun_alone() -> None:
    """A rate rests on at least two shorter and two longer prefills: one short prefill
    slowed by a first peer lookup (600 ms for 41 tokens) would otherwise pass for a
    server that computes nothing a token, and keep every short prompt here."""
    clock = _Clock()

    def fitted(*samples: tuple[int, float]) -> RemoteCoefficients:
        remote = RemoteCost(clock)
        for tokens, seconds in samples:
            remote.observe(tokens, seconds)
        coefficients = remote.coefficients(1e-4)
        assert coefficients is not None
        return coefficients

    line = [(t, 0.05 + 1e-3 * t) for t in (40, 50, 100, 120)]  # 40 and 50 vs 100 and 120
    assert fitted(*line).per_token == pytest.approx(1e-3)
    assert fitted(*line[:1], *line[2:], (110, 0.16)).per_token == 1e-4  # one short side
    assert fitted(*[(1024, 0.615)] * 4, (41, 0.600)).per_token == 1e-4
    assert fitted((40, 0.09), (60, 0.11), (79, 0.129), (100, 0.15)).per_token == 1e-4  # too alike
    remote = RemoteCost(clock)
    for room, tokens in enumerate((40, 1000, 40, 1000, 40, 1000)):
        remote.started(room, tokens)  # each behind those before it
    for room, tokens in enumerate((40, 1000, 40, 1000, 40, 1000)):
        remote.ended(room, 0.05 + 1e-3 * tokens)
    coefficients = remote.coefficients(1e-4)
    assert coefficients is not None and coefficients.per_token == 1e-4


def test_a_learnt_rate_is_kept_until_prefills_teach_another() -> None:
    """Once the rate is learnt, short prompts stay here and only long ones go remote:
    the pairs it came from leave the kept prefills, and falling back to the decoder's
    own cost would bring the mistake back (a 41-token remote prefill predicted in 29 ms
    instead of 100). A rate of 0 or less says nothing: the last one stays too, and the
    wait per queued token keeps its own prior."""
    clock = _Clock()
    remote = RemoteCost(clock)
    for tokens, seconds in [(1024, 0.615)] * 4 + [(41, 0.100), (41, 0.100)]:
        remote.observe(tokens, seconds)
    learnt = remote.coefficients(0.7e-3)
    assert learnt is not None and learnt.seconds(41) == pytest.approx(0.100)
    for _ in range(300):
        clock.now += 1.0
        remote.observe(1024, 0.615)
    later = remote.coefficients(0.7e-3)
    assert later is not None and later.seconds(41) == pytest.approx(0.100, rel=1e-6)
    # a fast prefill server with a noisy overhead: no rate above 0 to be seen
    noisy = RemoteCost(clock)
    for tokens, seconds in [(40, 0.12), (40, 0.11), (40, 0.13), (200, 0.10), (200, 0.105)]:
        noisy.observe(tokens, seconds)
    fitted = noisy.coefficients(1e-4)
    assert fitted is not None and fitted.per_token == 1e-4 and fitted.per_queued_token == 1e-4


def test_a_remote_prefill_whose_end_never_came_stops_counting_as_queued() -> None:
    clock = _Clock()
    remote = RemoteCost(clock, stale_s=60.0)
    remote.started(1, 500)
    clock.now += 30.0
    remote.started(2, 40)
    assert remote.in_flight_tokens == 540
    clock.now += 31.0
    assert remote.in_flight_tokens == 40  # the first: past the bound
    remote.ended(1, 1.0)  # (its late end teaches nothing)
    assert remote.learnt == 0


def test_unmixed_steps_with_streams_running_have_their_decode_step_between_each_two() -> None:
    """After an unmixed local step the streams decode before the next local step runs,
    whatever share mixed steps taught: 41 one-token steps at 2 streams wait for 40
    decode steps between them (measured at 2 streams on the CPU: 1.14 s, where leaving
    them out predicted 0.12 s)."""
    step = StepCoefficients(0.004, 0.006, 0.001, unmixed_offset=0.011, unmixed_per_token=0.001)
    one_token = LocalStep(1, mixed=False)
    seconds = local_first_token_s(step, 2, 0, 41, one_token, local_share=1.0)
    assert seconds == pytest.approx(41 * step.seconds(0, 1) + 40 * step.seconds(2, 0))
    # no streams: nothing decodes between them
    assert local_first_token_s(step, 0, 0, 41, one_token) == pytest.approx(41 * step.seconds(0, 1))
    # a share below one half still counts its own decode steps
    assert local_first_token_s(step, 2, 0, 41, one_token, local_share=0.25) == pytest.approx(
        41 * step.seconds(0, 1) + 41 * 3 * step.seconds(2, 0)
    )


def test_an_unmixed_step_not_measured_yet_is_judged_at_what_a_mixed_one_costs() -> None:
    """Before any unmixed step was measured its stand-in is a decode fit's offset (4 ms,
    where such a step took 11 on the CPU). A mixed step of the same tokens computes more
    (the streams' decode besides), so its cost bounds the unmixed one's: judged at it, a
    one-step suffix goes remote where that is sooner, and stays where the remote queue
    is long (which the measurement then comes from)."""
    # 2 streams: decode 16 ms; mixing them in costs 20 ms more and 0.7 ms a local token
    unmeasured = StepCoefficients(0.004, 0.006, 0.0007, mixed_offset=0.020)
    one_page = LocalStep(16, mixed=False)
    kw = {"running": 2, "tokens_ahead": 0, "plan": one_page}
    assert local_first_token_s(unmeasured, 2, 0, 16, one_page) == pytest.approx(
        unmeasured.seconds(2, 16)  # 47 ms, not the stand-in's 15
    )
    remote = RemoteCoefficients(offset=0.015, per_token=0.0005)  # 45 ms with the decode step
    assert not prefill_here_is_sooner(unmeasured, remote, tokens=16, **kw)
    assert why_sent_out(unmeasured, remote, tokens=16, **kw) == "slower"
    queued = RemoteCoefficients(offset=0.020, per_token=0.0005, queue_s=10.0)
    assert prefill_here_is_sooner(unmeasured, queued, tokens=16, **kw)
    # measured: its own cost (two 16-token steps of 5.6 ms, the streams' 16 ms between)
    measured = StepCoefficients(
        0.004, 0.006, 0.0007, unmixed_offset=0.004, unmixed_per_token=0.0001
    )
    assert local_first_token_s(measured, 2, 0, 32, one_page) == pytest.approx(
        2 * measured.seconds(0, 16) + measured.seconds(2, 0)
    )
    # no streams: nothing to mix with, the stand-in
    assert local_first_token_s(unmeasured, 0, 0, 16, one_page) == unmeasured.seconds(0, 16)


def test_work_the_slo_plan_carries_in_one_step_spends_no_burst() -> None:
    """A stream sending its prompt again computes one token: the step the SLO allows
    carries it. Judged at the burst instead (a mixed step of the cap into 58 streams,
    0.44 s predicted) it was sent out, and run as one it spent the burst the next
    follow-up needed."""
    cpu = StepCoefficients(0.010, 0.001, 0.001, unmixed_offset=0.010)
    burst = plan_local_step(cpu, 10, slo_factor=1.25, cap=64, page_size=1, burst=True)
    assert burst.then == LocalStep(5, True)
    assert burst_if_needed(burst, 1) == burst_if_it_fits(burst, 1) == LocalStep(5, True)
    assert burst_if_needed(burst, 5) == LocalStep(5, True)
    assert burst_if_needed(burst, 6) == burst_if_it_fits(burst, 6) == burst
    assert burst_if_it_fits(burst, 65) == LocalStep(5, True)  # (the burst cannot finish it)
    # no page within the SLO: the burst stays, however little the work
    tight = plan_local_step(cpu, 10, slo_factor=1.01, cap=64, page_size=16, burst=True)
    assert burst_if_needed(tight, 1) == tight
