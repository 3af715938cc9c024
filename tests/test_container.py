"""The container image definition the Kubernetes manifests name: no registry or Docker
daemon is reachable here, so its steps are checked against what the installer (tested
by every run of the suite) does and against the pins."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "launch" / "container" / "Dockerfile"


def _sglang_pin() -> str:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    (pin,) = [d for d in deps if d.startswith("sglang==")]
    return pin.split("==")[1]


def test_the_image_starts_from_sglangs_official_image_of_the_pinned_version() -> None:
    text = DOCKERFILE.read_text()
    base = re.search(r"^ARG SGLANG_IMAGE=(\S+)$", text, re.M)
    assert base is not None and "FROM ${SGLANG_IMAGE}" in text
    assert base.group(1).startswith(f"lmsysorg/sglang:v{_sglang_pin()}-cu"), base.group(1)


def test_the_image_installs_what_the_installer_installs_on_a_gpu_host() -> None:
    text = DOCKERFILE.read_text()
    installer = (ROOT / "launch" / "install.sh").read_text()
    libs = re.search(r"^system_libs=\(([^)]*)\)", installer, re.M)
    assert libs is not None
    for lib in libs.group(1).split():
        if lib != "gcc":  # builds the CPU engine's stand-in driver: not on a GPU image
            assert lib in text, lib
    assert 'pip install --no-cache-dir -e ".[cuda]"' in text  # Mooncake's CUDA build
    assert "python3 -m sgl_pd.harness.patches apply" in text
    assert "require_decode_patches" in text  # the build fails if the patch is missing
    assert 'ENTRYPOINT ["python3", "-m", "sgl_pd.launch_server"]' in text


def test_the_manifests_run_that_image() -> None:
    images = {
        m.group(1)
        for path in (ROOT / "launch" / "k8s").rglob("*.yaml")
        for m in re.finditer(r"^\s+image: (\S+)$", path.read_text(), re.M)
    }
    assert images == {"sgl-pd:latest"}, images
    assert "-t sgl-pd:latest" in DOCKERFILE.read_text()
