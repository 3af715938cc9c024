"""Applies the version-pinned patches in ``patches/`` to the installed SGLang.

A patch is named ``sglang-<version>-<what>.patch`` and is a unified diff with paths
relative to site-packages (``a/sglang/srt/...``). Applying is idempotent: a patch whose
reverse applies cleanly is already in place and is skipped.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from sgl_pd.errors import ConfigError, SglPdError

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


def _sglang_site_packages() -> tuple[str, Path]:
    """The installed SGLang's version and the directory that holds its package, found
    without importing it (its import takes seconds)."""
    import importlib.metadata
    import importlib.util

    spec = importlib.util.find_spec("sglang")
    if spec is None or spec.origin is None:
        raise ConfigError("SGLang is not installed: run launch/install.sh")
    return importlib.metadata.version("sglang"), Path(spec.origin).resolve().parents[1]


def require_patches() -> None:
    """Refuses, in one line, to serve `--pd-first-token decode` on an SGLang without
    sgl_pd's pinned patches (an image that installed sgl_pd with pip but never applied
    them, or SGLang reinstalled over them): that SGLang would hand the decoder KV for
    every prompt token and sample a second first token."""
    version, site_packages = _sglang_site_packages()
    patches = patches_for(version)
    if not patches:
        raise ConfigError(
            f"sgl_pd has no patches for SGLang {version} (it is pinned to the version in its"
            " pyproject.toml): reinstall with launch/install.sh, or serve with"
            " --pd-first-token prefill on both servers"
        )
    try:
        missing = [p.name for p in patches if not is_applied(p, site_packages)]
    except FileNotFoundError:
        raise ConfigError(
            "the `patch` program is missing (apt-get install patch): sgl_pd needs it to"
            " check its SGLang patches"
        ) from None
    if missing:
        raise ConfigError(
            f"--pd-first-token decode needs sgl_pd's pinned SGLang patches, and"
            f" {', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not applied to"
            f" {site_packages / 'sglang'}: run launch/install.sh (python -m"
            " sgl_pd.harness.patches apply), or serve with --pd-first-token prefill on both"
            " servers"
        )


def main(argv: list[str]) -> None:
    if argv != ["apply"]:
        sys.exit("usage: python -m sgl_pd.harness.patches apply")
    try:
        version, site_packages = _sglang_site_packages()
    except ConfigError as e:
        sys.exit(f"[install] {e}")
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
