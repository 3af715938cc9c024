"""Small models bundled with sgl_pd.

``tiny_llama/`` is a ~6.5 MB Llama-architecture model trained on CPU by
``python -m sgl_pd.models.train_tiny`` (see README.md next to this file). It exists so that
monolithic and disaggregated serving can be compared token for token on real text, without
downloading anything. This module stays import-cheap: it only names paths.
"""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parent
TINY_LLAMA_PATH = MODELS_DIR / "tiny_llama"

__all__ = ["MODELS_DIR", "TINY_LLAMA_PATH"]
