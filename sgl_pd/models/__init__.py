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
# DeepSeek-V3 (MLA, MoE, one NextN/MTP layer) and Qwen3-MoE, by train_tiny_moe.py
TINY_DEEPSEEK_V3_PATH = MODELS_DIR / "tiny_deepseek_v3"
TINY_QWEN3_MOE_PATH = MODELS_DIR / "tiny_qwen3_moe"
# Mellum: sliding-window and full-attention layers (SGLang's hybrid SWA pool)
TINY_MELLUM_PATH = MODELS_DIR / "tiny_mellum"
# Gemma 3's text model: sliding-window layers SGLang keeps in its one plain pool
TINY_GEMMA3_PATH = MODELS_DIR / "tiny_gemma3"
# Qwen3-Next: gated-DeltaNet (linear attention) and full-attention layers (a Mamba pool)
TINY_QWEN3_NEXT_PATH = MODELS_DIR / "tiny_qwen3_next"

__all__ = [
    "MODELS_DIR",
    "TINY_DEEPSEEK_V3_PATH",
    "TINY_GEMMA3_PATH",
    "TINY_LLAMA_PATH",
    "TINY_MELLUM_PATH",
    "TINY_QWEN3_MOE_PATH",
    "TINY_QWEN3_NEXT_PATH",
]
