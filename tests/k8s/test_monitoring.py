"""The alert rules and the dashboard shipped in launch/k8s/monitoring: promtool checks
the rules and runs their unit tests (synthetic series), every dashboard expression is
valid PromQL, and every series they read is one sgl_pd or SGLang exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
MONITORING = ROOT / "launch/k8s/monitoring"
RULES = MONITORING / "sgl-pd-alerts.yaml"
DASHBOARD = MONITORING / "sgl-pd-dashboard.json"

needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None,
    reason="promtool is not installed: launch/install.sh installs it (Debian's prometheus)",
)


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dashboard["panels"] for t in p["targets"]]


def alert_exprs() -> dict[str, str]:
    """Alert name -> its quantity (the expression without `> threshold`)."""
    groups = yaml.safe_load(RULES.read_text())["groups"]
    out = {}
    for rule in (r for g in groups for r in g["rules"]):
        match = re.fullmatch(r"(.*\S)\s*[<>]=?\s*[0-9.e+-]+", rule["expr"].strip(), re.S)
        assert match, rule["alert"]
        out[rule["alert"]] = match.group(1)
    return out


def _promtool(*args: str, cwd: Path = MONITORING) -> str:
    result = subprocess.run(
        ["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@needs_promtool
def test_promtool_checks_the_rules() -> None:
    assert "SUCCESS: 4 rules found" in _promtool("check", "rules", RULES.name)


@needs_promtool
def test_promtool_unit_tests_of_the_rules_pass() -> None:
    assert "SUCCESS" in _promtool("test", "rules", "sgl-pd-alerts.test.yaml")


@needs_promtool
def test_every_dashboard_and_alert_expression_is_valid_promql(tmp_path: Path) -> None:
    exprs = dashboard_exprs() + list(alert_exprs().values())
    rules = {"groups": [{"name": "check", "rules": [
        {"record": f"sgl_pd:check_{i}", "expr": e} for i, e in enumerate(exprs)
    ]}]}  # fmt: skip
    (tmp_path / "exprs.yaml").write_text(yaml.safe_dump(rules))
    out = _promtool("check", "rules", "exprs.yaml", cwd=tmp_path)
    assert f"SUCCESS: {len(exprs)} rules found" in out


def test_the_dashboard_reads_only_series_that_exist() -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from sgl_pd.backend.metrics import TransferMetrics

    registry = CollectorRegistry()
    TransferMetrics(True, "prefill", registry)
    ours = set(re.findall(r"^(sgl_pd_\w+?)(?:\{| )", generate_latest(registry).decode(), re.M))
    # SGLang's names hold a colon, which a Prometheus scraping OpenMetrics from today's
    # prometheus_client stores as "_": the dashboard matches either spelling
    sglang = {"time_to_first_token_seconds_bucket", "inter_token_latency_seconds_bucket",
              "num_running_reqs", "num_queue_reqs"}  # fmt: skip
    exprs = dashboard_exprs() + list(alert_exprs().values())
    used = {m for e in exprs for m in re.findall(r"\b(sgl_pd_\w+)", e)}
    theirs = {m for e in exprs for m in re.findall(r'"sglang\[:_\](\w+)"', e)}
    assert used - ours == set() and theirs == sglang
    assert "sglang:" not in " ".join(exprs)
    titles = " ".join(p["title"] for p in json.loads(DASHBOARD.read_text())["panels"])
    assert "TTFT" in titles and "Inter-token" in titles  # SGLang's, beside ours
