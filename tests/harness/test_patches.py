"""The patch applier, on a pristine copy of a file tree (no installed file is touched)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sgl_pd.harness.patches import PATCH_DIR, PatchError, apply, is_applied, patches_for

PATCH = """\
--- a/pkg/mod.py
+++ b/pkg/mod.py
@@ -1,2 +1,2 @@
 x = 1
-y = 2
+y = 3
"""


def _tree(tmp_path: Path, body: str) -> tuple[Path, Path]:
    (tmp_path / "root" / "pkg").mkdir(parents=True)
    (tmp_path / "root" / "pkg" / "mod.py").write_text(body)
    patch = tmp_path / "sglang-0.0.0-demo.patch"
    patch.write_text(PATCH)
    return tmp_path / "root", patch


def test_applies_once_then_reports_already_applied(tmp_path: Path) -> None:
    root, patch = _tree(tmp_path, "x = 1\ny = 2\n")
    assert apply(patch, root) is True
    assert (root / "pkg" / "mod.py").read_text() == "x = 1\ny = 3\n"
    assert is_applied(patch, root)
    assert apply(patch, root) is False


def test_a_patch_that_does_not_fit_is_a_clear_error(tmp_path: Path) -> None:
    root, patch = _tree(tmp_path, "x = 1\ny = 5\n")
    with pytest.raises(PatchError, match="does not apply"):
        apply(patch, root)
    assert (root / "pkg" / "mod.py").read_text() == "x = 1\ny = 5\n"  # untouched


def test_shipped_patches_apply_to_the_pinned_sglang() -> None:
    """Every patch in patches/ for the installed SGLang is either applied or applies."""
    import importlib.metadata

    import sglang

    version = importlib.metadata.version("sglang")
    site_packages = Path(sglang.__file__).resolve().parents[1]
    for patch in patches_for(version, PATCH_DIR):
        assert is_applied(patch, site_packages), f"{patch.name} is not applied: run install.sh"


def _unpatched_sglang(tmp_path: Path) -> Path:
    """A copy of the installed SGLang files the pinned patches touch, with the patches
    taken out again (as `pip install sglang` leaves them)."""
    import shutil
    import subprocess

    from sgl_pd.harness.patches import _sglang_site_packages

    version, site_packages = _sglang_site_packages()
    root = tmp_path / "site-packages"
    for patch in patches_for(version):
        for line in patch.read_text().splitlines():
            if line.startswith("+++ b/"):
                target = line.removeprefix("+++ b/").split("\t")[0]
                (root / target).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(site_packages / target, root / target)
        subprocess.run(["patch", "-p1", "-R", "-s", "-d", str(root), "-i", str(patch)], check=True)
    return root


def test_a_decode_first_token_server_refuses_to_start_without_the_patches(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The installed SGLang passes; a copy without the patches (an image that pip-installed
    sgl_pd and never patched SGLang) is refused by the launcher in one line naming them,
    before SGLang starts; --pd-first-token prefill needs none."""
    import importlib.metadata

    from sgl_pd import launch_server
    from sgl_pd.errors import ConfigError
    from sgl_pd.harness import patches

    patches.require_patches()
    version = importlib.metadata.version("sglang")
    unpatched = _unpatched_sglang(tmp_path)
    monkeypatch.setattr(patches, "_sglang_site_packages", lambda: (version, unpatched))
    with pytest.raises(ConfigError, match=r"decode-samples-first.*launch/install\.sh"):
        patches.require_patches()
    started: list[list[str]] = []
    monkeypatch.setattr(launch_server, "_serve", started.append)
    monkeypatch.setattr(launch_server, "plan_harness", lambda *_: pytest.fail("harness planned"))
    pd = ["--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "sgl_pd"]
    with pytest.raises(SystemExit) as refused:
        launch_server.main([*pd, "--pd-no-auth"])
    assert str(refused.value).startswith("sgl_pd: --pd-first-token decode needs")
    assert "\n" not in str(refused.value) and not started
    monkeypatch.setenv("SGLPD_HARNESS_APPLIED", "1")  # (as in the re-executed launcher)
    launch_server.main([*pd, "--pd-no-auth", "--pd-first-token", "prefill"])
    assert started
