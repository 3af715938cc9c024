"""DeepSeek-V4's and DSA's state components as planned (`core.state_components`), moved
through Mooncake between two processes' buffers of their shapes, on host memory: the
check `benchmarks/gpu/check.sh` runs on device memory where a GPU is lent."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu" / "state_components_gpu.py"


def test_every_named_item_lands_in_the_decoders_and_nothing_else() -> None:
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--device", "cpu"],
        capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stdout + done.stderr
    result = json.loads(lines[-1])
    assert result.get("ok") is True, result
    assert done.returncode == 0
    assert set(result["components"]) >= {"swa_ring", "dsv4_request_state", "request_row", "dsa"}
