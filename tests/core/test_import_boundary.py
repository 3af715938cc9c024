"""The core imports only the standard library, numpy and msgspec."""

from __future__ import annotations

import pkgutil
import subprocess
import sys

import pytest

import sgl_pd.core

FORBIDDEN = ("torch", "zmq", "mooncake", "sglang")
MODULES = sorted(m.name for m in pkgutil.iter_modules(sgl_pd.core.__path__))


@pytest.mark.parametrize("module", MODULES)
def test_core_module_imports_nothing_heavy(module: str) -> None:
    code = (
        f"import sys, sgl_pd.core.{module}\n"
        f"bad = [m for m in sys.modules if m.split('.')[0] in {FORBIDDEN!r}]\n"
        "print(','.join(bad))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "", f"sgl_pd.core.{module} pulled in {out.stdout.strip()}"


def test_msgspec_only_in_wire() -> None:
    code = (
        "import sys, importlib\n"
        f"for m in {[m for m in MODULES if m != 'wire']!r}:\n"
        "    importlib.import_module('sgl_pd.core.' + m)\n"
        "print('msgspec' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "False"
