"""The documentation: the site builds in strict mode (a broken page, nav entry or link
fails it), the generated reference pages match the code, and the README stays a page
a newcomer reads on one screen or two."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_site_builds_strictly(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "flags" / "index.html").exists()


def test_the_generated_pages_are_what_the_code_says() -> None:
    """Adding or changing a flag, variable or metric without regenerating its page
    (`python -m sgl_pd.reference`) fails here."""
    pytest.importorskip("prometheus_client")
    from sgl_pd.reference import PAGES

    for page, markdown in PAGES.items():
        assert page.read_text() == markdown(), f"{page.name}: run python -m sgl_pd.reference"


def _string_constants(tree: ast.AST) -> set[str]:
    return {
        n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


# a name the code passes to or reads from the environment (prefixes: ours, SGLang's, Mooncake's)
_VARIABLE = re.compile(r"^(SGLPD|SGLANG|MC)_[A-Z0-9_]*[A-Z0-9]$")


def test_every_variable_the_code_names_is_documented() -> None:
    """A new environment variable in sgl_pd/ without its entry in `sgl_pd.environment`
    (and so on the generated page) fails here; so does one the CPU harness sets."""
    from sgl_pd.environment import VARIABLES
    from sgl_pd.harness.cpu import Harness, plan_harness
    from sgl_pd.reference import ENVIRONMENT_PAGE

    listed = {v.name for v in VARIABLES}
    for path in (ROOT / "sgl_pd").rglob("*.py"):
        for name in _string_constants(ast.parse(path.read_text())):
            if _VARIABLE.match(name):
                assert name in listed, (
                    f"{path.relative_to(ROOT)}: {name} is not in sgl_pd/environment.py"
                )
    page = ENVIRONMENT_PAGE.read_text()
    for name in plan_harness(Harness.CPU, ["--disaggregation-mode", "decode"]).env:
        assert f"`{name}" in page, name


def test_every_metric_the_code_registers_is_documented() -> None:
    """A Prometheus series created anywhere in sgl_pd/ outside the objects the generator
    reads fails here (its page would miss it)."""
    pytest.importorskip("prometheus_client")
    from sgl_pd.reference import metric_families

    documented = {name.removesuffix("_total") for name, *_ in metric_families()}
    makers = {"Counter", "Gauge", "Histogram", "Summary", "counter", "gauge", "histogram"}
    found = set()
    for path in (ROOT / "sgl_pd").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
                func = node.func
                called = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                if called in makers and str(node.args[0].value).startswith("sgl_pd_"):
                    found.add(str(node.args[0].value))
    assert found and found <= documented, found - documented


def test_every_flag_is_on_the_flags_page() -> None:
    import argparse

    from sgl_pd.config import add_cli_args
    from sgl_pd.reference import FLAGS_PAGE

    parser = argparse.ArgumentParser(add_help=False)
    add_cli_args(parser)
    page = FLAGS_PAGE.read_text()
    for action in parser._actions:
        for flag in action.option_strings:
            if flag.startswith("--"):
                assert f"`{max(action.option_strings, key=len)}`" in page, flag


def test_the_readme_is_short_and_links_only_to_what_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    for target in ("docs/running.md", "docs/design.md", "docs/benchmarks.md", "docs/flags.md"):
        assert target in readme and (ROOT / target).exists(), target


def test_every_committed_result_says_how_it_was_made() -> None:
    """The README and docs quote committed results: each is headed by its command and
    commit (benchmarks/record.sh writes them)."""
    for result in sorted((ROOT / "benchmarks" / "results").glob("*.txt")):
        head = result.read_text().splitlines()[:2]
        assert len(head) == 2 and head[0].startswith("# command: "), result.name
        assert head[1].startswith("# commit: "), result.name


def test_the_design_page_points_at_code_that_exists() -> None:
    """Each safety argument's row names files, and the symbols in them, that exist: moving
    or renaming the code that enforces one fails here until the page follows."""
    page = (ROOT / "docs" / "design.md").read_text()
    table = page.split("## The safety arguments", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| ") and "`sgl_pd/" in line]
    assert len(rows) >= 10
    for row in rows:
        where = row.rsplit("|", 2)[1]
        for path, symbols in re.findall(r"`(sgl_pd/[\w/]+\.py)`(?: \(([^)]*)\))?", where):
            source = (ROOT / path).read_text()
            for symbol in re.findall(r"`([\w.]+)`", symbols):
                name = symbol.rsplit(".", 1)[-1]
                assert re.search(rf"\b(def|class) {name}\b|\b{name}\b\s*[:=]", source), (
                    f"{path} has no {symbol}"
                )


def test_the_parity_matrix_size_quoted_is_the_tables() -> None:
    from sgl_pd.cluster.parity import ROWS

    for page in (ROOT / "README.md", ROOT / "docs" / "index.md"):
        quoted = re.findall(r"(\d+)-row parity matrix", page.read_text())
        assert quoted == [str(len(ROWS))], page.name
