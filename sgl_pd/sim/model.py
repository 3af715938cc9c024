"""Model shapes for the simulator: parameter counts, KV bytes and FLOPs, from a Hugging Face
config.json (dict). Pure: the standard library and the core's KV layout only.

Counts are per token and per layer kind, enough for a roofline (see `roofline.py`):
  dense params: read every step whatever the batch (attention, dense MLPs, shared experts)
  expert params: one routed expert of one MoE layer; a step reads the experts its tokens pick
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sgl_pd.core.layout import KvLayout, PageLayout


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden: int
    num_heads: int
    vocab: int
    attn_params: int  # per layer
    dense_mlp_params: int  # per dense layer
    num_dense_layers: int
    num_moe_layers: int
    num_experts: int  # routed experts per MoE layer (0: dense model)
    experts_per_token: int
    expert_params: int  # one routed expert
    shared_expert_params: int  # per MoE layer, always active
    kv: KvLayout
    # attention math per (query token, key token) pair and head, multiply-adds
    qk_dim: int  # query-key dot product length (prefill form)
    v_dim: int
    qk_dim_decode: int  # MLA decodes in the absorbed form: latent + rope
    v_dim_decode: int
    weight_bytes: float  # bytes per parameter as served (1 for FP8, 2 for bf16)
    mla: bool

    @property
    def dense_params(self) -> int:
        """Parameters every step reads regardless of batch size (embeddings excluded: a
        lookup, and the LM head counted once)."""
        return (
            self.num_layers * self.attn_params
            + self.num_dense_layers * self.dense_mlp_params
            + self.num_moe_layers * self.shared_expert_params
            + self.vocab * self.hidden
        )

    @property
    def total_params(self) -> int:
        routed = self.num_moe_layers * self.num_experts * self.expert_params
        return self.dense_params + routed + self.vocab * self.hidden

    @property
    def active_params(self) -> int:
        return self.dense_params + self.num_moe_layers * self.experts_per_token * self.expert_params

    @property
    def kv_bytes_per_token(self) -> int:
        """One replica of the KV of one token over all layers (the core's layout)."""
        return self.kv.bytes_per_token

    @classmethod
    def from_hf_config(
        cls, config: dict[str, Any], *, name: str = "", weight_bytes: float = 1.0, kv_bytes: int = 2
    ) -> ModelSpec:
        """Reads DeepSeek-V2/V3 (MLA, MoE), Qwen3-MoE / Qwen2-MoE and Llama-like dense configs."""
        h = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        vocab = int(config["vocab_size"])
        name = name or str(config.get("_name_or_path") or config.get("model_type", "model"))
        mla = "kv_lora_rank" in config and config.get("kv_lora_rank")
        if mla:
            lora = int(config["kv_lora_rank"])
            rope = int(config["qk_rope_head_dim"])
            nope = int(config["qk_nope_head_dim"])
            v = int(config["v_head_dim"])
            q_lora = config.get("q_lora_rank")
            q_dim = heads * (nope + rope)
            q = h * q_dim if not q_lora else h * int(q_lora) + int(q_lora) * q_dim
            attn = q + h * (lora + rope) + lora * heads * (nope + v) + heads * v * h
            kv = KvLayout.mla(
                num_layers=layers,
                kv_lora_rank=lora,
                rope_dim=rope,
                page_size=64,
                elem_bytes=kv_bytes,
                page_layout=PageLayout.NHD,
            )
            qk, vd, qk_dec, v_dec = nope + rope, v, lora + rope, lora
        else:
            kv_heads = int(config.get("num_key_value_heads", heads))
            hd = int(config.get("head_dim") or h // heads)
            attn = h * heads * hd + 2 * h * kv_heads * hd + heads * hd * h
            kv = KvLayout.gqa(
                num_layers=layers,
                num_kv_heads=kv_heads,
                head_dim=hd,
                page_size=64,
                elem_bytes=kv_bytes,
                page_layout=PageLayout.HND,
            )
            qk = vd = qk_dec = v_dec = hd
        experts = int(config.get("n_routed_experts") or config.get("num_experts") or 0)
        moe_inter = int(config.get("moe_intermediate_size") or 0)
        inter = int(config.get("intermediate_size") or 0)
        if experts:
            first_dense = int(config.get("first_k_dense_replace", 0))
            dense_only = set(config.get("mlp_only_layers") or [])
            num_dense = max(first_dense, len(dense_only))
            shared = int(config.get("n_shared_experts") or 0) * 3 * h * moe_inter
            shared += 3 * h * int(config.get("shared_expert_intermediate_size") or 0)
            per_token = int(config["num_experts_per_tok"])
        else:
            num_dense, shared, per_token = layers, 0, 0
        return cls(
            name=name,
            num_layers=layers,
            hidden=h,
            num_heads=heads,
            vocab=vocab,
            attn_params=attn,
            dense_mlp_params=3 * h * inter,
            num_dense_layers=num_dense,
            num_moe_layers=layers - num_dense,
            num_experts=experts,
            experts_per_token=per_token,
            expert_params=3 * h * moe_inter,
            shared_expert_params=shared,
            kv=kv,
            qk_dim=qk,
            v_dim=vd,
            qk_dim_decode=qk_dec,
            v_dim_decode=v_dec,
            weight_bytes=weight_bytes,
            mla=bool(mla),
        )


# The published configs' fields the simulator reads (config.json of each repository).
DEEPSEEK_R1_CONFIG: dict[str, Any] = {
    "_name_or_path": "deepseek-ai/DeepSeek-R1",
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

QWEN3_CODER_480B_CONFIG: dict[str, Any] = {
    "_name_or_path": "Qwen/Qwen3-Coder-480B-A35B-Instruct",
    "model_type": "qwen3_moe",
    "hidden_size": 6144,
    "intermediate_size": 8192,
    "moe_intermediate_size": 2560,
    "num_experts": 160,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 62,
    "num_attention_heads": 96,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "mlp_only_layers": [],
    "vocab_size": 151936,
}

PRESETS = {
    "deepseek-r1": lambda: ModelSpec.from_hf_config(DEEPSEEK_R1_CONFIG, name="DeepSeek-R1"),
    "qwen3-coder-480b": lambda: ModelSpec.from_hf_config(
        QWEN3_CODER_480B_CONFIG, name="Qwen3-Coder-480B-A35B"
    ),
}


def model_by_name(name_or_path: str) -> ModelSpec:
    """A preset name, or a path to a Hugging Face config.json (served in FP8 weights)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]()
    import json
    from pathlib import Path

    path = Path(name_or_path)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(
            f"unknown model {name_or_path!r}: give one of {', '.join(PRESETS)} or a config.json"
        )
    return ModelSpec.from_hf_config(json.loads(path.read_text()), name=path.parent.name)
