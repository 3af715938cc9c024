"""How much local prefill a decoder's step may carry, and whether a request is prefilled
there at all (pure: the standard library and numpy).

A decode step that also prefills k prompt tokens for a local request costs the running
streams time: their next token waits for the whole forward. The decoder measures what its
own steps cost (`StepCost`: seconds = a + b * running requests + c * local tokens, fitted
online from every step it runs, forgetting old ones) and gives each step the most local
tokens that keep it within the ITL SLO, a factor over the predicted plain decode step
(`local_tokens_within_slo`). Where extend tokens are nearly free (a GPU) the fitted c is
small and the budget grows to its cap by itself; where they are dear (a CPU) it shrinks -
no per-device constant.

SGLang's `PrefillAdder` takes one token per running request out of both of its prefill
budgets when the step mixes decode into the prefill forward (`num_mixed_decode_tokens`):
a budget of k admits nothing once k streams run, and a chunked request would continue
with a negative chunk. `adder_budget` adds them back, so the adder is left with exactly
the local tokens at any batch size.

Whether a request is prefilled here is decided by its predicted first token
(`prefill_here_is_sooner`): the local steps it needs (behind the local work queued
already) times the step's time, against a remote prefill as this decoder has seen them
take lately (`RemoteCost`: their tokens' compute at the decoder's own per-token cost,
plus the median overhead of the last half minute's remote prefills, from bootstrap to
the last KV word). A local request that no step admitted within `ADMISSION_STEPS` steps is sent to a
prefill server after all (`LocalWait`).
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

# scheduling steps a local request may wait unadmitted before it goes to a prefill server
ADMISSION_STEPS = 8
FORGETTING = 0.98  # weight of a sample relative to the next one (~50 steps remembered)
MIN_SAMPLES = 8  # steps seen before a fitted step model is used
# remote prefills seen before theirs is: a decoder sees far fewer of them than steps, and
# until then every placement stays local
MIN_REMOTE_SAMPLES = 4
REMOTE_WINDOW_S = 30.0  # remote prefills older than this say nothing of the load now
REMOTE_SAMPLES_KEPT = 256
_RIDGE = 1e-9  # keeps the normal equations solvable before the features vary


class OnlineLinearFit:
    """y ~ w . x, fitted by exponentially weighted least squares (old samples fade by
    `forgetting` per new one). `x`: the feature vector, its first entry 1 (the offset)."""

    def __init__(self, features: int, forgetting: float = FORGETTING) -> None:
        self._forgetting = forgetting
        self._xtx = np.zeros((features, features))  # weighted sum of x x^T
        self._xty = np.zeros(features)  # weighted sum of x y
        self.samples = 0

    def observe(self, x: tuple[float, ...], y: float) -> None:
        if not math.isfinite(y) or y <= 0:
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
    """A decode step's seconds = offset + per_request * running + per_local_token * local."""

    offset: float
    per_request: float
    per_local_token: float

    def seconds(self, running: int, local_tokens: int) -> float:
        decode = max(self.offset + self.per_request * running, 0.0)
        return decode + max(self.per_local_token, 0.0) * local_tokens


class StepCost:
    """What this decoder's steps cost, from the steps it ran. A step's time is the whole
    loop iteration (scheduling, the forward, output processing): what a stream waits
    between two tokens."""

    def __init__(self) -> None:
        self._fit = OnlineLinearFit(3)
        self._local_steps = 0  # samples with local tokens: c is identified only by them

    def observe(self, running: int, local_tokens: int, seconds: float) -> None:
        self._fit.observe((1.0, float(running), float(local_tokens)), seconds)
        if local_tokens > 0:
            self._local_steps += 1

    def coefficients(self) -> StepCoefficients | None:
        w = self._fit.coefficients()
        if w is None or self._local_steps < MIN_SAMPLES:
            return None
        return StepCoefficients(*w)


def local_tokens_within_slo(
    model: StepCoefficients | None,
    running: int,
    *,
    slo_factor: float,
    cap: int,
    page_size: int,
) -> int:
    """The local prompt tokens one step may carry: the most that keep the predicted step
    within `slo_factor` x the predicted plain decode step at `running` requests, between
    one page (a local request always progresses) and `cap`. Before the model is fitted,
    or with the SLO off (`slo_factor` <= 0), `cap` (those steps are the measurements)."""
    floor = max(1, page_size)
    cap = max(cap - cap % floor, floor)  # whole pages, as SGLang's chunks are
    if model is None or slo_factor <= 0 or running == 0:
        return cap  # (no stream to slow down)
    c = model.per_local_token
    if c <= 0:
        return cap  # extend tokens cost nothing measurable here
    decode_s = model.seconds(running, 0)
    tokens = int((slo_factor - 1.0) * decode_s / c)
    tokens -= tokens % floor  # whole pages, as SGLang's chunks are
    return min(cap, max(floor, tokens))


def unmixed_step_within_slo(
    model: StepCoefficients | None, running: int, *, slo_factor: float, page_size: int
) -> bool:
    """Whether a local step that cannot ride in the streams' decode forward (SGLang does
    not mix logprob requests) keeps them within the SLO: they then wait for it and for
    their own decode step, so it must cost at most (`slo_factor` - 1) decode steps even
    at one page. Without streams, a model or an SLO: yes."""
    if model is None or slo_factor <= 0 or running == 0:
        return True
    decode_s = model.seconds(running, 0)
    return model.seconds(0, max(1, page_size)) <= (slo_factor - 1.0) * decode_s


def adder_budget(local_tokens: int, running: int, mixed: bool) -> int:
    """The `max_prefill_tokens` and `chunked_prefill_size` to give SGLang's
    `PrefillAdder` for a step of `local_tokens` local tokens: it subtracts one token per
    running request from both when the step mixes decode in (`mixed`), whether it then
    mixes or not."""
    return local_tokens + (running if mixed else 0)


@dataclass(frozen=True)
class RemoteCoefficients:
    """A remote prefill, as the decoder sees it: offset + per_token * tokens computed."""

    offset: float
    per_token: float

    def seconds(self, tokens: int) -> float:
        return max(self.offset, 0.0) + max(self.per_token, 0.0) * tokens


class RemoteCost:
    """What remote prefills took lately, from the decoder's first sight of a request to
    its last KV word: bootstrap, the prefill server's queue and forward, the transfer.

    A remote prefill computes its tokens at about the rate this decoder's own steps
    compute local ones (the step model's per-token cost); the rest - connection,
    queueing, transfer - is load, which comes and goes in bursts: it is the median of
    what the last `REMOTE_WINDOW_S` seconds' prefills took beyond their tokens' compute.
    A burst of queued requests long gone then no longer makes remote look slow, and a
    slope fitted from a few prompt lengths cannot go wrong for short suffixes."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._seen: deque[tuple[float, int, float]] = deque(maxlen=REMOTE_SAMPLES_KEPT)

    def observe(self, tokens: int, seconds: float) -> None:
        if math.isfinite(seconds) and seconds > 0:
            self._seen.append((self._clock(), max(0, tokens), seconds))

    def coefficients(self, per_token: float | None) -> RemoteCoefficients | None:
        """With the decoder's per-token compute cost (s; None: not measured yet), or None
        while fewer than `MIN_REMOTE_SAMPLES` prefills ended within the window."""
        since = self._clock() - REMOTE_WINDOW_S
        recent = [(tokens, s) for at, tokens, s in self._seen if at >= since]
        if per_token is None or len(recent) < MIN_REMOTE_SAMPLES:
            return None
        per_token = max(per_token, 0.0)
        overhead = statistics.median(s - per_token * tokens for tokens, s in recent)
        return RemoteCoefficients(max(overhead, 0.0), per_token)


def local_first_token_s(
    step: StepCoefficients,
    running: int,
    tokens_ahead: int,
    tokens: int,
    per_step: int,
    local_share: float = 1.0,
) -> float:
    """Predicted seconds to a local request's first token: the steps until its last
    chunk ran (the local tokens queued before it, then its own, `per_step` a step, the
    last step carrying what is left), the decode steps between them (`local_share`: the
    share of iterations with local work waiting that ran a local step), and the step
    that samples its first token."""
    per_step = max(1, per_step)
    full, rest = divmod(tokens_ahead + tokens, per_step)
    prefill = full * step.seconds(running, per_step) + (step.seconds(running, rest) if rest else 0)
    local_steps = full + (1 if rest else 0)
    between = local_steps * (1.0 / max(local_share, 0.05) - 1.0) * step.seconds(running, 0)
    return prefill + between + step.seconds(running + 1, 0)


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
    per_step: int,
    local_share: float = 1.0,
) -> bool:
    """Whether the first token comes sooner prefilled here than remote. Without both
    models fitted: here (the placement rules chose it; the steps teach the models)."""
    if step is None or remote is None:
        return True
    here = local_first_token_s(step, running, tokens_ahead, tokens, per_step, local_share)
    return here <= remote.seconds(tokens)


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


MODEL_WORDS = 5  # `pack_models`' length


def pack_models(step: StepCoefficients | None, remote: RemoteCoefficients | None) -> list[float]:
    """Both models as floats (a NaN first word marks one unfitted), for the broadcast
    that gives every rank of a TP group rank 0's models: each rank times its own steps,
    and ranks that budgeted differently would build different batches."""
    nan = float("nan")
    words = [nan] * 3 if step is None else [step.offset, step.per_request, step.per_local_token]
    words += [nan, nan] if remote is None else [remote.offset, remote.per_token]
    return words


def unpack_models(
    words: list[float],
) -> tuple[StepCoefficients | None, RemoteCoefficients | None]:
    step = None if math.isnan(words[0]) else StepCoefficients(*words[0:3])
    remote = None if math.isnan(words[3]) else RemoteCoefficients(*words[3:5])
    return step, remote
