"""The multi-turn benchmark's workloads (conversations, Mooncake traces, probes) and its
streaming client's parsing and judging, without servers: fake HTTP responses and a fake
`send`."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from tqdm import tqdm

from sgl_pd.cluster import streaming
from sgl_pd.cluster.multiturn import (
    TRACE_BLOCK_TOKENS,
    Request,
    build_conversations,
    load_trace,
    probe_requests,
    synthetic_trace,
)
from sgl_pd.cluster.streaming import TIE_NATS, Answer, Client, judge, metric_sums, send
from sgl_pd.errors import ConfigError


def _write_trace(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + "\n")  # a blank line too
    return path


# -- traces ---------------------------------------------------------------------------------


def test_a_trace_maps_equal_hash_ids_to_equal_tokens_and_scales_lengths(tmp_path: Path) -> None:
    trace = _write_trace(
        tmp_path / "trace.jsonl",
        [
            {"timestamp": 1000, "input_length": 1000, "output_length": 64, "hash_ids": [7, 8]},
            {"timestamp": 3500, "input_length": 1500, "output_length": 8, "hash_ids": [7, 8, 9]},
            {"timestamp": 4000, "input_length": 512, "output_length": 1, "hash_ids": [9]},
            {"timestamp": 9000, "input_length": 512, "output_length": 1, "hash_ids": [1]},
        ],
    )
    scale = 1 / 16
    block = TRACE_BLOCK_TOKENS // 16  # 32 tokens a block
    first, second, third = load_trace(trace, scale, limit=3)  # the fourth row is cut

    assert [r.key for r in (first, second, third)] == ["trace0", "trace1", "trace2"]
    assert [r.arrival_s for r in (first, second, third)] == [0.0, 2.5, 3.0]  # s after the first
    assert [len(r.ids) for r in (first, second, third)] == [1000 // 16, round(1500 / 16), 32]
    assert [r.max_new_tokens for r in (first, second, third)] == [4, 1, 1]  # at least one
    assert all(r.ids[0] == 0 for r in (first, second, third))  # BOS, then the blocks
    # blocks 7 and 8 open both prompts: the same ids; block 9 is the same ids wherever it is
    assert second.ids[: len(first.ids)] == first.ids
    in_second = second.ids[1 + 2 * block :]  # block 9's first 29 ids (94 = 1 + 3 x 32 - 3)
    assert third.ids[1 : 1 + len(in_second)] == in_second
    assert first.ids[1:10] != first.ids[1 + block : 10 + block]  # block 7 is not block 8


def test_a_prompt_is_never_longer_than_its_blocks(tmp_path: Path) -> None:
    row = {"timestamp": 0, "input_length": 5000, "output_length": 16, "hash_ids": [0]}
    (request,) = load_trace(_write_trace(tmp_path / "t.jsonl", [row]), 1 / 16, limit=10)
    assert len(request.ids) == 1 + TRACE_BLOCK_TOKENS // 16  # BOS and one block


def test_a_trace_without_requests_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no requests"):
        load_trace(_write_trace(tmp_path / "empty.jsonl", []), 1.0, limit=10)


def test_the_synthetic_trace_is_in_mooncakes_format_and_grows_sessions(tmp_path: Path) -> None:
    path = synthetic_trace(tmp_path / "synthetic.jsonl", count=30, seed=3)
    rows = [json.loads(line) for line in path.read_text().splitlines()]

    assert len(rows) == 30
    assert all(set(r) == {"timestamp", "input_length", "output_length", "hash_ids"} for r in rows)
    stamps = [r["timestamp"] for r in rows]
    assert stamps == sorted(stamps) and all(isinstance(t, int) for t in stamps)  # ms
    for r in rows:
        assert r["hash_ids"][0] == 0  # the shared system block
        blocks = len(r["hash_ids"])
        assert (blocks - 1) * TRACE_BLOCK_TOKENS < r["input_length"] <= blocks * TRACE_BLOCK_TOKENS
        assert r["output_length"] in (64, 128, 256)
    # a later turn of a session extends an earlier prompt's blocks
    seen = [tuple(r["hash_ids"]) for r in rows]
    assert any(a != b and b[: len(a)] == a for i, a in enumerate(seen) for b in seen[i + 1 :])
    assert len(load_trace(path, 1 / 16, limit=30)) == 30
    assert synthetic_trace(tmp_path / "again.jsonl", 30, 3).read_text() == path.read_text()


# -- conversations and probes ---------------------------------------------------------------


def test_every_conversation_prompt_has_a_length_of_its_own() -> None:
    convs = build_conversations(4, 3, 20, (3, 12), output=5, seed=1)
    turn_of = convs.turn_of()
    assert sorted(turn_of.values()) == [(c, t) for c in range(4) for t in range(3)]
    messages = sum(len(m) for turns in convs.messages for m in turns)
    assert convs.unique_tokens() == 20 + messages + 12 * 5
    assert len(convs.system) == 20 and convs.system[0] == 0  # BOS-led
    assert all(3 <= len(m) <= 12 and m[0] != 0 for turns in convs.messages for m in turns)


def test_a_too_narrow_message_range_is_refused() -> None:
    with pytest.raises(ConfigError, match="--message-tokens 4 4"):
        build_conversations(3, 2, 10, (4, 4), output=2, seed=1)


def test_a_turns_prompt_is_the_last_prompt_its_answer_and_a_new_message(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    convs = build_conversations(2, 3, 16, (4, 10), output=3, seed=2)
    sent: dict[str, Request] = {}

    def fake_send(url: str, request: Request, timeout_s: float, **_: object) -> Answer:
        sent[request.key] = request
        answer = tuple(range(100 + len(request.ids), 100 + len(request.ids) + 3))
        return Answer(request.key, len(request.ids), answer)

    monkeypatch.setattr(streaming, "send", fake_send)
    answers = Client("http://fake", 1.0, logprobs=True, concurrency=2).converse(
        convs, None, tqdm(disable=True)
    )

    assert sorted(answers) == sorted(sent) == [f"c{c}t{t}" for c in range(2) for t in range(3)]
    turn_of = convs.turn_of()
    for c in range(2):
        assert sent[f"c{c}t0"].ids == convs.system + convs.messages[c][0]
        for t in (1, 2):
            before, now = sent[f"c{c}t{t - 1}"], sent[f"c{c}t{t}"]
            answer = answers[f"c{c}t{t - 1}"].output_ids
            assert now.ids == before.ids + answer + convs.messages[c][t]
        assert all(turn_of[len(sent[f"c{c}t{t}"].ids)] == (c, t) for t in range(3))

    # against a reference, a turn carries the reference's answer, not its own
    reference = {k: Answer(k, a.prompt_tokens, (7, 7, 7)) for k, a in answers.items()}
    sent.clear()
    Client("http://fake", 1.0, logprobs=False, concurrency=1).converse(
        convs, reference, tqdm(disable=True)
    )
    assert (
        sent["c0t1"].ids == convs.system + convs.messages[0][0] + (7, 7, 7) + convs.messages[0][1]
    )


def test_probes_are_one_per_distinct_length_shortest_first() -> None:
    probes = probe_requests([40, 20, 40, 30])
    assert [(p.key, len(p.ids), p.max_new_tokens) for p in probes] == [
        ("probe0", 20, 4),
        ("probe1", 30, 4),
        ("probe2", 40, 4),
    ]
    assert probes[0].ids != probes[1].ids[:20]  # not one probe's prefix in the next


# -- judging --------------------------------------------------------------------------------


def _reference(tokens: tuple[int, ...], margins: tuple[float, ...]) -> Answer:
    return Answer("k", 10, tokens, margins=margins)


def test_a_first_divergence_at_a_near_tie_is_a_tie_elsewhere_wrong() -> None:
    clear, tie = 5.0, TIE_NATS / 2
    ref = _reference((1, 2, 3), (clear, tie, clear))
    assert judge(ref, Answer("k", 10, (1, 2, 3))) == "ok"
    assert judge(ref, Answer("k", 10, (1, 9, 9))) == "near_tie"  # whatever follows
    assert judge(ref, Answer("k", 10, (9, 2, 3))) == "wrong_tokens"
    assert judge(ref, Answer("k", 10, (1, 2, 9))) == "wrong_tokens"
    assert judge(ref, Answer("k", 10, (1, 2))) == "wrong_tokens"  # cut short at a clear step
    # TIE_NATS itself is not a tie (campaign's NEAR_TIE_NATS would call 0.05-0.1 one)
    at_line = _reference((1, 2, 3), (clear, TIE_NATS, clear))
    assert judge(at_line, Answer("k", 10, (1, 9, 9))) == "wrong_tokens"
    assert judge(ref, Answer("k", 10, (1, 2, 3), error="HTTP 500")) == "error"


# -- streaming ------------------------------------------------------------------------------


class _FakeResponse:
    def __init__(self, status: int, lines: list[bytes], text: str = "") -> None:
        self.status_code, self.text, self._lines = status, text, lines

    def __enter__(self) -> _FakeResponse:
        return self

    def __exit__(self, *_: object) -> None:
        return None

    def iter_lines(self) -> Iterator[bytes]:
        return iter(self._lines)


def _chunk(ids: list[int], meta: dict[str, Any] | None = None) -> bytes:
    return b"data: " + json.dumps({"output_ids": ids, "meta_info": meta or {}}).encode()


def _stream(
    monkeypatch: pytest.MonkeyPatch, response: _FakeResponse, bodies: list[dict[str, Any]]
) -> None:
    def post(url: str, json: dict[str, Any], **_: object) -> _FakeResponse:
        bodies.append(json)
        return response

    clock = iter(float(t) for t in range(100))  # 1 s per call: start, then each chunk
    monkeypatch.setattr(streaming.requests, "post", post)
    monkeypatch.setattr(streaming, "time", SimpleNamespace(perf_counter=lambda: next(clock)))


def test_send_times_the_first_chunk_with_a_token_and_reads_the_margins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    tops = [[[-0.1, 5], [-2.1, 6]], [[-0.5, 7]]]  # [logprob, id] of the top two per step
    lines = [
        b"",
        _chunk([]),  # a decoder that samples the first token itself streams this first
        _chunk([5]),
        _chunk([5, 7], {"output_top_logprobs": tops, "finish_reason": "length"}),
        b"data: [DONE]",
    ]
    bodies: list[dict[str, Any]] = []
    _stream(monkeypatch, _FakeResponse(200, lines), bodies)
    answer = send("http://x", Request("r", (0, 1, 2), 2), 5.0, logprobs=True, extra_key="ns")

    assert (answer.output_ids, answer.error, answer.prompt_tokens) == ((5, 7), "", 3)
    assert (answer.ttft_s, answer.empty_lead_s) == (2.0, 1.0)  # s after the start
    assert answer.margins == (pytest.approx(2.0), math.inf)
    assert bodies[0]["extra_key"] == "ns" and bodies[0]["top_logprobs_num"] == 2
    assert bodies[0]["sampling_params"] == {
        "temperature": 0,
        "max_new_tokens": 2,
        "ignore_eos": True,
    }


def test_send_reports_short_answers_and_http_errors_as_errors(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bodies: list[dict[str, Any]] = []
    _stream(monkeypatch, _FakeResponse(200, [_chunk([5], {"finish_reason": "abort"})]), bodies)
    short = send("http://x", Request("r", (0, 1), 3), 5.0, logprobs=False, extra_key=None)
    assert short.error == "1 tokens, finish abort" and math.isnan(short.empty_lead_s)
    assert "extra_key" not in bodies[0] and "return_logprob" not in bodies[0]

    _stream(monkeypatch, _FakeResponse(503, [], "overloaded"), bodies)
    failed = send("http://x", Request("r", (0, 1), 3), 5.0, logprobs=False, extra_key=None)
    assert failed.error == "HTTP 503: overloaded" and failed.output_ids == ()


def test_metric_sums_add_up_every_sample_of_a_named_metric(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    text = (
        "# TYPE kept_total counter\n"
        'kept_total{rank="0"} 3.0\n'
        'kept_total{rank="1"} 4.0\n'
        "# TYPE other gauge\n"
        "other 9.0\n"
    )
    monkeypatch.setattr(streaming.requests, "get", lambda url, **_: SimpleNamespace(text=text))
    assert metric_sums("http://x", ["kept_total", "missing_total"]) == {
        "kept_total": 7.0,
        "missing_total": 0.0,
    }
