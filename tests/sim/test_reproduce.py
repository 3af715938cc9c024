"""The article's DeepSeek-R1 figures, the planner and the command line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sgl_pd.sim.__main__ import main
from sgl_pd.sim.model import PRESETS
from sgl_pd.sim.planner import PlanInputs, Slo, plan
from sgl_pd.sim.reproduce import ARTICLE, R1_ASSUMPTIONS, cpu_check, headline, simulate_r1, within
from sgl_pd.sim.trace import Lengths

ROOT = Path(__file__).resolve().parents[2]


def test_the_article_figures_within_20_percent() -> None:
    head = headline(simulate_r1(R1_ASSUMPTIONS), R1_ASSUMPTIONS)
    for key, article in ARTICLE.items():
        assert within(head[key], article), (key, head[key], article)
    assert head["r1_mixed_tps"] < 50  # "struggled to exceed 50"
    assert head["r1_pd_tps"] > head["r1_mixed_tps"] * 1.5


def test_the_planner_returns_the_cheapest_deployment_that_meets_the_targets() -> None:
    slo = Slo(itl_p99_ms=25.0, ttft_p99_ms=3000.0)
    inputs = PlanInputs(
        PRESETS["deepseek-r1"](), "H200", 3.0, Lengths(10_000, 0.5), Lengths(950, 0.5), slo,
        requests=300, max_nodes=8,
    )  # fmt: skip
    best, tried = plan(inputs, progress=False)
    assert best is not None and slo.met_by(best.figures)
    cheaper = [c for c in tried if c.gpus < best.gpus]
    assert cheaper and not any(slo.met_by(c.figures) for c in cheaper)


def test_the_cli_reports_a_bad_model_without_a_traceback(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["predict", "--model", "/nowhere/config.json", "--rate", "1"]) == 2
    assert "unknown model" in capsys.readouterr().err


def test_predict_prints_a_json_line(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["predict", "--rate", "2", "--requests", "120", "--decode-nodes", "2"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["pd"]["tps_per_stream"] > 0 and last["mixed"]["requests"] > 0


RESULT = ROOT / "benchmarks/results/bench_mixed_vs_pd/mixed_vs_pd.json"


@pytest.mark.skipif(
    not RESULT.exists() or "step_ms_at_prompt_length" not in RESULT.read_text(),
    reason="no committed bench_mixed_vs_pd result with decode steps at the prompt's context",
)
def test_cpu_check_predicts_every_measured_row() -> None:
    out = cpu_check(RESULT, seeds=(1, 2, 3))
    measured = json.loads(RESULT.read_text())["results"]
    assert len(out["rows"]) == sum(len(runs) for runs in measured.values())
    for row in out["rows"]:
        assert row["predicted"]["tps_per_stream"] > 0
