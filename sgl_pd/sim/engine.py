"""Discrete-event simulation of a serving deployment: prefill, decode and mixed instances,
a router, and KV transfers over the prefill node's NICs.

Time is in seconds. Each instance runs one step at a time: when a step ends it records its
results and, if it has work, starts the next one with everything that arrived meanwhile
(continuous batching). What each role does per step, as SGLang schedules it:
  mixed:   prefill first (one chunk of up to `chunk_tokens` prompt tokens, decode streams
           wait), otherwise one decode step of every running request; the prefill samples
           the first token
  prefill: chunks of up to `chunk_tokens`; each chunk's KV leaves over the NICs, layer by
           layer while it is computed (layer-wise) or after its forward (after-forward)
  decode:  one decode step of every request whose KV has arrived; a request's first step
           processes the last prompt token and samples the first output token (D16);
           with local prefill, each step also carries up to `local_step_tokens` prompt
           tokens of requests it prefills itself (SGLang's mixed chunk)
A request may arrive with `held_tokens` of its prompt already cached (a conversation's
follow-up turn): only the rest is prefilled and its KV sent.
"""

from __future__ import annotations

import functools
import heapq
import itertools
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from sgl_pd.sim.roofline import StepCost, Work


@dataclass
class SimRequest:
    id: int
    arrival: float
    prompt_tokens: int
    output_tokens: int
    held_tokens: int = 0  # prompt tokens cached where it is served (an earlier turn's)
    token_times: list[float] = field(default_factory=list)
    forward_end: float | None = None  # end of the last prefill forward (PD)
    kv_complete: float | None = None  # decoder holds all KV (PD)

    @property
    def first_token(self) -> float | None:
        return self.token_times[0] if self.token_times else None

    @property
    def done(self) -> bool:
        return len(self.token_times) >= self.output_tokens


# a step: each DP rank's works, and what to run when it ends (start, end seconds)
StepPlan = tuple[list[list[Work]], Callable[[float, float], None]]


class Clock:
    """The event queue: callbacks at times, run in time order (ties in insertion order)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[[], None]) -> None:
        if t < self.now:
            raise ValueError(f"event at {t} is before now ({self.now})")
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run(self, until: float = float("inf")) -> None:
        while self._events and self._events[0][0] <= until:
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn()


class Instance:
    """One engine: steps back to back while it has work."""

    def __init__(self, clock: Clock, cost: StepCost, name: str) -> None:
        self.clock = clock
        self.cost = cost
        self.name = name
        self.busy = False
        self.busy_s = 0.0

    def wake(self) -> None:
        if not self.busy:
            self._next()

    def _next(self) -> None:
        step = self.plan_step()
        if step is None:
            self.busy = False
            return
        ranks, finish = step
        seconds = self.cost.step_s(ranks)
        self.busy = True
        self.busy_s += seconds
        start = self.clock.now

        def end() -> None:
            finish(start, self.clock.now)
            self._next()

        self.clock.at(start + seconds, end)

    def plan_step(self) -> StepPlan | None:
        """The next step's works per DP rank and what to do when it ends (start, end);
        None when idle."""
        raise NotImplementedError


@dataclass
class _Prefilling:
    request: SimRequest
    tokens: int  # tokens to prefill
    done: int = 0


def _take_chunk(queue: Iterable[_Prefilling], budget: int) -> list[tuple[_Prefilling, int]]:
    """The next prefill step: up to `budget` tokens, queued requests in order (the first
    may continue a chunked prompt), as (request, tokens this step)."""
    taken: list[tuple[_Prefilling, int]] = []
    for p in queue:
        if budget <= 0:
            break
        n = min(budget, p.tokens - p.done)
        taken.append((p, n))
        budget -= n
    return taken


class _Decoding:
    """Running decode streams of an instance, split over its DP ranks."""

    def __init__(self, ranks: int, max_running: int) -> None:
        self.ranks: list[list[SimRequest]] = [[] for _ in range(ranks)]
        self.waiting: deque[SimRequest] = deque()
        self.max_running = max_running  # per rank

    def add(self, request: SimRequest) -> None:
        self.waiting.append(request)

    def admit(self) -> None:
        while self.waiting:
            rank = min(self.ranks, key=len)
            if len(rank) >= self.max_running:
                return
            rank.append(self.waiting.popleft())

    def works(self) -> list[list[Work]]:
        return [
            [Work(1, r.prompt_tokens - 1 + len(r.token_times)) for r in rank] for rank in self.ranks
        ]

    def emit(self, t: float, on_done: Callable[[SimRequest], None]) -> None:
        for rank in self.ranks:
            for r in rank:
                r.token_times.append(t)
            for r in [r for r in rank if r.done]:
                rank.remove(r)
                on_done(r)

    @property
    def running(self) -> int:
        return sum(len(rank) for rank in self.ranks)

    @property
    def load(self) -> int:
        return self.running + len(self.waiting)


class DecodeInstance(Instance):
    def __init__(
        self,
        clock: Clock,
        cost: StepCost,
        name: str,
        *,
        ranks: int = 1,
        max_running: int = 256,
        on_done: Callable[[SimRequest], None] = lambda r: None,
        local_step_tokens: int = 0,
    ) -> None:
        super().__init__(clock, cost, name)
        self.streams = _Decoding(ranks, max_running)
        self.on_done = on_done
        self.local_step_tokens = local_step_tokens
        self.local: deque[_Prefilling] = deque()  # requests it prefills itself
        self.local_prefills = 0

    def receive(self, request: SimRequest) -> None:
        """The request's KV and metadata are complete (counted): it may be scheduled."""
        self.streams.add(request)
        self.wake()

    def prefill_here(self, request: SimRequest) -> None:
        """Local prefill: this decoder computes the prompt's uncached tokens itself."""
        self.local.append(_Prefilling(request, max(1, request.prompt_tokens - request.held_tokens)))
        self.local_prefills += 1
        self.wake()

    def plan_step(self) -> StepPlan | None:
        self.streams.admit()
        if self.local:
            # a chunk of local prefill rides in the running streams' decode step (mixed)
            taken = _take_chunk(self.local, self.local_step_tokens)
            works = self.streams.works()
            works[0] += [Work(n, p.request.held_tokens + p.done) for p, n in taken]

            def finish(start: float, end: float) -> None:
                self.streams.emit(end, self.on_done)
                for p, n in taken:
                    p.done += n
                    if p.done >= p.tokens:
                        self.local.remove(p)
                        p.request.token_times.append(end)  # sampled here, as monolithic
                        if p.request.done:
                            self.on_done(p.request)
                        else:
                            self.streams.add(p.request)

            return works, finish
        if not self.streams.running:
            return None
        return self.streams.works(), lambda start, end: self.streams.emit(end, self.on_done)


@dataclass(frozen=True)
class TransferModel:
    bytes_per_token: float  # KV bytes of one token that cross the network
    num_layers: int
    node_bytes_s: float  # what the prefill node's NICs carry together
    latency_s: float
    layerwise: bool = True


class PrefillInstance(Instance):
    """Prefills chunks and streams their KV out over its node's NICs (one shared queue)."""

    def __init__(
        self,
        clock: Clock,
        cost: StepCost,
        name: str,
        *,
        chunk_tokens: int,
        transfer: TransferModel,
        deliver: Callable[[SimRequest], None],
    ) -> None:
        super().__init__(clock, cost, name)
        self.chunk_tokens = chunk_tokens
        self.transfer = transfer
        self.deliver = deliver
        self.queue: deque[_Prefilling] = deque()
        self.nic_free = 0.0

    @property
    def outstanding_tokens(self) -> int:
        return sum(p.tokens - p.done for p in self.queue)

    def submit(self, request: SimRequest) -> None:
        # D16: the prefiller prefills tokens [0, n-1); the decoder runs token n-1. Held
        # tokens are cached on both (it computed the earlier turns) and not sent.
        tokens = max(1, request.prompt_tokens - request.held_tokens - 1)
        self.queue.append(_Prefilling(request, tokens))
        self.wake()

    def plan_step(self) -> StepPlan | None:
        taken = _take_chunk(self.queue, self.chunk_tokens)
        if not taken:
            return None
        works = [[Work(n, p.request.held_tokens + p.done) for p, n in taken]]

        def finish(start: float, end: float) -> None:
            for p, n in taken:
                p.done += n
            kv_at = self._send(start, end, sum(n for _, n in taken))
            for p, _ in taken:
                if p.done >= p.tokens:
                    self.queue.remove(p)
                    p.request.forward_end = end
                    p.request.kv_complete = kv_at
                    self.clock.at(kv_at, functools.partial(self.deliver, p.request))

        return works, finish

    def _send(self, start: float, end: float, tokens: int) -> float:
        """Queues the chunk's KV on the NICs; returns when its last byte has landed."""
        tr = self.transfer
        layer_s = tokens * tr.bytes_per_token / tr.num_layers / tr.node_bytes_s
        if tr.layerwise:
            for layer in range(tr.num_layers):
                ready = start + (end - start) * (layer + 1) / tr.num_layers
                self.nic_free = max(self.nic_free, ready) + layer_s
        else:
            self.nic_free = max(self.nic_free, end) + layer_s * tr.num_layers
        return self.nic_free + tr.latency_s


class MixedInstance(Instance):
    """Prefill and decode on one engine, prefill first (SGLang's default scheduling)."""

    def __init__(
        self,
        clock: Clock,
        cost: StepCost,
        name: str,
        *,
        chunk_tokens: int,
        ranks: int = 1,
        max_running: int = 256,
        on_done: Callable[[SimRequest], None] = lambda r: None,
    ) -> None:
        super().__init__(clock, cost, name)
        self.chunk_tokens = chunk_tokens
        self.queue: deque[_Prefilling] = deque()
        self.streams = _Decoding(ranks, max_running)
        self.on_done = on_done

    @property
    def load(self) -> int:
        return len(self.queue) + self.streams.load

    def submit(self, request: SimRequest) -> None:
        self.queue.append(_Prefilling(request, max(1, request.prompt_tokens - request.held_tokens)))
        self.wake()

    def plan_step(self) -> StepPlan | None:
        if self.queue:
            taken = _take_chunk(self.queue, self.chunk_tokens)

            def finish(start: float, end: float) -> None:
                for p, n in taken:
                    p.done += n
                    if p.done >= p.tokens:
                        self.queue.remove(p)
                        p.request.token_times.append(end)  # the prefill samples token 1
                        if p.request.done:
                            self.on_done(p.request)
                        else:
                            self.streams.add(p.request)

            return [[Work(n, p.request.held_tokens + p.done) for p, n in taken]], finish
        self.streams.admit()
        if not self.streams.running:
            return None
        return self.streams.works(), lambda start, end: self.streams.emit(end, self.on_done)


def run_trace(
    clock: Clock,
    requests: Iterable[SimRequest],
    submit: Callable[[SimRequest], None],
    until: float = float("inf"),
) -> None:
    """Schedules every arrival, then runs the clock until no event is left (or `until`)."""
    for r in requests:
        clock.at(r.arrival, functools.partial(submit, r))
    clock.run(until)
