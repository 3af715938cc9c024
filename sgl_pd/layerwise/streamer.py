"""The host thread that turns per-layer progress into per-layer transfer submissions (D6, D8).

The scheduler `submit`s one `ForwardJob` per forward, before launching it, in generation
order. One named thread takes the jobs in FIFO order and, for the current one, polls a
`ProgressCounter`. A poller sees jumps, not every step: when the current generation's
layers_done moves from k to m it calls `on_layers(job, range(k, m))` once; when it reaches
`num_layers` it calls `on_forward_done(job)` and moves on.

Values of an older generation are leftovers of a previous forward: ignored. A value of a
newer generation means the device has started a later forward; published values follow
stream order, so the current job's forward has finished all its layers and its last
values were overwritten before we looked. The job is completed then: `on_layers` for the
layers not yet reported, then `on_forward_done`. The streamer cannot tell that case from a
forward that was submitted but never launched, so the scheduler must submit a job only
for a forward it is about to launch.

Waiting: with no job, the thread blocks on a condition (`idle_timeout_s` wakes to check
the stop event), so an idle streamer costs nothing. With a job, it polls and sleeps
`poll_interval_s` between polls rather than spinning: the thread shares the GIL with the
scheduler, and a Python spin loop holds the GIL until the interpreter's switch interval
(5 ms) forces it off, stalling the scheduler's batch preparation and kernel launches;
each sleep releases the GIL and the core. A layer takes about 0.1-3 ms on the target
GPUs, so a 20 us interval adds a small fraction of a layer. Linux rounds sleeps up by the
thread's timer slack (50 us by default), so the thread lowers its own slack to 1 us.
`poll_interval_s=0` gives a spin that still yields the GIL at every poll.

A forward that ended (`ForwardJob.ended`) while the counter still shows fewer layers has
hooks that did not fire (a module swapped after they were attached, a model whose layers
run without them): its KV is all written, so the job completes as at its last layer, and
`on_silent_layers` says how many layers reported - the waits are bounded by the forward
itself, never by the next forward or a timer.

Tests drive `step()` directly, one poll at a time, with a `ManualClock`; the thread's
loop is `step()` plus the waits above.
"""

from __future__ import annotations

import collections
import ctypes
import enum
import logging
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from sgl_pd.core.clock import Clock
from sgl_pd.layerwise.progress import (
    MAX_GENERATION,
    LayerwiseError,
    ProgressCounter,
    check_num_layers,
    decode,
)

_log = logging.getLogger(__name__)

_PR_SET_TIMERSLACK = 29  # prctl option, linux/prctl.h
_TIMER_SLACK_NS = 1_000  # ns: the streamer thread's sleeps overshoot by at most this much


class StreamerError(LayerwiseError):
    """The streamer was configured or driven wrongly: a job out of generation order, a
    submit after stop, `step()` from a second thread while the streamer's thread runs."""


@dataclass(frozen=True)
class ForwardJob:
    """One forward to follow. `payload` is the glue's (e.g. the batch's chunk notices);
    the streamer only hands it back in the callbacks. `ended`: whether the forward has
    finished on its device (every kernel, the progress records included); None when the
    glue cannot tell."""

    generation: int
    payload: object
    ended: Callable[[], bool] | None = None


@dataclass(frozen=True)
class JobTimeline:
    """When the streamer saw a job's progress, in seconds of the injected clock."""

    generation: int
    taken_s: float  # the streamer started polling for this job
    first_layers_s: float | None  # the first on_layers call began; None before it
    done_s: float | None  # on_forward_done began; None while the job is active
    layer_calls: int  # on_layers calls so far (one per observed jump)
    completed_by_newer: bool  # ended by a newer generation's value, not by its own last layer


class StepOutcome(enum.Enum):
    IDLE = "idle"  # no job to follow; the counter was not read
    WAITING = "waiting"  # the current job shows no new layer since the last poll
    PROGRESS = "progress"  # a job was taken, layers were reported or a job was finished


class _Active:
    """The job being followed; owned by the stepping thread."""

    __slots__ = ("first_layers_s", "job", "layer_calls", "layers_done", "taken_s")

    def __init__(self, job: ForwardJob, taken_s: float) -> None:
        self.job = job
        self.taken_s = taken_s
        self.layers_done = 0  # layers already handed to on_layers
        self.first_layers_s: float | None = None
        self.layer_calls = 0

    def timeline(self, done_s: float | None, by_newer: bool) -> JobTimeline:
        return JobTimeline(
            self.job.generation,
            self.taken_s,
            self.first_layers_s,
            done_s,
            self.layer_calls,
            by_newer,
        )


def _tighten_timer_slack() -> None:
    """Lowers this thread's timer slack so that a 20 us sleep is not a 70 us one. Linux
    only; elsewhere, or if the call fails, sleeps keep the system's rounding."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_TIMERSLACK, ctypes.c_ulong(_TIMER_SLACK_NS), 0, 0, 0)
    except (OSError, AttributeError):
        _log.debug("could not lower the timer slack; polls may sleep ~50 us longer")


class LayerStreamer:
    """Follows submitted forwards layer by layer and calls back as their layers finish.

    Callbacks run on the streamer's thread and must be quick (hand the transfer to the
    messenger and return). Their exceptions are logged and counted in `errors`; the job
    goes on as if the callback had succeeded.
    """

    def __init__(
        self,
        counter: ProgressCounter,
        on_layers: Callable[[ForwardJob, range], None],
        on_forward_done: Callable[[ForwardJob], None],
        *,
        clock: Clock,
        on_silent_layers: Callable[[ForwardJob, int], None] | None = None,
        poll_interval_s: float = 20e-6,
        idle_timeout_s: float = 0.1,
        name: str = "sgl-pd-layer-streamer",
        sleep: Callable[[float], None] = time.sleep,
        history: int = 256,
    ) -> None:
        """`poll_interval_s`: seconds slept between polls while a job shows no progress.
        `idle_timeout_s`: seconds an idle thread waits before re-checking the stop event.
        `sleep`: how the thread sleeps between polls (tests pass a no-op). `history`:
        how many jobs `timeline` remembers. Raises `StreamerError` for a bad setting."""
        if poll_interval_s < 0 or idle_timeout_s <= 0 or history < 1:
            raise StreamerError(
                f"need poll_interval_s >= 0, idle_timeout_s > 0 and history >= 1; got "
                f"{poll_interval_s}, {idle_timeout_s}, {history}"
            )
        self._counter = counter
        self._num_layers = check_num_layers(counter.num_layers)
        self._on_layers = on_layers
        self._on_forward_done = on_forward_done
        self._on_silent_layers = on_silent_layers
        self._clock = clock
        self._poll_interval_s = poll_interval_s
        self._idle_timeout_s = idle_timeout_s
        self._name = name
        self._sleep = sleep
        self._history = history

        self._cond = threading.Condition()  # guards the fields below up to _thread
        self._pending: collections.deque[ForwardJob] = collections.deque()
        self._last_submitted = -1  # generation of the last submitted job
        self._timelines: collections.OrderedDict[int, JobTimeline] = collections.OrderedDict()
        self._stopped = False
        self._thread: threading.Thread | None = None

        self._stop = threading.Event()
        self._active: _Active | None = None  # stepping thread only
        self._errors = 0  # stepping thread writes; others read a whole int
        self._jumps_past_end = 0  # stepping thread only: values beyond num_layers seen

    @property
    def num_layers(self) -> int:
        return self._num_layers

    @property
    def errors(self) -> int:
        """Exceptions caught so far: from callbacks, and from the counter in the thread."""
        return self._errors

    def start(self) -> None:
        """Starts the thread. Raises `StreamerError` if already started or stopped."""
        with self._cond:
            if self._thread is not None or self._stopped:
                raise StreamerError(f"{self._name} was already started; build a new streamer")
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()

    def submit(self, job: ForwardJob) -> None:
        """Queues a forward to follow. Call before launching it, with generations strictly
        increasing. Thread-safe. Raises `StreamerError` out of order or after `stop`."""
        if not 0 <= job.generation <= MAX_GENERATION:
            raise StreamerError(f"generation {job.generation} is outside [0, {MAX_GENERATION}]")
        with self._cond:
            if self._stopped:
                raise StreamerError(f"{self._name} is stopped; build a new streamer")
            if job.generation <= self._last_submitted:
                raise StreamerError(
                    f"job of generation {job.generation} submitted after generation "
                    f"{self._last_submitted}: submit forwards in launch order, each with a "
                    "larger generation"
                )
            self._last_submitted = job.generation
            self._pending.append(job)
            self._cond.notify()

    def stop(self, timeout_s: float) -> bool:
        """Stops the thread, waiting up to `timeout_s` seconds. Returns False if it is still
        inside a callback then. Jobs not finished are dropped (see `unfinished`)."""
        with self._cond:
            self._stopped = True
            self._stop.set()
            self._cond.notify_all()
            thread = self._thread
        if thread is None:
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    def unfinished(self) -> list[ForwardJob]:
        """Jobs submitted but not finished: the active one first, then the queued ones in
        order. Meaningful after `stop` returned True (the glue fails their transfers)."""
        active = self._active
        with self._cond:
            queued = list(self._pending)
        return ([active.job] if active is not None else []) + queued

    def timeline(self, generation: int) -> JobTimeline | None:
        """The timeline of a job among the last `history` ones taken, or None."""
        with self._cond:
            return self._timelines.get(generation)

    def step(self) -> StepOutcome:
        """One poll: takes the next job if none is active, reads the counter once and makes
        the calls that reading implies (finishing at most one job). Called by the
        streamer's thread; tests call it directly instead of starting the thread."""
        thread = self._thread
        if thread is not None and thread.is_alive() and threading.current_thread() is not thread:
            raise StreamerError("step() is the running streamer thread's; do not call it too")
        active = self._active
        took = False
        if active is None:
            with self._cond:
                job = self._pending.popleft() if self._pending else None
            if job is None:
                return StepOutcome.IDLE
            active = self._active = _Active(job, self._clock.monotonic())
            self._publish(active.timeline(None, False))
            took = True

        ended = active.job.ended
        # read before the counter: a forward seen ended has published all it ever will
        forward_ended = ended is not None and ended()
        generation, layers_done = decode(self._counter.read())
        target = active.job.generation
        if forward_ended and (generation, layers_done) < (target, self._num_layers):
            self._silent(active, layers_done if generation == target else 0)
            generation, layers_done = target, self._num_layers
        if generation < target:
            return StepOutcome.PROGRESS if took else StepOutcome.WAITING
        by_newer = generation > target
        if by_newer:
            _log.debug("generation %d ended unseen: generation %d is running", target, generation)
            layers_done = self._num_layers
        elif layers_done > self._num_layers:
            self._jumps_past_end += 1
            if self._jumps_past_end == 1:
                _log.warning(
                    "counter says %d layers done of %d: counter and streamer disagree on "
                    "num_layers; treating it as the end of the forward",
                    layers_done,
                    self._num_layers,
                )
            layers_done = self._num_layers
        if layers_done <= active.layers_done:
            return StepOutcome.PROGRESS if took else StepOutcome.WAITING

        self._report_layers(active, layers_done)
        if active.layers_done == self._num_layers:
            done_s = self._clock.monotonic()
            self._publish(active.timeline(done_s, by_newer))
            self._active = None
            self._call(self._on_forward_done, active.job, "on_forward_done")
        else:
            self._publish(active.timeline(None, False))
        return StepOutcome.PROGRESS

    def _silent(self, active: _Active, reported: int) -> None:
        _log.debug("generation %d ended with %d layers reported", active.job.generation, reported)
        silent = self._on_silent_layers
        if silent is not None:
            self._call(lambda job: silent(job, reported), active.job, "on_silent_layers")

    def _report_layers(self, active: _Active, layers_done: int) -> None:
        if active.first_layers_s is None:
            active.first_layers_s = self._clock.monotonic()
        layers = range(active.layers_done, layers_done)
        active.layers_done = layers_done
        active.layer_calls += 1
        try:
            self._on_layers(active.job, layers)
        except Exception:  # a glue bug must not stop the streaming of later layers
            self._errors += 1
            _log.exception(
                "on_layers(generation %d, layers %d..%d) raised",
                active.job.generation,
                layers.start,
                layers.stop - 1,
            )

    def _call(self, fn: Callable[[ForwardJob], None], job: ForwardJob, what: str) -> None:
        try:
            fn(job)
        except Exception:  # a glue bug must not stop the streaming of later forwards
            self._errors += 1
            _log.exception("%s(generation %d) raised", what, job.generation)

    def _publish(self, timeline: JobTimeline) -> None:
        with self._cond:
            self._timelines[timeline.generation] = timeline
            self._timelines.move_to_end(timeline.generation)
            while len(self._timelines) > self._history:
                self._timelines.popitem(last=False)

    def _run(self) -> None:
        _tighten_timer_slack()
        while not self._stop.is_set():
            try:
                outcome = self.step()
            except Exception:  # the counter failed: keep the thread, back off, retry
                self._errors += 1
                _log.exception("%s: polling the progress counter raised", self._name)
                self._stop.wait(self._idle_timeout_s)
                continue
            if outcome is StepOutcome.WAITING:
                self._sleep(self._poll_interval_s)
            elif outcome is StepOutcome.IDLE:
                with self._cond:
                    if not self._pending and not self._stop.is_set():
                        self._cond.wait(self._idle_timeout_s)
