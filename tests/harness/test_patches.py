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
