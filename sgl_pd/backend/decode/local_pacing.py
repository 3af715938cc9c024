"""Decoder, local prefill: how many local tokens each decode step carries (`core.
local_budget`), from what this decoder's steps cost as it measures them.

Every loop iteration of SGLang's decode scheduler is one step the running streams wait
through: the time from one scheduling call to the next is a step's cost, sampled with
its running requests and local tokens (`StepPacer.stepped`). Without the overlap
scheduler that is the step launched at the first call; with it (SGLang's default on a
GPU) an iteration launches its batch and then waits for the previous one's results, so
the time between two calls is the cost of the batch launched one iteration earlier. Each
rank times its own steps, but the ranks of a TP group must build the same batches, so
every `SYNC_STEPS` iterations rank 0's fitted models (its step cost and the remote
prefills it saw, `DecodeMessenger.remote_cost`) are broadcast to the group and every
rank budgets with those. The iterations are counted alike on every rank: each one's
request intake is itself a collective of the group.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from sgl_pd.core.local_budget import (
    MODEL_WORDS,
    PROBE_EVERY,
    BurstAllowance,
    LocalBias,
    LocalShare,
    LocalStep,
    Models,
    RemoteCoefficients,
    RemoteCost,
    StepCoefficients,
    StepCost,
    burst_if_needed,
    pack_models,
    plan_local_step,
    unpack_models,
)

logger = logging.getLogger("sgl_pd.local_prefill")

SYNC_STEPS = 32  # scheduling iterations between two broadcasts of rank 0's models
REPORT_INTERVAL_S = 60.0  # rank 0 logs the models it budgets with at most this often
# a step this many times slower than predicted spanned something else (a pause, a
# weight update): not a step's cost
OUTLIER_FACTOR = 20.0


class StepPacer:
    """One decode scheduler's step timing, models and per-step local token budget."""

    def __init__(
        self,
        *,
        cap: int,
        slo_factor: float,
        page_size: int,
        burst_every: int = 0,
        overlap: bool = False,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.cap = cap  # the most local tokens a step carries (--pd-local-prefill-step-tokens)
        self.slo_factor = slo_factor
        self.page_size = page_size
        self.cost = StepCost()  # this rank's steps
        self.share = LocalShare()  # of iterations with local work waiting, those running it
        self.overlap = overlap  # an iteration's results are processed in the next one
        self.bias = LocalBias()  # this rank's local first tokens, actual over predicted
        self.burst = BurstAllowance(burst_every)  # a step past the SLO, once in a while
        self._to_run: LocalStep | None = None  # the plan of the local step about to run
        self.step_model: StepCoefficients | None = None  # rank 0's, as last synced
        self.remote_model: RemoteCoefficients | None = None
        self.local_bias = 1.0
        self._clock = clock
        # the shapes (running, local tokens, a burst) launched by the last iterations,
        # None for an iteration that launched nothing; the oldest is what the next gap
        # measures
        self._launched: deque[tuple[int, int, bool] | None] = deque(maxlen=2 if overlap else 1)
        self._iteration_s: float | None = None  # when the last iteration began
        self._iterations = 0
        self.synced_now = False  # this iteration synced the models (every SYNC_STEPS)
        self._local_steps = 0  # launched, counted alike on every rank
        self._reported_s = -REPORT_INTERVAL_S

    def plan(
        self,
        running: int,
        *,
        can_mix: bool = True,
        to_run: bool = False,
        past_slo: bool = False,
        work: int = 0,
    ) -> LocalStep:
        """How the next local step runs with `running` streams: its local tokens, and
        whether it mixes their decode in (`can_mix`: SGLang would). `to_run`: the plan of
        a step about to run (every `PROBE_EVERY`th carries half: a probe for the fit),
        not a prediction. A burst while one is allowed (`BurstAllowance`), in both.
        `past_slo`: the step runs past the SLO whatever it carries (no step fits it, and
        its work may not go out): a burst, allowed or not - one long gap of the streams
        instead of many, each past the SLO too, and the work's first tokens at once.
        `work`: the local tokens waiting (0: not known), which a plan within the SLO may
        carry in one step without the burst (`burst_if_needed`)."""
        plan = plan_local_step(
            self.step_model,
            running,
            slo_factor=self.slo_factor,
            cap=self.cap,
            page_size=self.page_size,
            can_mix=can_mix,
            probe=to_run and self._local_steps % PROBE_EVERY == PROBE_EVERY - 1,
            burst=self.burst.ready or past_slo,
        )
        plan = burst_if_needed(plan, work)
        if to_run:
            self._to_run = plan
        return plan

    def stepped(self, scheduler: Any, remote: RemoteCost | None) -> None:
        """A scheduling iteration begins: the last one's wait for a step ended."""
        now = self._clock()
        full = len(self._launched) == self._launched.maxlen
        measured = self._launched[0] if full else None
        # (a burst is not fitted: one step many times the usual size would move the
        # linear fit's slope for all the steps after it; `LocalBias` learns its error)
        if measured is not None and not measured[2] and self._iteration_s is not None:
            running, local, _ = measured
            seconds = now - self._iteration_s
            model = self.step_model
            unmeasured = model is None or (running == 0 < local and model.unmixed_offset is None)
            # (an unmixed step before one was measured has only a stand-in prediction)
            predicted = None if unmeasured else model.seconds(running, local)  # type: ignore[union-attr]
            if predicted is None or seconds < OUTLIER_FACTOR * max(predicted, 1e-4):
                self.cost.observe(running, local, seconds)
        self._iteration_s = now
        self._to_run = None
        self._launched.append(None)  # (until `launched` says what this iteration runs)
        self._iterations += 1
        self.synced_now = self._iterations % SYNC_STEPS == 0
        if self.synced_now:
            self._sync(scheduler, remote)

    def launched(self, running: int, local_tokens: int) -> None:
        """This iteration launches a step decoding `running` streams and prefilling
        `local_tokens` local prompt tokens."""
        planned, self._to_run = self._to_run, None
        burst = planned is not None and self.burst.spends(planned, running, local_tokens)
        if burst:
            self.burst.spent()
        elif running > 0:
            self.burst.gap()
        if self._launched:  # (empty: a pause came in between)
            self._launched[-1] = (running, local_tokens, burst)
        if local_tokens > 0:
            self._local_steps += 1

    def now(self) -> float:
        return self._clock()

    def paused(self) -> None:
        """The engine pauses: no gap until it runs again measures a step."""
        self._launched.clear()
        self._iteration_s = None

    def _sync(self, scheduler: Any, remote: RemoteCost | None) -> None:
        words = pack_models(Models())  # (another rank's: rank 0's replace them)
        if tp_rank(scheduler) == 0:
            step = self.cost.coefficients()
            per_token = None if step is None else step.per_local_token
            remote_model = None if remote is None else remote.coefficients(per_token)
            words = pack_models(Models(step, remote_model, self.bias.value))
        if getattr(scheduler, "tp_size", 1) > 1:
            import torch
            import torch.distributed as dist

            tensor = torch.tensor(words, dtype=torch.float64)
            assert tensor.numel() == MODEL_WORDS
            dist.broadcast(tensor, src=scheduler.tp_group.ranks[0], group=scheduler.tp_cpu_group)
            words = tensor.tolist()
        models = unpack_models(words)
        self.step_model, self.remote_model = models.step, models.remote
        self.local_bias = models.local_bias
        now = self._clock()
        if tp_rank(scheduler) == 0 and now - self._reported_s >= REPORT_INTERVAL_S:
            self._reported_s = now
            logger.info(
                "local prefill pacing: %s", self.describe(len(scheduler.running_batch.reqs))
            )

    def describe(self, running: int) -> str:
        """The models and the budget at `running` streams, for the log."""
        step, remote = self.step_model, self.remote_model
        return (
            (
                "step not measured yet"
                if step is None
                else f"step {1e3 * step.offset:.2f} ms + {1e3 * step.per_request:.3f} ms a"
                f" request + {1e3 * step.per_local_token:.3f} ms a local token"
                f" + {1e3 * step.per_mixed_request:.3f} ms a request mixed with local tokens"
                f" + {1e3 * step.mixed_offset:.2f} ms a mixed step"
                + (
                    "; unmixed local steps not measured yet"
                    if step.unmixed_offset is None
                    else f"; unmixed local step {1e3 * step.unmixed_offset:.2f} ms + tokens"
                )
            )
            + (
                "; remote prefills not measured yet"
                if remote is None
                else f"; remote prefill {1e3 * remote.offset:.1f} ms +"
                f" {1e3 * remote.per_token:.3f} ms a token + {1e3 * remote.queue_s:.1f} ms"
                " queued now"
            )
            + f"; local first tokens {self.local_bias:.2f}x their prediction"
            + self._described_plan(running)
        )

    def _described_plan(self, running: int) -> str:
        plan = self.plan(running)
        burst = ""
        if plan.then is not None:  # (the burst's own size is the cap: say the SLO's)
            burst = f"; a burst of {plan.tokens} allowed now"
            plan = plan.then
        kind = "mixed" if plan.mixed else "unmixed"
        slo = "" if plan.within_slo else " (past the ITL SLO: local requests go out but to a burst)"
        return (
            f"; {plan.tokens} local tokens a {kind} step at {running} running requests{slo}" + burst
        )


def tp_rank(scheduler: Any) -> int:
    """The scheduler's rank in its TP group, as its sgl_pd manager has it (SGLang's
    scheduler keeps no attribute of its own for it)."""
    queue = getattr(scheduler, "disagg_decode_prealloc_queue", None)
    return int(getattr(getattr(queue, "kv_manager", None), "rank", 0))


def step_shape(batch: Any) -> tuple[int, int]:
    """(streams decoded, local prompt tokens computed) by `batch`: a decode batch, or a
    local step's extend batch with the running streams mixed in (`decoding_reqs`)."""
    decoding = getattr(batch, "decoding_reqs", None)
    if batch.forward_mode.is_decode():
        return len(batch.reqs), 0
    mixed = {id(r) for r in decoding or ()}
    local = sum(
        max(0, int(r.extend_end) - int(r.prefix_len)) for r in batch.reqs if id(r) not in mixed
    )
    return len(mixed), local
