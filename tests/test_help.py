"""`python -m sgl_pd.launch_server --help`: usage first, sgl_pd's flags before SGLang's,
no start-up log lines."""

from __future__ import annotations

import subprocess
import sys


def test_help_starts_with_usage_and_lists_sgl_pds_flags_first() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "sgl_pd.launch_server", "--help"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert lines[0].startswith("usage: python -m sgl_pd.launch_server --model-path")
    text = done.stdout
    assert text.index("--pd-local-prefill-max-tokens") < text.index("--tp-size")
    assert "Applied" not in done.stdout + done.stderr  # no hook-registration log lines
    ours = text[: text.index("SGLang's arguments:")]
    assert "(default: 120.0)" in ours and "(default: layerwise)" in ours  # sgl_pd's defaults
