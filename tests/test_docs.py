"""The documentation: the site builds in strict mode (a broken page, nav entry or link
fails it), the generated reference pages match the code, and the README stays a page
a newcomer reads on one screen or two."""

from __future__ import annotations

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


def test_the_flags_page_is_what_the_parser_says() -> None:
    """Adding or changing a flag without regenerating its page (`python -m
    sgl_pd.reference`) fails here."""
    from sgl_pd.reference import FLAGS_PAGE, flags_markdown

    assert FLAGS_PAGE.read_text() == flags_markdown(), "run: python -m sgl_pd.reference"


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
