"""Applies the version-pinned patches in ``patches/`` to the installed SGLang.

A patch is named ``sglang-<version>-<what>.patch`` and is a unified diff with paths
relative to site-packages (``a/sglang/srt/...``). Applying is idempotent: a patch whose
reverse applies cleanly is already in place and is skipped.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sgl_pd.errors import SglPdError

PATCH_DIR = Path(__file__).resolve().parents[2] / "patches"


class PatchError(SglPdError):
    """A patch does not apply to the installed SGLang."""


def patches_for(version: str, patch_dir: Path = PATCH_DIR) -> list[Path]:
    return sorted(patch_dir.glob(f"sglang-{version}-*.patch"))


def _patch(patch: Path, target_root: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["patch", "-p1", "--force", "--silent", "-d", str(target_root), "-i", str(patch), *flags],
        capture_output=True,
        text=True,
        check=False,
    )


def is_applied(patch: Path, target_root: Path) -> bool:
    # --force: never guess that a patch is reversed (--batch would, and apply it forward)
    return _patch(patch, target_root, "--reverse", "--dry-run").returncode == 0


def apply(patch: Path, target_root: Path) -> bool:
    """Applies ``patch`` under ``target_root``; False when it was already applied."""
    if is_applied(patch, target_root):
        return False
    check = _patch(patch, target_root, "--dry-run")
    if check.returncode != 0:
        raise PatchError(
            f"{patch.name} does not apply to {target_root}: {check.stdout}{check.stderr}\n"
            "Reinstall the pinned SGLang version (launch/install.sh) and try again."
        )
    _patch(patch, target_root)
    return True


def main(argv: list[str]) -> None:
    if argv != ["apply"]:
        sys.exit("usage: python -m sgl_pd.harness.patches apply")
    import importlib.metadata

    import sglang  # only to find where it is installed

    version = importlib.metadata.version("sglang")
    site_packages = Path(sglang.__file__).resolve().parents[1]
    patches = patches_for(version)
    for patch in patches:
        try:
            applied = apply(patch, site_packages)
        except PatchError as e:
            sys.exit(f"[install] {e}")
        print(f"[install] {patch.name}: {'applied' if applied else 'already applied'}")
    if not patches:
        print(f"[install] no patches for SGLang {version}")


if __name__ == "__main__":
    main(sys.argv[1:])
