"""The marks every GPU test module carries: `gpu`, and skipped cleanly without CUDA."""

from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


GPU_ONLY = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not _cuda_available(), reason="needs a CUDA device: torch.cuda.is_available() is False"
    ),
]
