"""Larger models of the bundled tiny Llama's architecture, with random weights.

With the bundled 1.6M-parameter Llama, SGLang's per-step overhead, not compute, sets the
step time, so a long prompt's prefill costs only a few decode steps - unlike on a GPU
serving a real model, where it costs hundreds. Benchmarks about decode stutter need that
GPU-like ratio, so they serve a wider, deeper model of the same architecture with
SGLang's dummy weights (`--load-format dummy`): same tokenizer, no weight file.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass
from pathlib import Path

from sgl_pd.models import TINY_LLAMA_PATH

DUMMY_WEIGHTS_ARGS = ("--load-format", "dummy")  # what a server of a scaled model needs
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
)


@dataclass(frozen=True)
class LlamaShape:
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    def parameters(self, vocab_size: int) -> int:
        """Weights, tied embedding included (norms left out)."""
        attn = self.hidden_size * self.head_dim * (2 * self.num_heads + 2 * self.num_kv_heads)
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp) + vocab_size * self.hidden_size


def write_scaled_llama(directory: Path, shape: LlamaShape) -> Path:
    """A model directory of the tiny Llama's architecture and tokenizer at `shape`."""
    if shape.hidden_size % shape.num_heads or shape.num_heads % shape.num_kv_heads:
        raise ValueError(f"heads do not divide: {shape}")
    directory.mkdir(parents=True, exist_ok=True)
    for name in _TOKENIZER_FILES:
        shutil.copyfile(TINY_LLAMA_PATH / name, directory / name)
    config = json.loads((TINY_LLAMA_PATH / "config.json").read_text())
    config.update(
        hidden_size=shape.hidden_size,
        num_hidden_layers=shape.num_layers,
        intermediate_size=shape.intermediate_size,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.head_dim,
    )
    (directory / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory
