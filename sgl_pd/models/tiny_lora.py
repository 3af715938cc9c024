"""A LoRA adapter for the bundled tiny Llama, written on demand (PEFT's file format).

Its weights are seeded noise, large enough to change the model's greedy answers: what
matters is that an adapter applied on the prefill server and on the decoder (or not at
all) shows in the tokens. ``python -m sgl_pd.models.tiny_lora DIR`` writes one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

# the projections of every attention layer: o_proj included, whose forward the
# layer-wise streaming follows (SGLang swaps in a LoRA module for each)
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")


def write_tiny_lora(directory: Path, seed: int = 0, rank: int = 8, scale: float = 2.0) -> Path:
    """Writes an adapter for `sgl_pd.models.TINY_LLAMA_PATH` into `directory`; returns it."""
    import torch
    from safetensors.torch import save_file

    from sgl_pd.models import TINY_LLAMA_PATH

    config = json.loads((TINY_LLAMA_PATH / "config.json").read_text())
    hidden = int(config["hidden_size"])
    head_dim = int(config["head_dim"])
    q_out = int(config["num_attention_heads"]) * head_dim
    kv_out = int(config["num_key_value_heads"]) * head_dim
    shapes = {"q_proj": (hidden, q_out), "k_proj": (hidden, kv_out),
              "v_proj": (hidden, kv_out), "o_proj": (q_out, hidden)}  # fmt: skip
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(int(config["num_hidden_layers"])):
        for module, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(rank, fan_in, generator=generator) * scale / fan_in**0.5
            b = torch.randn(fan_out, rank, generator=generator) * scale / rank**0.5
            tensors[f"{prefix}.lora_A.weight"] = a.contiguous()
            tensors[f"{prefix}.lora_B.weight"] = b.contiguous()
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": str(TINY_LLAMA_PATH),
        "r": rank,
        "lora_alpha": rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(TARGET_MODULES),
        "fan_in_fan_out": False,
    }
    (directory / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2))
    return directory


if __name__ == "__main__":
    print(write_tiny_lora(Path(sys.argv[1])))
