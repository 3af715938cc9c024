"""Streams `multiturn` requests to an SGLang server or router and times them: TTFT from
streamed /generate, the greedy tokens, and (for the reference server) each step's top-1 /
top-2 logprob margin, so that another server's tokens can be judged against it (`judge`).

`Client` sends the three shapes of traffic: one request, conversations (each turn once
the last is answered, several conversations in flight), and a trace replayed open loop
at its arrival times. `sgl_pd.cluster.client.stream_generate` takes neither logprobs nor
a cache namespace, and `sgl_pd.cluster.conversations` neither streams nor fixes lengths:
hence a client of its own.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import requests
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from sgl_pd.cluster.multiturn import Conversations, Request

TIE_NATS = 0.05  # measured here: greedy steps this near a tie flip between identical runs
REPLAY_IN_FLIGHT = 64  # trace replay: requests in flight at most


@dataclass(frozen=True)
class Answer:
    """One request as the server answered it; `error` empty when it gave all the tokens."""

    key: str  # the request's
    prompt_tokens: int
    output_ids: tuple[int, ...] = ()
    ttft_s: float = math.nan  # the first chunk carrying a token, from the request's start
    empty_lead_s: float = math.nan  # how much sooner a chunk without tokens came, if one did
    margins: tuple[float, ...] = ()  # top-1 minus top-2 logprob per token (nats)
    error: str = ""


def send(
    url: str, request: Request, timeout_s: float, *, logprobs: bool, extra_key: str | None
) -> Answer:
    """Streams one greedy /generate (EOS ignored) and returns its answer; a failure (HTTP
    status, connection, fewer tokens than asked) is the answer's `error`, never raised.
    `logprobs`: ask for the top two per step (the answer's `margins`); `extra_key`:
    SGLang's cache namespace (prefill and decode match prefixes only inside it)."""
    sampling = {"temperature": 0, "max_new_tokens": request.max_new_tokens, "ignore_eos": True}
    body: dict[str, Any] = {"input_ids": list(request.ids), "sampling_params": sampling}
    body |= {"stream": True, **({"extra_key": extra_key} if extra_key else {})}
    if logprobs:
        body |= {"return_logprob": True, "top_logprobs_num": 2}
    start, first, ttft, last = time.perf_counter(), math.nan, math.nan, {}
    try:
        with requests.post(f"{url}/generate", json=body, stream=True, timeout=timeout_s) as r:
            if r.status_code != 200:
                return Answer(
                    request.key, len(request.ids), error=f"HTTP {r.status_code}: {r.text[:300]}"
                )
            for line in r.iter_lines():
                payload = line[len(b"data:") :].strip() if line.startswith(b"data:") else b""
                if payload and payload != b"[DONE]":
                    last, now = json.loads(payload), time.perf_counter() - start
                    first = now if math.isnan(first) else first
                    ttft = now if math.isnan(ttft) and last.get("output_ids") else ttft
    except requests.RequestException as e:
        return Answer(request.key, len(request.ids), error=str(e))
    meta = last.get("meta_info") or {}
    tops = meta.get("output_top_logprobs") or []
    margins = tuple(float(t[0][0] - t[1][0]) if len(t) > 1 else math.inf for t in tops)
    ids = tuple(int(t) for t in last.get("output_ids", ()))
    finish = meta.get("finish_reason")
    error = "" if len(ids) == request.max_new_tokens else f"{len(ids)} tokens, finish {finish}"
    lead = ttft - first if ttft > first else math.nan
    return Answer(request.key, len(request.ids), ids, ttft, lead, margins, error)


def judge(expected: Answer, got: Answer) -> str:
    """ok, near_tie (the first divergence is where monolithic's top two were less than
    TIE_NATS apart), wrong_tokens or error: `campaign.Expected.judge`'s verdicts, at
    TIE_NATS rather than its NEAR_TIE_NATS."""
    if got.error:
        return "error"
    if got.output_ids == expected.output_ids:
        return "ok"
    pairs = zip(got.output_ids, expected.output_ids, strict=False)
    first = next((i for i, (a, b) in enumerate(pairs) if a != b), len(got.output_ids))
    tied = first < len(expected.margins) and expected.margins[first] < TIE_NATS
    return "near_tie" if tied else "wrong_tokens"


def metric_sums(url: str, names: Iterable[str]) -> dict[str, float]:
    """Each named metric of the server's Prometheus /metrics, summed over its samples
    (labels, ranks); 0.0 for one it does not export."""
    out = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in out:
                out[sample.name] += sample.value
    return out


def metric_by_label(url: str, name: str, label: str) -> dict[str, float]:
    """One metric of the server's Prometheus /metrics, summed per value of `label`."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(requests.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name and label in sample.labels:
                value = sample.labels[label]
                out[value] = out.get(value, 0.0) + sample.value
    return out


@dataclass(frozen=True)
class Client:
    """Sends requests to one server (or router) at `url`; answers keyed by request key."""

    url: str
    timeout_s: float  # per request
    logprobs: bool  # the reference asks for them
    concurrency: int  # conversations in flight

    def one(
        self, request: Request, bar: tqdm | None = None, extra_key: str | None = None
    ) -> Answer:
        """`send`s `request`, then ticks `bar`; `extra_key`: a cache namespace."""
        answer = send(
            self.url, request, self.timeout_s, logprobs=self.logprobs, extra_key=extra_key
        )
        if bar is not None:
            bar.update()
        return answer

    def converse(
        self,
        convs: Conversations,
        reference: dict[str, Answer] | None,
        bar: tqdm,
        extra_key: str | None = None,
    ) -> dict[str, Answer]:
        """Every conversation, `concurrency` at a time, keyed "c{conversation}t{turn}"; a
        turn's prompt carries the reference's answer to the turn before (its own when
        `reference` is None: then a failed turn raises RuntimeError)."""

        def run(c: int) -> dict[str, Answer]:
            answers: dict[str, Answer] = {}
            prompt = list(convs.system)
            for t, message in enumerate(convs.messages[c]):
                if t:
                    prompt += (reference or answers)[f"c{c}t{t - 1}"].output_ids
                prompt += message
                request = Request(f"c{c}t{t}", tuple(prompt), convs.output_tokens)
                answers[request.key] = answer = self.one(request, bar, extra_key)
                if reference is None and answer.error:
                    raise RuntimeError(f"the reference failed {request.key}: {answer.error}")
            return answers

        with ThreadPoolExecutor(self.concurrency) as pool:
            parts = list(pool.map(run, range(len(convs.messages))))
        return {k: a for part in parts for k, a in part.items()}

    def replay(self, trace: Sequence[Request], speedup: float, bar: tqdm) -> dict[str, Answer]:
        """Each request at its arrival time divided by `speedup` (open loop, at most
        REPLAY_IN_FLIGHT in flight: later ones wait for a slot)."""
        start = time.perf_counter()

        def run(request: Request) -> Answer:
            time.sleep(max(0.0, start + request.arrival_s / speedup - time.perf_counter()))
            return self.one(request, bar)

        with ThreadPoolExecutor(min(REPLAY_IN_FLIGHT, len(trace))) as pool:
            return {a.key: a for a in pool.map(run, trace)}
