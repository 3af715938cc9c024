"""Builds the stand-in ``libcuda.so.1`` from ``libcuda_stub.c`` (see that file for why).

Run by the installer (``python -m sgl_pd.harness.build_stub``); the launcher calls
:func:`ensure_stub` too, so a checkout whose build folder was cleaned still starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sgl_pd.errors import SglPdError

SOURCE = Path(__file__).with_name("libcuda_stub.c")
BUILD_DIR = Path(__file__).with_name("build")
STUB_PATH = BUILD_DIR / "libcuda.so.1"


class StubBuildError(SglPdError):
    """The stand-in driver library could not be compiled."""


def ensure_stub() -> Path:
    """Returns the stub's path, compiling it first when missing or older than its source."""
    if STUB_PATH.exists() and STUB_PATH.stat().st_mtime >= SOURCE.stat().st_mtime:
        return STUB_PATH
    compiler = shutil.which("gcc") or shutil.which("cc")
    if compiler is None:
        raise StubBuildError(
            "no C compiler found to build the stand-in libcuda.so.1; install gcc "
            "(apt-get install gcc) and run launch/install.sh again"
        )
    BUILD_DIR.mkdir(exist_ok=True)
    # a name of this build's own: launchers started side by side on a fresh checkout
    # each build it, and one's rename must not take the file another is writing
    handle, name = tempfile.mkstemp(prefix="libcuda.so.", suffix=".tmp", dir=BUILD_DIR)
    os.close(handle)
    tmp = Path(name)
    cmd = [compiler, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(tmp), str(SOURCE)]
    result = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise StubBuildError(f"building {STUB_PATH.name} failed:\n{result.stderr}")
    tmp.replace(STUB_PATH)  # atomic, so a concurrent launcher never loads half a file
    return STUB_PATH


def main() -> None:
    try:
        path = ensure_stub()
    except StubBuildError as e:
        sys.exit(f"[install] {e}")
    print(f"[install] stand-in driver library: {path}")


if __name__ == "__main__":
    main()
