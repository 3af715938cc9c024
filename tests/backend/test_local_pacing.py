"""Step timing for the local prefill budget: each gap between two scheduling calls is
paired with the step it measured - the one launched at the first call, or with the
overlap scheduler the one launched an iteration earlier - and a pause measures nothing."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest

from sgl_pd.backend.decode.local_pacing import StepPacer
from sgl_pd.core.local_budget import MIN_SAMPLES, StepCoefficients

TRUTH = StepCoefficients(offset=0.010, per_request=0.0005, per_local_token=0.001)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class _Scheduler:
    tp_size = 1
    tp_rank = 0
    running_batch = SimpleNamespace(reqs=[])


def _run(pacer: StepPacer, clock: _Clock, shapes: list[tuple[int, int]], overlap: bool) -> None:
    """A decode loop: each iteration launches `shape`; its cost is paid before the next
    call (overlap: during the next iteration, after that one launched its own)."""
    pending: list[tuple[int, int]] = []
    for shape in shapes:
        pacer.stepped(_Scheduler(), None)
        pacer.launched(*shape)
        pending.append(shape)
        if not overlap or len(pending) > 1:
            clock.now += TRUTH.seconds(*pending.pop(0))


def _shapes(n: int) -> list[tuple[int, int]]:
    # local steps now and then, of varied sizes, among decode steps of varied batches
    return [(10 + i % 7, (16 + 8 * (i % 5)) if i % 3 == 0 else 0) for i in range(n)]


@pytest.mark.parametrize("overlap", [False, True])
def test_each_gap_is_paired_with_the_step_it_measured(overlap: bool) -> None:
    clock = _Clock()
    pacer = StepPacer(cap=128, slo_factor=1.25, page_size=1, overlap=overlap, clock=clock)
    _run(pacer, clock, _shapes(40 * MIN_SAMPLES), overlap)
    fitted = pacer.cost.coefficients()
    assert fitted is not None
    assert math.isclose(fitted.per_local_token, TRUTH.per_local_token, rel_tol=0.01)
    assert math.isclose(fitted.per_request, TRUTH.per_request, rel_tol=0.01)


def test_paired_without_the_lag_the_overlap_scheduler_would_hide_the_local_cost() -> None:
    """What pairing each gap with the step launched at its start gets wrong under the
    overlap scheduler: the local tokens' cost lands on the following decode steps."""
    clock = _Clock()
    pacer = StepPacer(cap=128, slo_factor=1.25, page_size=1, overlap=False, clock=clock)
    _run(pacer, clock, _shapes(40 * MIN_SAMPLES), overlap=True)
    fitted = pacer.cost.coefficients()
    assert fitted is not None and fitted.per_local_token < 0.5 * TRUTH.per_local_token


def test_a_pause_measures_nothing() -> None:
    clock = _Clock()
    pacer = StepPacer(cap=128, slo_factor=1.25, page_size=1, clock=clock)
    samples: list[Any] = []
    pacer.cost.observe = lambda *a: samples.append(a)  # type: ignore[method-assign]
    pacer.stepped(_Scheduler(), None)
    pacer.launched(10, 0)
    pacer.paused()
    clock.now += 60.0  # a weight update
    pacer.stepped(_Scheduler(), None)
    pacer.launched(10, 0)
    clock.now += 0.015
    pacer.stepped(_Scheduler(), None)
    assert samples == [(10, 0, pytest.approx(0.015))]


def test_an_unmixed_step_is_measured_before_one_was_whatever_the_stand_in_predicts() -> None:
    """Until an unmixed local step was measured its cost is predicted from stand-ins (a
    decode fit's offset, near 0 at a steady stream count); a real one many times that
    is a measurement, not an outlier to drop - or the plan explores forever."""
    clock = _Clock()
    pacer = StepPacer(cap=128, slo_factor=1.25, page_size=16, clock=clock)
    pacer.step_model = StepCoefficients(3e-6, 2e-4, 2e-6, 1e-6)  # (offset fitted ~0)
    for _ in range(2 * MIN_SAMPLES):
        pacer.stepped(_Scheduler(), None)
        pacer.launched(0, 16)  # a local step alone
        clock.now += 0.006
        pacer.stepped(_Scheduler(), None)
        pacer.launched(64, 0)
        clock.now += 0.013
    pacer.stepped(_Scheduler(), None)
    fitted = pacer.cost.coefficients()
    assert fitted is not None and fitted.unmixed_offset is not None
    assert math.isclose(fitted.seconds(0, 16), 0.006, rel_tol=0.05)


def test_a_burst_is_spent_only_by_a_step_past_the_slo_and_comes_back_after_n_gaps() -> None:
    clock = _Clock()
    pacer = StepPacer(cap=64, slo_factor=1.25, page_size=1, burst_every=100, clock=clock)
    pacer.step_model = StepCoefficients(0.010, 0.001, 0.001, unmixed_offset=0.010)
    pacer.stepped(_Scheduler(), None)
    plan = pacer.plan(10, to_run=True)
    assert plan.tokens == 64 and plan.slo_tokens == 5
    pacer.launched(10, 5)  # admitted no more than the SLO allows: still ready
    assert pacer.burst.ready
    pacer.stepped(_Scheduler(), None)
    pacer.plan(10, to_run=True)
    pacer.launched(10, 0)  # nothing admitted (SGLang's decode step ran)
    assert pacer.burst.ready
    pacer.stepped(_Scheduler(), None)
    pacer.plan(10)  # a prediction, not a step
    pacer.launched(10, 40)
    assert pacer.burst.ready
    pacer.stepped(_Scheduler(), None)
    pacer.plan(10, to_run=True)
    pacer.launched(10, 40)
    assert not pacer.burst.ready
    assert pacer.plan(10).tokens == 5  # every step within the SLO again
    for _ in range(99):  # the streams' gaps count; idle iterations do not
        pacer.stepped(_Scheduler(), None)
        pacer.launched(10, 0)
        pacer.stepped(_Scheduler(), None)
    assert not pacer.burst.ready
    pacer.stepped(_Scheduler(), None)
    pacer.launched(10, 0)
    assert pacer.plan(10).tokens == 64


def test_a_burst_step_is_not_fitted() -> None:
    """One step many times the usual size would move the fit's slope for every step
    after it (`LocalBias` learns how far a burst's prediction was off instead)."""
    clock = _Clock()
    pacer = StepPacer(cap=512, slo_factor=1.25, page_size=1, burst_every=100, clock=clock)
    pacer.step_model = StepCoefficients(0.010, 0.001, 0.001, unmixed_offset=0.010)
    pacer.stepped(_Scheduler(), None)
    pacer.plan(10, to_run=True)
    pacer.launched(10, 512)
    clock.now += 5.0  # (far off the linear model: it would dominate the fit)
    pacer.stepped(_Scheduler(), None)
    assert pacer.cost._mixed.samples == 0 and pacer.cost._decode.samples == 0


def test_a_negative_burst_interval_is_refused_with_the_flag_named() -> None:
    from sgl_pd.config import SglPdConfig
    from sgl_pd.errors import ConfigError

    with pytest.raises(ConfigError, match="--pd-local-prefill-burst-every must be >= 0"):
        SglPdConfig(local_prefill_burst_every=-1)
    assert SglPdConfig(local_prefill_burst_every=0).local_prefill_burst_every == 0
