"""How much local prefill a decoder's step may carry, and whether a request is prefilled
there at all (pure: the standard library and numpy).

A decode step that also prefills k prompt tokens for a local request costs the running
streams time: their next token waits for the whole forward. The decoder measures what its
own steps cost (`StepCost`, fitted online from every step it runs, forgetting old ones):
a plain decode step is a + b * running requests; a local step adds c * local tokens,
plus d * running requests when it mixes the streams' decode into the local forward (they
go through the attention backend's extend path, which may cost each of them more than a
decode step: SGLang's `torch_native` backend attends over a stream's whole context again
for its one new token), or is e + c * local tokens when it runs alone (unmixed: the
streams then wait for it and for their own decode step). Each step takes the kind that
carries more local tokens within the ITL SLO, a factor over the predicted plain decode
step (`plan_local_step`), but for a step once in a while that may carry the cap at once
(`BurstAllowance`: the SLO then holds for the streams' p99 gap, not for every gap).
Where extend tokens are nearly free (a GPU) the fitted c and d are small and the budget
grows to its cap by itself; where they are dear (a CPU) it shrinks - no per-device
constant.

SGLang's `PrefillAdder` takes one token per running request out of both of its prefill
budgets when the step mixes decode into the prefill forward (`num_mixed_decode_tokens`):
a budget of k admits nothing once k streams run, and a chunked request would continue
with a negative chunk. `adder_budget` adds them back, so the adder is left with exactly
the local tokens at any batch size.

Whether a request is prefilled here is decided by its predicted first token
(`prefill_here_is_sooner`): the local steps it needs (behind the local work queued
already) times the step's time, against a remote prefill as this decoder has seen them
take lately (`RemoteCost`: its tokens' compute at the decoder's own per-token cost, the
wait behind the remote prefills this decoder has in flight, at the rate learnt from
those that began behind others, plus the median overhead of the last half minute's
remote prefills, from bootstrap to the last KV word, net of the same two). A local
request that no step admitted within `ADMISSION_STEPS` steps is sent to a prefill server
after all (`LocalWait`).
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

# scheduling steps a local request may wait unadmitted before it goes to a prefill server
ADMISSION_STEPS = 8
FORGETTING = 0.98  # weight of a sample relative to the next one (~50 steps remembered)
MIN_SAMPLES = 8  # steps of a kind seen before a fit of them is used
# every this many local steps one carries half the tokens the SLO allows: at one size and
# one stream count a local token's cost and the mixing's are one sum no fit can split,
# and a split that drifts would end in a wrong plan
PROBE_EVERY = 4
# the rooms of direct requests that reached the scheduler a local offer lists: an offer is
# written at least every 0.25 s, and a claimed burst whose room fell off the list is
# released when its request ends instead
ARRIVALS_OFFERED = 64
# remote prefills seen before theirs is: a decoder sees far fewer of them than steps, and
# until then every placement stays local
MIN_REMOTE_SAMPLES = 4
REMOTE_WINDOW_S = 30.0  # remote prefills older than this say nothing of the load now
# a remote prefill in flight this long is not counted as queued (its end may never be
# reported: a request SGLang dropped without letting go of it)
STALE_REMOTE_S = 120.0
REMOTE_SAMPLES_KEPT = 256
# a remote prefill's rate a token is learnt from pairs of prefills this far apart in length
MIN_SLOPE_SPREAD = 32  # tokens (and one at least twice the other)
MIN_SLOPE_SIDE = 2  # distinct prefills on each side of those pairs, at least
MIN_BIAS, MAX_BIAS = 0.25, 4.0  # a local first token's actual / predicted, as counted
_RIDGE = 1e-9  # keeps the normal equations solvable before the features vary


class OnlineLinearFit:
    """y ~ w . x, fitted by exponentially weighted least squares (old samples fade by
    `forgetting` per new one). `x`: the feature vector."""

    def __init__(self, features: int, forgetting: float = FORGETTING) -> None:
        self._forgetting = forgetting
        self._xtx = np.zeros((features, features))  # weighted sum of x x^T
        self._xty = np.zeros(features)  # weighted sum of x y
        self.samples = 0

    def observe(self, x: tuple[float, ...], y: float) -> None:
        if not math.isfinite(y):
            return
        v = np.asarray(x, dtype=np.float64)
        self._xtx = self._forgetting * self._xtx + np.outer(v, v)
        self._xty = self._forgetting * self._xty + v * y
        self.samples += 1

    def coefficients(self) -> tuple[float, ...] | None:
        """The fitted w, or None before `MIN_SAMPLES` samples."""
        if self.samples < MIN_SAMPLES:
            return None
        n = len(self._xty)
        scale = max(1.0, float(np.trace(self._xtx)) / n)
        w = np.linalg.solve(self._xtx + _RIDGE * scale * np.eye(n), self._xty)
        return tuple(float(c) for c in w)


@dataclass(frozen=True)
class StepCoefficients:
    """A step's seconds. Plain decode: offset + per_request * running. A mixed local step
    (`running` > 0 streams decoded in its forward) adds mixed_offset + per_local_token *
    local tokens + per_mixed_request * running (`mixing_s`: all but the tokens). An
    unmixed one decodes no stream and costs unmixed_offset + unmixed_per_token * local
    tokens (None: no unmixed step measured yet; `offset` and `per_local_token` stand
    in)."""

    offset: float
    per_request: float
    per_local_token: float
    per_mixed_request: float = 0.0
    unmixed_offset: float | None = None
    unmixed_per_token: float | None = None
    # (a mixed step builds an extend batch besides its streams' decode: a cost of its own
    # that, left out, a fit would spread over the tokens and streams of the steps it saw)
    mixed_offset: float = 0.0

    def seconds(self, running: int, local_tokens: int) -> float:
        decode = max(self.offset + self.per_request * running, 0.0)
        if local_tokens <= 0:
            return decode
        if running > 0:
            return decode + self.mixing_s(running) + max(self.per_local_token, 0.0) * local_tokens
        return self.alone_offset() + self.alone_per_token() * local_tokens

    def mixing_s(self, running: int) -> float:
        """What a mixed local step adds to its `running` streams' decode besides its
        tokens."""
        # (the sum clamped, not the offset: a fit may split one cost into a negative
        # offset and a steeper slope, and their sum is what it measured)
        return max(self.mixed_offset + self.per_mixed_request * running, 0.0)

    def alone_offset(self) -> float:
        """What an unmixed local step costs besides its tokens."""
        offset = self.offset if self.unmixed_offset is None else self.unmixed_offset
        return max(offset, 0.0)

    def alone_per_token(self) -> float:
        per_token = (
            self.per_local_token if self.unmixed_per_token is None else self.unmixed_per_token
        )
        return max(per_token, 0.0)


class StepCost:
    """What this decoder's steps cost, from the steps it ran. A step's time is the whole
    loop iteration (scheduling, the forward, output processing): what a stream waits
    between two tokens.

    Three fits, each forgetting only as its own kind of step arrives: plain decode steps
    (a + b * running), what a mixed local step adds to the decode its streams would cost
    (f + c * local + d * running), and unmixed local steps (e + c' * local). A decoder that
    runs one kind for a while - or sends every local request out - keeps what the
    others cost instead of fading them to "free"."""

    def __init__(self) -> None:
        self._decode = OnlineLinearFit(2)  # (1, running)
        self._mixed = OnlineLinearFit(3)  # (1, local tokens, running): over the decode
        self._unmixed = OnlineLinearFit(2)  # (1, local tokens)

    def observe(self, running: int, local_tokens: int, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds <= 0:
            return
        if local_tokens <= 0:
            self._decode.observe((1.0, float(running)), seconds)
        elif running == 0:
            self._unmixed.observe((1.0, float(local_tokens)), seconds)
        else:
            decode = self._decode.coefficients()
            if decode is None:
                return  # (what the local work added is not known before the decode cost)
            added = seconds - (decode[0] + decode[1] * running)
            self._mixed.observe((1.0, float(local_tokens), float(running)), added)

    def coefficients(self) -> StepCoefficients | None:
        """The fitted costs, or None before `MIN_SAMPLES` decode steps and as many local
        steps of a kind were seen. Until mixed steps were, their token cost is the
        unmixed one's and mixing is free (the first mixed steps measure it)."""
        decode = self._decode.coefficients()
        mixed, unmixed = self._mixed.coefficients(), self._unmixed.coefficients()
        if decode is None or (mixed is None and unmixed is None):
            return None
        if mixed is not None:
            mixed_offset, per_token, per_mixed = mixed
        else:
            assert unmixed is not None
            mixed_offset, per_token, per_mixed = 0.0, unmixed[1], 0.0
        return StepCoefficients(
            decode[0],
            decode[1],
            per_token,
            per_mixed,
            None if unmixed is None else unmixed[0],
            None if unmixed is None else unmixed[1],
            mixed_offset,
        )


@dataclass(frozen=True)
class LocalStep:
    """How the next local step runs: `tokens` local prompt tokens, `mixed` with the
    running streams' decode in the same forward or alone (they decode in the step after),
    and whether it keeps the streams within the ITL SLO - a step always carries at least
    one page, so a local request progresses even where none would. `then`: this is a
    burst step (`BurstAllowance`), and `then` the plan of the steps after it."""

    tokens: int
    mixed: bool
    within_slo: bool = True
    then: LocalStep | None = None

    @property
    def slo_tokens(self) -> int:
        """The local tokens the SLO itself allows this step: more is a burst."""
        plan = self.then if self.then is not None else self
        return plan.tokens if plan.within_slo else 0


class BurstAllowance:
    """One local step in every `every` gaps of the running streams (the steps that
    decoded them) may go past the ITL SLO and carry a whole local prompt (up to the
    step's cap) at once. A burst lengthens one gap of the streams - a mixed step's, or
    after an unmixed one the decode step it delays - so at most one gap in `every` is a
    burst's and the others are planned within the SLO: with `every` >= 100 the SLO holds
    for the streams' p99 gap rather than for every gap. A follow-up prefilled in one
    step gets its first token about as a monolithic server would give it, where steps
    each within the SLO would spread it over many - on a CPU, longer than a remote
    prefill takes. Counted from the launched steps' shapes, alike on every rank of a TP
    group; 0: never (every step within the SLO). Ready from the start."""

    def __init__(self, every: int) -> None:
        self.every = every
        self._since = every  # the streams' gaps since the last burst

    @property
    def ready(self) -> bool:
        return self.every > 0 and self._since >= self.every

    def gap(self) -> None:
        """A step decoded the streams."""
        self._since += 1

    def spent(self) -> None:
        self._since = 0

    def spends(self, plan: LocalStep, running: int, local_tokens: int) -> bool:
        """Whether a step launched as `plan` with that shape went past the SLO: a burst
        plan whose step carried more local tokens than the SLO allows, or ran in the
        other kind than the SLO's plan (a small step in the burst's kind may cost the
        streams more than the SLO too)."""
        within = plan.then
        if within is None or local_tokens <= 0:
            return False
        return local_tokens > plan.slo_tokens or (running > 0) != within.mixed


def plan_local_step(
    model: StepCoefficients | None,
    running: int,
    *,
    slo_factor: float,
    cap: int,
    page_size: int,
    can_mix: bool = True,
    probe: bool = False,
    burst: bool = False,
) -> LocalStep:
    """The next local step at `running` streams: mixed (the streams wait for one forward
    of their decode, the mixing and the local tokens) or unmixed (they wait for a forward
    of the local tokens alone, then their own decode step), whichever carries more local
    tokens within `slo_factor` x the predicted plain decode step; whole pages, between
    one page and `cap`. `can_mix`: SGLang mixes the step (no logprobs asked on either
    side). Before the model is fitted, with the SLO off (`slo_factor` <= 0) or without
    streams: `cap`, mixed where it can be (those steps are the measurements); where only
    an unmixed step might fit and none was measured yet, one page unmixed (a
    measurement too). `probe` (every `PROBE_EVERY` local steps): half the tokens where
    that is still a page or more, so that the fit sees steps of more than one size.
    `burst` (`BurstAllowance.ready`): `cap` tokens, in the kind the streams wait least
    through, wherever the SLO allows fewer (not probed: its size differs anyway); its
    `then` is the plan the SLO allows, unprobed."""
    floor = max(1, page_size)
    cap = max(cap - cap % floor, floor)  # whole pages, as SGLang's chunks are
    if model is None or slo_factor <= 0 or running == 0:
        return _probed(LocalStep(cap, mixed=can_mix), probe, floor)
    within = _within_slo(model, running, slo_factor, cap, floor, can_mix)
    if not burst or within.slo_tokens >= cap:
        return _probed(within, probe, floor)
    # the kind the streams wait least through: one forward, or the local one then theirs
    mixed = can_mix and (
        model.unmixed_offset is None
        or model.seconds(running, cap) <= model.seconds(0, cap) + model.seconds(running, 0)
    )
    return LocalStep(cap, mixed, then=within)


def _within_slo(
    model: StepCoefficients,
    running: int,
    slo_factor: float,
    cap: int,
    floor: int,
    can_mix: bool,
) -> LocalStep:
    """`plan_local_step` where every step keeps within the SLO (not probed)."""
    decode_s = model.seconds(running, 0)
    slack = (slo_factor - 1.0) * decode_s  # what the streams may wait beyond their step
    # (mixed, what the step costs the streams besides its tokens, a token's cost)
    options: list[tuple[bool, float, float]] = []
    if can_mix:
        options.append((True, model.mixing_s(running), max(model.per_local_token, 0.0)))
    if model.unmixed_offset is not None:
        options.append((False, model.alone_offset(), model.alone_per_token()))
    best: LocalStep | None = None
    for mixed, overhead, per_token in options:
        if overhead > slack:
            continue
        tokens = cap if per_token <= 0 else int(min(float(cap), (slack - overhead) / per_token))
        tokens -= tokens % floor  # whole pages, as SGLang's chunks are
        if tokens >= floor and (best is None or tokens > best.tokens):
            best = LocalStep(tokens, mixed)
    if best is not None:
        return best
    if model.unmixed_offset is None:
        return LocalStep(floor, mixed=False)  # not measured yet: a page measures it
    # not even a page fits: the cheaper kind, one page (the request should go out)
    mixed, _, _ = min(options, key=lambda option: option[1] + option[2] * floor)
    return LocalStep(floor, mixed, within_slo=False)


def burst_if_needed(plan: LocalStep, work: int) -> LocalStep:
    """`plan`, unless it is a burst and the plan the SLO allows computes `work` local
    tokens in one step within it: then that plan (the burst would cost the streams more
    and spend the allowance on work that needs none - a stream's prompt sent again, one
    token)."""
    if plan.then is not None and plan.then.within_slo and 0 < work <= plan.then.tokens:
        return plan.then
    return plan


def burst_if_it_fits(plan: LocalStep, work: int) -> LocalStep:
    """`plan` as `burst_if_needed` has it, unless it is a burst that cannot compute `work`
    local tokens in its one step: then the plan the SLO allows (its other steps would go
    past the SLO too)."""
    plan = burst_if_needed(plan, work)
    if plan.then is None or work <= plan.tokens:
        return plan
    return plan.then


def _probed(plan: LocalStep, probe: bool, floor: int) -> LocalStep:
    """Half the plan's tokens (whole pages) for a probe, where that leaves a page."""
    half = plan.tokens // 2
    half -= half % floor
    if not probe or half < floor:
        return plan
    return LocalStep(half, plan.mixed, plan.within_slo)


def adder_budget(local_tokens: int, running: int, mixed: bool) -> int:
    """The `max_prefill_tokens` and `chunked_prefill_size` to give SGLang's
    `PrefillAdder` for a step of `local_tokens` local tokens: it subtracts one token per
    running request from both when the step mixes decode in (`mixed`), whether it then
    mixes or not."""
    return local_tokens + (running if mixed else 0)


@dataclass(frozen=True)
class RemoteCoefficients:
    """A remote prefill, as the decoder sees it: offset + per_token * tokens computed +
    queue_s, the wait behind this decoder's remote prefills in flight (when the model
    was made; `per_queued_token` of them each)."""

    offset: float
    per_token: float
    queue_s: float = 0.0
    per_queued_token: float = 0.0

    def seconds(self, tokens: int) -> float:
        return max(self.offset, 0.0) + max(self.per_token, 0.0) * tokens + max(self.queue_s, 0.0)

    def behind(self, queued_tokens: int) -> RemoteCoefficients:
        """The same prefill behind `queued_tokens` in flight instead (a count newer
        than the model's)."""
        return replace(self, queue_s=max(self.per_queued_token, 0.0) * max(queued_tokens, 0))


class RemoteCost:
    """What remote prefills took lately, from the decoder's first sight of a request to
    its last KV word: bootstrap, the prefill server's queue and forward, the transfer.

    A remote prefill computes its tokens at the rate that the prefills which began
    alone show between their lengths (`_remote_slope`: the prefill server's rate, and a
    long prompt in one forward may cost less a token there than in this decoder's mixed
    steps; until prompts far enough apart were seen, this decoder's own per-token
    cost). It also waits for the tokens of the remote prefills this decoder had in
    flight when it began (`started`): a burst of requests at once queues each behind
    those before it, and the queue a new one would join is the one in flight now. How
    long a queued token holds it up is learnt from the prefills that began behind
    others, against those that began with none (the median of their extra wait per
    token ahead; before both were seen, the per-token rate): the prefill servers may
    drain a queue faster or slower than one prefill alone, or share it among several.
    The rest - connection, transfer, other decoders' load - comes and goes: it is the
    median of what the last `REMOTE_WINDOW_S` seconds' prefills took beyond their
    tokens' compute and their queue. So neither a burst long gone nor one in flight now
    is mistaken for the other. A prefill in flight for longer than `stale_s` counts as
    queued no more (one whose end was never reported must not keep every later request
    local).

    Thread-safe: the decoder's scheduler starts requests, its completion path ends
    them."""

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, stale_s: float = STALE_REMOTE_S
    ) -> None:
        self._clock = clock
        self._stale_s = stale_s
        self._lock = threading.Lock()
        # (ended at, tokens, seconds, tokens in flight ahead of it)
        self._seen: deque[tuple[float, int, float, int]] = deque(maxlen=REMOTE_SAMPLES_KEPT)
        # room -> (began at, tokens, tokens ahead), oldest first
        self._in_flight: dict[int, tuple[float, int, int]] = {}
        self._in_flight_tokens = 0
        self._rate: float | None = None  # seconds a token, as last learnt (`_remote_slope`)

    def started(self, room: int, tokens: int) -> None:
        """A remote prefill of `tokens` tokens began (a retried room starts afresh)."""
        with self._lock:
            self._drop(room)
            self._expire()
            tokens = max(0, tokens)
            self._in_flight[room] = (self._clock(), tokens, self._in_flight_tokens)
            self._in_flight_tokens += tokens

    def ended(self, room: int, seconds: float | None = None) -> None:
        """The remote prefill of `room` ended after `seconds` (None: it failed or was let
        go; nothing is learnt). Ending a room not in flight does nothing."""
        with self._lock:
            began = self._drop(room)
            if began is not None and seconds is not None:
                self._observe(began[1], began[2], seconds)

    def observe(self, tokens: int, seconds: float, tokens_ahead: int = 0) -> None:
        with self._lock:
            self._observe(max(0, tokens), max(0, tokens_ahead), seconds)

    def _observe(self, tokens: int, ahead: int, seconds: float) -> None:
        if math.isfinite(seconds) and seconds > 0:
            self._seen.append((self._clock(), tokens, seconds, ahead))

    def _drop(self, room: int) -> tuple[float, int, int] | None:
        began = self._in_flight.pop(room, None)
        if began is not None:
            self._in_flight_tokens -= began[1]
        return began

    def _expire(self) -> None:
        """Drops the prefills in flight past `stale_s` (oldest first: dicts keep order)."""
        since = self._clock() - self._stale_s
        while self._in_flight:
            room, (began_s, _, _) = next(iter(self._in_flight.items()))
            if began_s >= since:
                return
            self._drop(room)

    @property
    def in_flight_tokens(self) -> int:
        """Tokens of the remote prefills in flight now."""
        with self._lock:
            self._expire()
            return self._in_flight_tokens

    @property
    def learnt(self) -> int:
        """Remote prefills remembered (the window's and older)."""
        return len(self._seen)

    def coefficients(self, per_token: float | None) -> RemoteCoefficients | None:
        """With the decoder's per-token compute cost (s; None: not measured yet), or None
        before `MIN_REMOTE_SAMPLES` prefills ended. From the window's prefills, or where
        it holds fewer, the last `MIN_REMOTE_SAMPLES` (a decoder that kept every request
        for a while still knows what a remote prefill took last: without a model every
        request would stay here, in however many steps the ITL SLO spreads it over)."""
        since = self._clock() - REMOTE_WINDOW_S
        with self._lock:
            self._expire()
            recent = [(t, s, ahead) for at, t, s, ahead in self._seen if at >= since]
            if len(recent) < MIN_REMOTE_SAMPLES:
                last = list(self._seen)[-MIN_REMOTE_SAMPLES:]
                recent = [(t, s, ahead) for _, t, s, ahead in last]
            queued = self._in_flight_tokens
            alone = [(at, t, s) for at, t, s, ahead in self._seen if ahead == 0]
            # (every kept prefill, not only the window's: a rate is the hardware's, not the
            # load's; and it is kept once learnt, as the prefills it came from leave)
            self._rate = _remote_slope(alone) or self._rate
            learnt = self._rate
        if per_token is None or len(recent) < MIN_REMOTE_SAMPLES:
            return None
        prior = max(per_token, 0.0)
        per_token = prior if learnt is None else learnt
        residuals = [(s - per_token * t, ahead) for t, s, ahead in recent]
        rate = _queue_rate(residuals, prior)
        overhead = statistics.median(r - rate * ahead for r, ahead in residuals)
        return RemoteCoefficients(max(overhead, 0.0), per_token, rate * queued, rate)


def _remote_slope(alone: list[tuple[float, int, float]]) -> float | None:
    """Seconds a remote prefill takes per token it computes: the median slope between
    prefills that began alone ((ended at, tokens, seconds), none ahead) whose lengths
    differ enough - one at least twice the other and `MIN_SLOPE_SPREAD` tokens more -
    and which ended within `REMOTE_WINDOW_S` of each other (under alike load: the load
    of other decoders, unseen here, must not pass for a rate); None unless such pairs
    join at least `MIN_SLOPE_SIDE` distinct shorter and longer prefills, or where their
    median is not above 0. A median of pairs (Theil-Sen) over several prefills a side:
    one slowed by something else moves it little. A fixed slope from elsewhere would
    fold whatever it gets wrong into the overhead: too steep, and a long prompt's
    prefill seems to have none, so a short one is predicted far sooner than it comes."""
    if len(alone) < 2 * MIN_SLOPE_SIDE:
        return None
    ended = np.array([at for at, _, _ in alone], dtype=np.float64)
    tokens = np.array([t for _, t, _ in alone], dtype=np.float64)
    seconds = np.array([s for _, _, s in alone], dtype=np.float64)
    longer = tokens[None, :] - tokens[:, None]  # [i, j]: j's tokens beyond i's
    apart = (tokens[None, :] >= 2 * tokens[:, None]) & (longer >= MIN_SLOPE_SPREAD)
    apart &= np.abs(ended[None, :] - ended[:, None]) <= REMOTE_WINDOW_S
    shorter_side, longer_side = apart.any(axis=1).sum(), apart.any(axis=0).sum()
    if min(int(shorter_side), int(longer_side)) < MIN_SLOPE_SIDE:
        return None
    slope = float(np.median((seconds[None, :] - seconds[:, None])[apart] / longer[apart]))
    return slope if slope > 0 else None


def _queue_rate(residuals: list[tuple[float, int]], prior: float) -> float:
    """Seconds a remote prefill waits per token in flight ahead of it: the median of
    (residual - the median residual of those with nothing ahead) / tokens ahead over
    those with some; `prior` until at least `MIN_REMOTE_SAMPLES // 2` of each were seen.
    `residuals`: (seconds beyond the prefill's own tokens' compute, tokens ahead)."""
    alone = [r for r, ahead in residuals if ahead == 0]
    behind = [(r, ahead) for r, ahead in residuals if ahead > 0]
    enough = max(1, MIN_REMOTE_SAMPLES // 2)
    if len(alone) < enough or len(behind) < enough:
        return prior
    base = statistics.median(alone)
    return max(0.0, statistics.median((r - base) / ahead for r, ahead in behind))


def local_first_token_s(
    step: StepCoefficients,
    running: int,
    tokens_ahead: int,
    tokens: int,
    plan: LocalStep,
    local_share: float = 1.0,
) -> float:
    """Predicted seconds to a local request's first token: the steps until its last
    chunk ran (the local tokens queued before it, then its own - one at least: SGLang
    computes the last prompt token of a whole prefix hit again - `plan.tokens` a step,
    the last step carrying what is left; that step samples the first token) and the
    decode steps between them (`local_share`: the share of iterations with local work
    waiting that ran a local step - after an unmixed step the streams' decode step is
    one of those, so unmixed steps with streams running have one between each two
    whatever share steps of the other kind taught)."""
    work = tokens_ahead + max(1, tokens)
    seconds = 0.0
    if plan.then is not None:  # a burst step first, then steps within the SLO
        seconds += _local_steps_s(step, running, min(work, plan.tokens), plan, local_share)
        work, plan = work - plan.tokens, plan.then
    if work > 0:
        seconds += _local_steps_s(step, running, work, plan, local_share)
    return seconds


def _local_steps_s(
    step: StepCoefficients, running: int, work: int, plan: LocalStep, local_share: float
) -> float:
    """Seconds for steps as `plan` to compute `work` local tokens, with the decode steps
    between them. An unmixed step while streams run, before any was measured, is taken
    to cost what a mixed step of its tokens would: it computes less (the tokens without
    the streams' decode), so that bounds it, where the stand-in (`StepCoefficients`: a
    decode fit's offset, 4 ms on a CPU where such a step took 11) would call it nearly
    free."""
    per_step = max(1, plan.tokens)
    unmeasured = not plan.mixed and running > 0 and step.unmixed_offset is None
    decoded = running if plan.mixed or unmeasured else 0
    full, rest = divmod(work, per_step)
    local_steps = full + (1 if rest else 0)
    prefill = full * step.seconds(decoded, per_step) + (step.seconds(decoded, rest) if rest else 0)
    decode_steps = local_steps * (1.0 / max(local_share, 0.05) - 1.0)
    if not plan.mixed and running > 0:  # (the streams decode after each unmixed step)
        decode_steps = max(decode_steps, local_steps - 1.0)
    return prefill + decode_steps * step.seconds(running, 0)


class LocalBias:
    """How much longer local first tokens took than `local_first_token_s` predicted: the
    median of actual / predicted over the local requests whose first token came in the
    last `REMOTE_WINDOW_S` seconds, 1 with none; a ratio outside [`MIN_BIAS`,
    `MAX_BIAS`] spanned something else (a pause, a burst of retractions) and is not
    counted. What the model leaves out - output processing, a step's scheduling, the
    streams' turns between steps - it learns, so a follow-up placed here for a first
    token predicted sooner than remote gets it sooner in fact. Like `RemoteCost` it
    forgets: a burst that made local requests late, once gone, does not keep every later
    one remote (none of those would measure it again)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: deque[tuple[float, float]] = deque(maxlen=REMOTE_SAMPLES_KEPT)

    def observe(self, predicted_s: float, actual_s: float) -> None:
        if not (math.isfinite(predicted_s) and math.isfinite(actual_s)) or predicted_s <= 0:
            return
        ratio = actual_s / predicted_s
        if MIN_BIAS <= ratio <= MAX_BIAS:
            self._seen.append((self._clock(), ratio))

    @property
    def value(self) -> float:
        since = self._clock() - REMOTE_WINDOW_S
        recent = [ratio for at, ratio in self._seen if at >= since]
        return statistics.median(recent) if recent else 1.0


class LocalShare:
    """Of the scheduling iterations that began with local work waiting, the share that
    ran a local step, smoothed (the others ran SGLang's decode step: the streams' turn,
    transferred requests joining). Counted, so alike on every rank."""

    def __init__(self, smoothing: float = 0.05) -> None:
        self._smoothing = smoothing
        self.value = 1.0

    def observe(self, ran_local: bool) -> None:
        """An iteration with local work waiting ran a local step or not."""
        self.value += self._smoothing * (float(ran_local) - self.value)


def prefill_here_is_sooner(
    step: StepCoefficients | None,
    remote: RemoteCoefficients | None,
    *,
    running: int,
    tokens_ahead: int,
    tokens: int,
    plan: LocalStep,
    local_share: float = 1.0,
    local_bias: float = 1.0,
) -> bool:
    """Whether the first token comes sooner prefilled here, in steps as `plan` (the
    prediction times `local_bias`: how far local predictions fell short lately), than
    remote: its prefill and transfer, then the decode step that samples its first token.
    Without both models fitted: here (the placement rules chose it; the steps teach the
    models)."""
    if step is None or remote is None:
        return True
    here = local_first_token_s(step, running, tokens_ahead, tokens, plan, local_share)
    return here * local_bias <= remote.seconds(tokens) + step.seconds(running + 1, 0)


def why_sent_out(
    step: StepCoefficients | None,
    remote: RemoteCoefficients | None,
    *,
    running: int,
    tokens_ahead: int,
    tokens: int,
    plan: LocalStep,
    local_share: float = 1.0,
    local_bias: float = 1.0,
) -> str | None:
    """Why a local request of `tokens` uncached tokens, whose steps run as `plan` (a burst
    only where it finishes the work: `burst_if_it_fits`), goes to a prefill server instead:
    "slower" (its first token is predicted sooner remote, `prefill_here_is_sooner`),
    "itl_slo" (no step carries it within the ITL SLO), or None: it stays here."""
    if not prefill_here_is_sooner(
        step, remote, running=running, tokens_ahead=tokens_ahead, tokens=tokens, plan=plan,
        local_share=local_share, local_bias=local_bias,
    ):  # fmt: skip
        return "slower"
    return None if plan.within_slo else "itl_slo"


def offerable_room(room: object) -> bool:
    """A bootstrap room a local offer may list: what the HTTP process makes (`placement.
    direct_room`), a non-negative int; a request's own room of any other kind is not
    listed, so that no client's room makes the offer unreadable."""
    return type(room) is int and room >= 0


@dataclass(frozen=True)
class LocalOffer:
    """What a decoder's scheduler would offer a local request now: its models, the
    streams running, the local tokens queued and how it plans steps. Its HTTP process
    places a direct request by it (`remote_is_sooner`) before the request reaches the
    scheduler, so that one whose first token is sooner remote is submitted to a prefill
    server at once instead of crossing the scheduler first (which would then send it out
    anyway, a scheduling step and a hand-off later). The scheduler still decides for
    every request placed with it."""

    written_s: float  # wall clock (time.time()) when the scheduler wrote it
    models: Models
    running: int
    tokens_ahead: int
    local_share: float
    burst_ready: bool
    slo_factor: float
    cap: int
    page_size: int
    can_mix: bool = True  # no running stream asks for logprobs (SGLang would mix)
    may_send_out: bool = True  # the scheduler sends local requests out at all
    # the bootstrap rooms of the last requests its HTTP process placed here that reached
    # the scheduler and left its local queue, newest last (of the last `ARRIVALS_OFFERED`
    # to arrive): `burst_ready` accounts for them (`local_offer`)
    arrived_rooms: tuple[int, ...] = ()

    def to_json(self) -> str:
        fields = {k: v for k, v in self.__dict__.items() if k != "models"}
        return json.dumps({**fields, "models": pack_models(self.models)})

    @classmethod
    def from_json(cls, text: str) -> LocalOffer:
        """The offer `text` holds; ValueError for anything else (another version's)."""
        try:
            fields = json.loads(text)
            arrived = tuple(fields.get("arrived_rooms", ()))
            models = unpack_models(fields["models"])
            offer = cls(**{**fields, "models": models, "arrived_rooms": arrived})
            numbers = (offer.written_s, offer.local_share, offer.slo_factor)
            counts = (offer.running, offer.tokens_ahead, offer.cap, offer.page_size)
        except (TypeError, KeyError, IndexError, AttributeError) as e:
            raise ValueError(f"not a local offer: {e}") from None
        if (
            not all(isinstance(v, (int, float)) for v in numbers)
            or not all(isinstance(v, int) and v >= 0 for v in counts)
            or not all(offerable_room(room) for room in offer.arrived_rooms)
        ):
            raise ValueError("not a local offer: a field of the wrong type")
        return offer


def remote_is_sooner(offer: LocalOffer, tokens: int, queued_tokens: int | None = None) -> bool:
    """Whether the scheduler behind `offer` would send a plain local request (no
    logprobs, adapter or whole-prompt feature: those it never sends out) of `tokens`
    uncached tokens to a prefill server: its own check when such a request arrives
    (`why_sent_out`), made with what the offer says of it - but for the remote queue,
    `queued_tokens` in flight now where the caller knows it (the offer's is as old as
    the offer)."""
    if not offer.may_send_out:
        return False
    remote = offer.models.remote
    if remote is not None and queued_tokens is not None:
        remote = remote.behind(queued_tokens)
    plan = plan_local_step(
        offer.models.step, offer.running, slo_factor=offer.slo_factor, cap=offer.cap,
        page_size=offer.page_size, can_mix=offer.can_mix, burst=offer.burst_ready,
    )  # fmt: skip
    why = why_sent_out(
        offer.models.step, remote, running=offer.running,
        tokens_ahead=offer.tokens_ahead, tokens=tokens,
        plan=burst_if_it_fits(plan, offer.tokens_ahead + max(1, tokens)),
        local_share=offer.local_share, local_bias=offer.models.local_bias,
    )  # fmt: skip
    return why is not None


class LocalWait:
    """The scheduling steps each queued local request has waited unadmitted: counted,
    not timed, so every rank of a TP group decides alike."""

    def __init__(self, bound: int = ADMISSION_STEPS) -> None:
        self.bound = bound
        self._steps: dict[str, int] = {}

    def waited(self, queued: list[str]) -> list[str]:
        """One more step passed with `queued` (rids) still waiting: those past the
        bound, oldest first. Requests no longer queued are forgotten."""
        self._steps = {rid: self._steps.get(rid, 0) + 1 for rid in queued}
        return [rid for rid in queued if self._steps[rid] > self.bound]

    def forget(self, rid: str) -> None:
        self._steps.pop(rid, None)


MODEL_WORDS = 12  # `pack_models`' length


@dataclass(frozen=True)
class Models:
    """What a rank budgets and places with: rank 0's, the same on every rank of a group."""

    step: StepCoefficients | None = None
    remote: RemoteCoefficients | None = None
    local_bias: float = 1.0  # `LocalBias.value`


def pack_models(models: Models) -> list[float]:
    """The models as floats (a NaN first word marks one unfitted, a NaN unmixed cost one
    not measured), for the broadcast that gives every rank of a TP group rank 0's
    models: each rank times its own steps, and ranks that budgeted differently would
    build different batches."""
    nan = float("nan")
    step, remote = models.step, models.remote
    if step is None:
        words = [nan] * 7
    else:
        words = [step.offset, step.per_request, step.per_local_token, step.per_mixed_request]
        words += [nan if v is None else v for v in (step.unmixed_offset, step.unmixed_per_token)]
        words.append(step.mixed_offset)
    words += (
        [nan] * 4
        if remote is None
        else [remote.offset, remote.per_token, remote.queue_s, remote.per_queued_token]
    )
    return [*words, models.local_bias]


def unpack_models(words: list[float]) -> Models:
    if len(words) != MODEL_WORDS:  # (another version's)
        raise ValueError(f"{len(words)} model words, not {MODEL_WORDS}")
    step = None
    if not math.isnan(words[0]):
        alone = [None if math.isnan(v) else v for v in words[4:6]]
        offset, per_request, per_local_token, per_mixed_request = words[:4]
        mixed_offset = 0.0 if math.isnan(words[6]) else words[6]
        step = StepCoefficients(
            offset,
            per_request,
            per_local_token,
            per_mixed_request,
            alone[0],
            alone[1],
            mixed_offset,
        )
    remote = None if math.isnan(words[7]) else RemoteCoefficients(*words[7:11])
    return Models(step, remote, words[11])
