"""Every benchmark still runs up to its campaign: it imports, its command line parses
(`--help`), and the parts that build protocol messages or print results run on tiny
inputs - seconds, not campaigns. A benchmark that rots (a message gained a field, a
helper was renamed) fails here, not on the day someone runs it."""

from __future__ import annotations

import collections
import importlib.util
import io
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPTS = sorted(p for p in BENCHMARKS.glob("bench_*.py"))


def _load(path: Path) -> ModuleType:
    sys.path.insert(0, str(path.parent))
    try:
        spec = importlib.util.spec_from_file_location(f"smoke_{path.stem}", path)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (its dataclasses look their module up there)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(str(path.parent))


def test_there_are_benchmarks() -> None:
    assert len(SCRIPTS) >= 15


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.stem)
def test_each_benchmark_parses_its_command_line(
    path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = _load(path)
    monkeypatch.setattr(sys, "argv", [path.name, "--help"])
    with pytest.raises(SystemExit) as exited:
        module.main()
    assert exited.value.code == 0
    out = capsys.readouterr().out
    assert "--quick" in out  # every benchmark has its quick mode
    assert "--out" in out  # where record.sh has it leave its files


def test_the_hostile_frame_campaign_builds_every_message() -> None:
    """`bench_hostile.auth_overhead` encodes each control message type, authenticated
    and not: the code that once failed before reporting (a message gained a field)."""
    module = _load(BENCHMARKS / "bench_hostile.py")
    overhead = module.auth_overhead(reps=1, frames=20)
    assert set(overhead) == {"chunk_notice", "transfer_64k"}  # (the figures: a loaded machine's)
    assert all(set(o) == {"plain_frames_per_s", "auth_frames_per_s", "us_per_frame"}
               for o in overhead.values())  # fmt: skip


def test_the_hostile_request_campaign_draws_and_reports(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from sgl_pd.cluster.hostile_requests import Case, Outcome, draw_bodies

    module = _load(BENCHMARKS / "bench_hostile_requests.py")
    openapi = {
        "openapi": "3.1.0",
        "info": {"title": "smoke", "version": "0"},
        "paths": {
            "/generate": {
                "post": {
                    "requestBody": {
                        "required": True,
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "properties": {
                                        "input_ids": {
                                            "type": "array",
                                            "items": {"type": "integer"},
                                        },
                                        "sampling_params": {"type": "object"},
                                    },
                                }
                            }
                        },
                    },
                    "responses": {"200": {"description": "ok"}},
                }
            }
        },
    }
    bodies = draw_bodies(
        "/generate", 30, openapi=openapi, prompt_ids=[1, 2, 3], vocab_size=512,
        context_len=2048, seed=0, negative_budget_s=2.0,
    )  # fmt: skip
    assert len(bodies) >= 20
    assert {b.kind for b in bodies} >= {"loose", "schema_overlay"}
    tallies = collections.defaultdict(module.Tally)
    for body, status in zip(bodies, [200, 400, 500, "timeout"] * 10, strict=False):
        tallies[("monolithic", body.endpoint)].add(Outcome(status))
    case = Case("/generate", bodies[0].body, "monolithic", 500, killed=False, excerpt="boom")
    summary = module.report(tallies, [case], ["lost one"], 1, ["monolithic"], 1.0)
    out = capsys.readouterr().out
    assert "server lost: lost one" in out and "case: monolithic /generate 500" in out
    assert summary["bodies"] == len(bodies)
    assert summary["server_errors_5xx"] == sum(1 for i in range(len(bodies)) if i % 4 == 2)
    json.dumps(summary)


def test_a_recorded_result_keeps_each_progress_bars_last_state_only(tmp_path: Path) -> None:
    final_states = _load(BENCHMARKS / "final_states.py")
    output = "bar  0%\rbar 50%\rbar 100%\nfigure 1\n\rbar 10%\r   \rnote\nlast\r\n"
    lines = io.StringIO(output, newline="\n").readlines()  # (a carriage return ends none)
    assert [final_states.final_state(line) for line in lines] == (
        ["bar 100%\n", "figure 1\n", "note\n", "last\n"]
    )
    recorded = tmp_path / "result.txt"
    recorded.write_bytes(output.encode())
    assert final_states.main([str(recorded)]) == 0
    assert recorded.read_bytes() == b"bar 100%\nfigure 1\nnote\nlast\n"


def test_committed_results_hold_no_progress_redraws() -> None:
    for result in sorted((BENCHMARKS / "results").glob("*.txt")):
        assert b"\r" not in result.read_bytes(), f"{result.name}: run final_states.py on it"


def test_the_load_benchmark_counts_sglangs_work_under_sgl_pd_hooks_as_sglangs() -> None:
    """A sample in SGLang's step run through an sgl_pd hook is SGLang's; one in the
    standard library under sgl_pd's code is sgl_pd's; one in SGLang's radix lookup asked
    for by sgl_pd counts only with its calls."""
    bench = _load(BENCHMARKS / "bench_load.py")
    site = "/v/lib/python3.11/site-packages"
    loop = f"run_scheduler_process ({site}/sglang/srt/managers/scheduler.py:1)"
    hook = "_next_batch (/w/sgl_pd/backend/decode/local_prefill.py:399)"
    raw = "\n".join(
        [
            f"{loop};{hook};get_next_batch ({site}/sglang/srt/disaggregation/decode.py:9) 6",
            f"{loop};put (/w/sgl_pd/messenger/keyed_workers.py:67);put (/py/queue.py:152) 3",
            f"{loop};lookup (/w/sgl_pd/x.py:1);match_prefix ({site}/sglang/srt/radix.py:2) 1",
            f"{loop};forward (/w/sgl_pd/harness/extend_attention_cpu.py:5) 10",
            "thread_loop (/w/sgl_pd/messenger/outbox.py:1) 50",  # (another thread)
        ]
    )
    share = bench.sgl_pd_share(raw)
    assert share.own == pytest.approx(3 / 20)
    assert share.with_calls == pytest.approx(10 / 20)  # (the harness stands in for SGLang)
    assert share.frames == [("put (/w/sgl_pd/messenger/keyed_workers.py:67)", 3)]


def test_the_placement_benchmark_alternates_and_pools_its_server_sets(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`on` and `off` start a server set each round, alternating which goes first; their
    answers pool under the round's key (the same conversations in each), and each round's
    ratios print beside each set's idle pace, so a set that ran slow as a whole shows."""
    from sgl_pd.cluster.streaming import Answer

    module = _load(BENCHMARKS / "bench_placement.py")
    assert module.run_order(3) == ["mono", "on", "off", "off", "on", "on", "off"]

    def phase(follow_up_s: float, gap_s: float, idle_ms: float) -> object:
        result = module.ModeResult(
            answers={"c0t1/follow_up": Answer("c0t1/follow_up", 40, (1,), follow_up_s)},
            gaps_s=[gap_s] * 3,
            local_prefills=2.0,
        )
        return module.Phase({2: result}, idle_ms, float("nan"))

    phases = {
        "mono": [phase(0.05, 0.010, 10.0)],
        "on": [phase(0.20, 0.016, 16.0), phase(0.10, 0.012, 12.0)],
        "off": [phase(0.10, 0.012, 12.0), phase(0.10, 0.012, 12.0)],
    }
    pooled = module.pooled(phases["on"], [2])[2]
    assert sorted(pooled.answers) == ["r0/c0t1/follow_up", "r1/c0t1/follow_up"]
    assert pooled.local_prefills == 4.0 and len(pooled.gaps_s) == 6
    by_round = module.round_ratios(phases, [2])
    assert [r["followup_ttft_p50_on_over_off"][2] for r in by_round] == [2.0, 1.0]
    assert [r["itl_p50_on_over_off"][2] for r in by_round] == [1.333, 1.0]
    module.print_rounds(phases, by_round)
    out = capsys.readouterr().out
    assert "16.0 ms" in out and "round 1 on/off by streams: followup_ttft_p50 2:1.00x" in out
    assert "on set 1 CPU over the sweep: unknown" in out
    assert module.steal_share((10, 1000), (30, 1100)) == 20.0
    assert module.steal_share(None, (30, 1100)) != module.steal_share(None, (30, 1100))  # nan


def test_the_placement_benchmark_reports_pooled_rounds(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The whole report of a two-round run, its servers stood in for: every mode judged
    against the reference, the pooled table, the rounds, and the headline JSON last."""
    from sgl_pd.cluster.streaming import Answer

    module = _load(BENCHMARKS / "bench_placement.py")
    started: list[str] = []

    def run_mode(mode: str, args: object, work: Path) -> object:
        started.append(mode)
        slow = 2.0 if (mode, started.count(mode)) == ("on", 1) else 1.0
        results = {
            count: module.ModeResult(
                answers={
                    f"c0t{t}/{kind}": Answer(f"c0t{t}/{kind}", 40, (1, 2), slow * s)
                    for t, kind, s in ((0, "fresh", 0.6), (1, "follow_up", 0.1))
                },
                gaps_s=[slow * 0.012] * 4,
            )
            for count in (2, 20)
        }
        return module.Phase(results, slow * 12.0, 0.5)

    monkeypatch.setattr(module, "run_mode", run_mode)
    monkeypatch.setattr(module.tempfile, "mkdtemp", lambda prefix: str(tmp_path / prefix))
    assert module.main(["--quick", "--rounds", "2", "--out", str(tmp_path)]) == 0
    assert started == ["mono", "on", "off", "off", "on"]
    lines = capsys.readouterr().out.strip().splitlines()
    headline = json.loads(lines[-1])
    assert headline["tokens_identical"] is True
    assert headline["followup_ttft_p50_on_over_off_by_round"] == [2.0, 1.0]
    assert headline["followup_ttft_p50_on_over_off"] == 1.5  # (0.2 + 0.1) / 2 / 0.1
    assert headline["idle_itl_ms"] == {"mono": [12.0], "on": [24.0, 12.0], "off": [12.0, 12.0]}
    assert any(line.startswith("round 0 on/off by streams") for line in lines)
    assert (tmp_path / "placement.json").exists()


def test_the_placement_benchmark_reads_each_server_process_s_cpu_time() -> None:
    """By role and process name over a process tree: here, this test's own process (its
    tree may hold more: servers another test started and keeps)."""
    import os

    import psutil

    module = _load(BENCHMARKS / "bench_placement.py")
    key = f"me/{psutil.Process().name()}"
    before = module.cpu_seconds({"me": os.getpid(), "gone": None})
    sum(i * i for i in range(300_000))  # (some CPU time to see)
    after = module.cpu_seconds({"me": os.getpid(), "gone": None})
    assert after[key] > before[key] and not any(k.startswith("gone/") for k in after)


def test_the_placement_benchmark_pairs_on_and_off_within_one_server_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`--paired`: one server set a round runs both modes, conversation by conversation
    as ABBA (the other way round in odd rounds), each its own; the monolithic reference
    runs every one of them, and the streams' gaps go to the mode running as each ended."""
    from sgl_pd.cluster.streaming import Answer

    module = _load(BENCHMARKS / "bench_placement.py")
    assert module.paired_modes(3, 0) == ["on", "off", "off", "on", "on", "off"]
    assert module.paired_modes(2, 1) == ["off", "on", "on", "off"]
    assert module.run_order(2, paired=True) == ["mono", "paired", "paired"]
    streams = module.Streams("http://unused", 0, 1)
    streams.timed_gaps = [(1.0, 0.01), (2.0, 0.02), (3.0, 0.03)]
    assert streams.gaps_within([(0.5, 1.5), (2.5, 3.0)]) == [0.01]

    asked: dict[str, int] = {}

    def result(conversations: range, follow_up_s: float) -> object:
        answers = {
            f"c{c}t{t}/{kind}": Answer(f"c{c}t{t}/{kind}", 40, (1, 2), s)
            for c in conversations
            for t, kind, s in ((0, "fresh", 0.6), (1, "follow_up", follow_up_s))
        }
        return module.ModeResult(answers=answers, gaps_s=[0.012] * 4)

    def run_mode(mode: str, args: object, work: Path) -> object:
        asked[mode] = args.conversations * (2 if args.paired and mode == "mono" else 1)
        return module.Phase({c: result(range(asked[mode]), 0.05) for c in (2, 20)}, 12.0, 0.5)

    def run_paired(args: object, work: Path, round_: int) -> dict[str, object]:
        modes = module.paired_modes(args.conversations, round_)
        return {
            m: module.Phase(
                {
                    c: result(
                        [j for j, x in enumerate(modes) if x == m], 0.08 if m == "on" else 0.1
                    )
                    for c in (2, 20)
                },
                12.0,
                0.5,
                paired=True,
            )
            for m in ("on", "off")
        }

    monkeypatch.setattr(module, "run_mode", run_mode)
    monkeypatch.setattr(module, "run_paired", run_paired)
    monkeypatch.setattr(module.tempfile, "mkdtemp", lambda prefix: str(tmp_path / prefix))
    assert module.main(["--quick", "--paired", "--out", str(tmp_path)]) == 0
    assert asked == {"mono": 6}  # (3 conversations for each mode)
    lines = capsys.readouterr().out.strip().splitlines()
    headline = json.loads(lines[-1])
    assert headline["design"] == "paired" and headline["tokens_identical"] is True
    assert headline["followup_ttft_p50_on_over_off"] == 0.8
    assert any("alternate within each of 1 server set" in line for line in lines)
    assert any("(paired: on and off ran in these sets)" in line for line in lines)
    assert not any(line.startswith(" off server sets") for line in lines)
    assert set(headline["idle_itl_ms"]) == {"mono", "on"}


def test_the_paired_placement_run_switches_local_prefill_for_each_conversation(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`run_paired` with its servers stood in: before each conversation the decoder's
    limit is set for that conversation's mode (back on at the end of each stream count),
    each conversation's answers, local prefills and streams' gaps go to its mode."""
    import argparse
    import contextlib

    from sgl_pd.cluster.streaming import Answer

    module = _load(BENCHMARKS / "bench_placement.py")
    limit = [module.LOCAL_MAX_TOKENS]
    switched: list[int] = []
    ran: list[tuple[int, int]] = []  # (conversation, the limit it ran under)
    placed = [0.0]

    def switch(url: str, tokens: int) -> None:
        switched.append(tokens)
        limit[0] = tokens

    def turns(url: str, conversations: range, *args: object, **kw: object) -> dict:
        (c,) = conversations
        ran.append((c, limit[0]))
        placed[0] += 1.0 if limit[0] else 0.0  # (one follow-up placed here when on)
        return {f"c{c}t1/follow_up": Answer(f"c{c}t1/follow_up", 40, (1,), 0.1)}

    def counts(url: str) -> dict[str, float]:
        counters = {"local": placed[0], "sent_out": placed[0], "mixed": 0.0, "unmixed": 0.0}
        return counters | {"out:itl_slo": placed[0]}  # (each sent out after all)

    class Streams:
        def __init__(self, url: str, count: int, tokens: int) -> None:
            pass

        @contextlib.contextmanager
        def running(self, timeout_s: float) -> Iterator[None]:
            yield

        def gaps_within(self, windows: list[tuple[float, float]]) -> list[float]:
            return [0.01] * len(windows)  # (a gap per conversation of the mode)

    monkeypatch.setattr(module, "servers_of", lambda *a: contextlib.nullcontext(None))
    monkeypatch.setattr(module, "_url_and_roles", lambda mode, started: ("http://d", {}))
    monkeypatch.setattr(module, "_warmed_up", lambda *a: 11.0)
    monkeypatch.setattr(module, "switch_local_prefill", switch)
    monkeypatch.setattr(module, "conversation_turns", turns)
    monkeypatch.setattr(module, "_local_counts", counts)
    monkeypatch.setattr(module, "Streams", Streams)
    args = argparse.Namespace(
        conversations=2, streams=[2, 20], stream_tokens=8, follow_ups=1, fresh_tokens=64,
        message_tokens=8,
    )  # fmt: skip
    phases = module.run_paired(args, Path("/unused"), 1)
    on, off = module.LOCAL_MAX_TOKENS, 0
    assert ran == [(0, off), (1, on), (2, on), (3, off)] * 2  # (round 1: off first)
    assert switched == [off, on, on, off, on] * 2
    for mode, conversations in (("on", ["c1", "c2"]), ("off", ["c0", "c3"])):
        result = phases[mode].results[20]
        assert sorted(k.split("t")[0] for k in result.answers) == conversations
        assert result.gaps_s == [0.01, 0.01]
        assert result.local_prefills == (2.0 if mode == "on" else 0.0)
        assert result.sent_out_why == ({"itl_slo": 2.0} if mode == "on" else {})
        assert phases[mode].idle_itl_ms == 11.0
