"""A fault campaign against a running PD cluster: many concurrent requests through the
router, some aborted on purpose at the decoder mid-flight, while the servers may inject
write delays and failures. Every request must end as one of: the monolithic tokens, an
error the client sees, or an abort it asked for - never wrong tokens, never a hang.

Tokens are compared with the monolithic server's greedy choice and its margin (top-1
minus top-2 log-probability, nats). The CPU engine's results move slightly with batch
composition (fp16 KV), so where two candidates were within `NEAR_TIE_NATS` of each other
either choice is right: a run that first departs from the monolithic tokens at such a
step counts as `near_tie`, not as wrong.

Shared by the end-to-end tests and `benchmarks/bench_faults.py`.
"""

from __future__ import annotations

import contextlib
import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import requests

from sgl_pd.cluster.client import generate_ids
from sgl_pd.cluster.processes import ManagedProcess

REQUEST_TIMEOUT_S = 300.0  # a request that takes longer is counted lost
NEAR_TIE_NATS = 0.1  # seen: 0.012 and 0.039 nats between the top two first tokens


@dataclass(frozen=True)
class Expected:
    """The monolithic server's greedy tokens, and at each step how far (nats) the chosen
    token was ahead of the next one."""

    tokens: tuple[int, ...]
    margins: tuple[float, ...]

    def judge(self, got: Sequence[int]) -> str:
        """ "ok", "near_tie" (the first departure is at a near tie) or "wrong_tokens"."""
        if tuple(got) == self.tokens:
            return "ok"
        first = next(
            (i for i, (a, b) in enumerate(zip(got, self.tokens, strict=False)) if a != b),
            min(len(got), len(self.tokens)),
        )
        if first < len(self.margins) and self.margins[first] < NEAR_TIE_NATS:
            return "near_tie"
        return "wrong_tokens"


def expected_tokens(url: str, ids: Sequence[int], max_new_tokens: int) -> Expected:
    """Greedy tokens of a (monolithic) server with each step's top-1 / top-2 margin."""
    return expected_answer(url, ids, max_new_tokens)[0]


def expected_answer(
    url: str, prompt: Sequence[int] | str, max_new_tokens: int
) -> tuple[Expected, dict[str, Any]]:
    """`expected_tokens` of token ids or a text, and SGLang's meta_info of the answer
    (its text, speculative counts...)."""
    response = requests.post(
        f"{url}/generate",
        json={
            **({"text": prompt} if isinstance(prompt, str) else {"input_ids": list(prompt)}),
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
            "return_logprob": True,
            "top_logprobs_num": 2,
        },
        timeout=REQUEST_TIMEOUT_S,
    )
    response.raise_for_status()
    body = response.json()
    tops = body["meta_info"]["output_top_logprobs"]
    margins = tuple(float(t[0][0] - t[1][0]) if len(t) > 1 else float("inf") for t in tops)
    meta = {**body["meta_info"], "text": body["text"]}
    return Expected(tuple(int(t) for t in body["output_ids"]), margins), meta


@dataclass(frozen=True)
class Outcome:
    index: int
    kind: str  # "ok" | "near_tie" | "wrong_tokens" | "error" | "aborted" | "lost"
    aborted_on_purpose: bool
    fault_to_end_s: float | None  # from the abort call to the client's answer
    detail: str = ""  # for wrong tokens: what came back against what was expected
    rid: str = ""  # the request id the servers log
    fault_at_s: float | None = None  # when the abort was sent (time.monotonic())


@dataclass(frozen=True)
class CampaignResult:
    outcomes: tuple[Outcome, ...]

    def count(self, kind: str) -> int:
        return sum(o.kind == kind for o in self.outcomes)

    @property
    def aborts_sent(self) -> int:
        return sum(o.aborted_on_purpose for o in self.outcomes)

    def wrong(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.kind == "wrong_tokens"]

    def fault_to_end_s(self) -> list[float]:
        return sorted(o.fault_to_end_s for o in self.outcomes if o.fault_to_end_s is not None)

    def false_failures(self, causes: Mapping[str, str], excused: Sequence[str]) -> list[Outcome]:
        """Requests that failed though nothing was done to them on purpose: not aborted,
        and their cause (rid -> reason, from `logs.decode_failures`) names none of the
        `excused` faults (an injected write failure, a kill). A pause is never an
        excuse: a live peer that was only stopped for a while must fail nothing."""
        return [
            o
            for o in self.outcomes
            if o.kind in ("error", "lost")
            and not o.aborted_on_purpose
            and not any(e in causes.get(o.rid, "") for e in excused)
        ]


@contextlib.contextmanager
def periodic_pauses(
    victims: Sequence[ManagedProcess],
    *,
    every_s: float,
    pause_s: float,
    intervals: list[tuple[str, float, float]] | None = None,
) -> Iterator[list[str]]:
    """While the block runs, SIGSTOPs `victims` in turn (each whole process group) for
    `pause_s` seconds every `every_s` seconds: alive and accepting connections, but not
    running. Yields the names paused so far; every victim runs again when it ends.
    `intervals` gets (name, stopped at, resumed at) of each pause (time.monotonic())."""
    stop = threading.Event()
    paused: list[str] = []

    def loop() -> None:
        turn = 0
        while not stop.wait(every_s):
            victim = victims[turn % len(victims)]
            turn += 1
            victim.pause()
            stopped_at = time.monotonic()
            try:
                stop.wait(pause_s)
            finally:
                victim.resume()
            paused.append(victim.name)
            if intervals is not None:
                intervals.append((victim.name, stopped_at, time.monotonic()))

    thread = threading.Thread(target=loop, name="pauses", daemon=True)
    thread.start()
    try:
        yield paused
    finally:
        stop.set()
        thread.join(pause_s + 5)
        for victim in victims:
            victim.resume()


def abort_at_decoder(decode_url: str, rid: str) -> None:
    """SGLang's own abort endpoint, as a client disconnect would trigger it."""
    requests.post(f"{decode_url}/abort_request", json={"rid": rid}, timeout=30).raise_for_status()


def post_generate(url: str, ids: list[int], rid: str, max_new_tokens: int) -> requests.Response:
    """SGLang's native /generate with a request id the test can abort."""
    return requests.post(
        f"{url}/generate",
        json={
            "rid": rid,
            "input_ids": list(ids),
            "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
        },
        timeout=REQUEST_TIMEOUT_S,
    )


@dataclass(frozen=True)
class KillResult:
    response: requests.Response | None  # None: the connection itself failed
    kill_to_answer_s: float  # from the SIGKILL to the client's answer

    @property
    def completed(self) -> bool:
        """The request was served whole: it finished before the kill landed."""
        response = self.response
        return (
            response is not None
            and response.ok
            and response.json()["meta_info"]["finish_reason"]["type"] != "abort"
        )


def kill_mid_transfer(
    router_url: str, victim: ManagedProcess, ids: list[int], rid: str, after_s: float = 1.0
) -> KillResult:
    """Sends `ids` through the router and SIGKILLs `victim` `after_s` seconds later, while
    the prompt's (slowed) layers stream."""
    answer: list[tuple[requests.Response | None, float]] = []

    def send() -> None:
        try:
            response: requests.Response | None = post_generate(router_url, ids, rid, 4)
        except requests.RequestException:
            response = None
        answer.append((response, time.monotonic()))

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    time.sleep(after_s)
    killed = time.monotonic()
    victim.kill()
    sender.join(REQUEST_TIMEOUT_S)
    if not answer:
        return KillResult(None, float("inf"))
    return KillResult(answer[0][0], answer[0][1] - killed)


def kill_during_request(
    url: str,
    victim: ManagedProcess,
    prompt_for: Callable[[int], list[int]],
    rid: str,
    restart: Callable[[], None],
    waits_s: Sequence[float] = (1.0, 0.5, 0.25),
    ended_early: Callable[[str], bool] | None = None,
) -> KillResult:
    """`kill_mid_transfer`, again sooner while the request finished before the kill (a
    transfer is only as long as its write batches, which fewer writes shorten) or, per
    `ended_early(rid)`, ended on its own before it (an injected write failure): `restart`
    brings the victim back, and each attempt sends `prompt_for(attempt)`, a prompt no
    prefix cache holds yet. Raises AssertionError when every attempt finished first."""
    for attempt, after_s in enumerate(waits_s):
        attempt_rid = f"{rid}-{attempt}"
        result = kill_mid_transfer(url, victim, prompt_for(attempt), attempt_rid, after_s)
        early = ended_early is not None and ended_early(attempt_rid)
        if not result.completed and not early:
            return result
        restart()
    raise AssertionError(f"every request finished before its kill (waits {list(waits_s)} s)")


def restarter(
    victim: ManagedProcess, health_url: str, url: str, ready_s: float, reach_s: float
) -> Callable[[], None]:
    """What `kill_during_request` calls between attempts: restarts `victim`, waits for
    its `health_url`, then until a request through `url` gets through again (a router
    keeps a dead server's circuit open a while)."""

    def restart() -> None:
        victim.restart("restarted")
        victim.wait_http_ready(health_url, ready_s)
        first_success(url, "Count: 1 2", 2, budget_s=reach_s)

    return restart


def first_success(url: str, prompt: str, max_new_tokens: int, budget_s: float) -> list[int]:
    """Greedy tokens of the first attempt that succeeds within `budget_s` seconds: after a
    restart the router needs a health check or two, and the first request may still go
    to the old peer and fail."""
    deadline = time.monotonic() + budget_s
    while True:
        try:
            return generate_ids(url, prompt, max_new_tokens)
        except requests.RequestException:
            if time.monotonic() > deadline:
                raise
            time.sleep(2)


def run_campaign(
    router_url: str,
    decode_url: str,
    prompts: Sequence[list[int]],
    expected: Sequence[Expected],
    *,
    max_new_tokens: int,
    abort_fraction: float,
    concurrency: int = 16,
    seed: int = 0,
    on_done: Callable[[Outcome], None] | None = None,
) -> CampaignResult:
    """Sends every prompt through the router; `abort_fraction` of them are aborted at the
    decoder after a random delay of up to 1 s. `expected`: the monolithic server's."""
    rng = random.Random(seed)
    plan = [(i, rng.random() < abort_fraction, rng.uniform(0.05, 1.0)) for i in range(len(prompts))]
    tag = f"campaign-{seed}-{time.monotonic_ns()}"

    def one(item: tuple[int, bool, float]) -> Outcome:
        index, abort, delay_s = item
        rid = f"{tag}-{index}"
        aborted_at: list[float] = []
        timer = None
        if abort:

            def fire() -> None:
                aborted_at.append(time.monotonic())
                with contextlib.suppress(requests.RequestException):  # it may have ended
                    abort_at_decoder(decode_url, rid)

            timer = threading.Timer(delay_s, fire)
            timer.start()
        try:
            response = post_generate(router_url, prompts[index], rid, max_new_tokens)
            ended = time.monotonic()
        except requests.RequestException:
            return Outcome(index, "lost", abort, None, rid=rid)
        finally:
            if timer is not None:
                timer.cancel()
        fault_to_end = ended - aborted_at[0] if aborted_at else None
        if response.status_code != 200:
            return Outcome(
                index, "aborted" if abort else "error", abort, fault_to_end, rid=rid,
                fault_at_s=aborted_at[0] if aborted_at else None,
            )  # fmt: skip
        body = response.json()
        finish = (body.get("meta_info") or {}).get("finish_reason") or {}
        if isinstance(finish, dict) and finish.get("type") == "abort":
            return Outcome(
                index, "aborted" if abort else "error", abort, fault_to_end, rid=rid,
                fault_at_s=aborted_at[0] if aborted_at else None,
            )  # fmt: skip
        ids = [int(t) for t in body["output_ids"]]
        kind = expected[index].judge(ids)
        if kind == "ok":
            return Outcome(index, kind, abort, None, rid=rid)
        detail = f"finish {finish}, got {ids}, expected {expected[index]}"
        return Outcome(
            index, kind, abort, fault_to_end, detail, rid, aborted_at[0] if aborted_at else None
        )

    outcomes = []
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        for outcome in pool.map(one, plan):
            outcomes.append(outcome)
            if on_done is not None:
                on_done(outcome)
    return CampaignResult(tuple(outcomes))
