"""The DeepSeek-V3 NextN / MTP layer as a training module (transformers has none).

It mirrors SGLang's ``DeepseekModelNextN`` (``sglang/srt/models/deepseek_nextn.py``) so the
trained weights load there unchanged:

    x_t = eh_proj(cat(enorm(embed(token_{t+1})), hnorm(h_t)))     # (tokens, hidden)
    y_t = shared_head.norm(decoder(x_t, position t))                # one MoE decoder layer
    logits_t = lm_head(y_t)   -> predicts token_{t+2}

``h_t`` is the target model's last hidden state *after* its final norm (what SGLang's
logits processor captures for the draft), ``embed`` and ``lm_head`` are the target's own
(SGLang's ``set_embed_and_head`` shares them). Checkpoint names are
``model.layers.{num_hidden_layers}.{enorm,hnorm,eh_proj,shared_head.norm}.*`` plus the
decoder layer's own names under the same prefix (SGLang's loader maps them to
``model.decoder.*``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class NextNLayer(nn.Module):
    def __init__(self, config: Any) -> None:
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
            DeepseekV3DecoderLayer,
            DeepseekV3RMSNorm,
        )

        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_id = config.num_hidden_layers
        self.enorm = DeepseekV3RMSNorm(hidden, eps=eps)
        self.hnorm = DeepseekV3RMSNorm(hidden, eps=eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        # layer_idx past first_k_dense_replace: an MoE layer, as SGLang builds it (is_nextn)
        self.decoder = DeepseekV3DecoderLayer(config, layer_idx=self.layer_id)
        self.shared_head = nn.Module()
        self.shared_head.norm = DeepseekV3RMSNorm(hidden, eps=eps)

    def forward(
        self,
        next_embeds: torch.Tensor,
        hidden: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """`next_embeds`, `hidden`: (batch, seq, hidden) - the embedding of token t+1 and
        the target's normed hidden state at t. Returns the normed output, (batch, seq,
        hidden), for the shared lm_head."""
        x = self.eh_proj(torch.cat((self.enorm(next_embeds), self.hnorm(hidden)), dim=-1))
        x = self.decoder(x, attention_mask=None, position_embeddings=position_embeddings)
        return self.shared_head.norm(x)

    def checkpoint_tensors(self) -> dict[str, torch.Tensor]:
        """This layer's weights under the names SGLang's DeepSeek loader expects (experts
        unfused, one tensor per expert and projection)."""
        prefix = f"model.layers.{self.layer_id}."
        out: dict[str, torch.Tensor] = {}
        for name, tensor in self.state_dict().items():
            name = name.removeprefix("decoder.")
            out.update(unfuse_experts(prefix + name, tensor))
        return out


def unfuse_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """transformers 5 keeps MoE experts fused (``mlp.experts.gate_up_proj``: (experts,
    2 * inter, hidden); ``mlp.experts.down_proj``: (experts, hidden, inter)); checkpoints
    and SGLang's loader use ``mlp.experts.{e}.{gate,up,down}_proj.weight``."""
    if name.endswith("mlp.experts.gate_up_proj"):
        base = name.removesuffix("gate_up_proj")
        out = {}
        for e, w in enumerate(tensor):
            gate, up = w.chunk(2, dim=0)  # (inter, hidden) each
            out[f"{base}{e}.gate_proj.weight"] = gate.contiguous()
            out[f"{base}{e}.up_proj.weight"] = up.contiguous()
        return out
    if name.endswith("mlp.experts.down_proj"):
        base = name.removesuffix("down_proj")
        return {f"{base}{e}.down_proj.weight": w.contiguous() for e, w in enumerate(tensor)}
    return {name: tensor.contiguous()}


def checkpoint_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """A transformers MoE causal LM's weights in the per-expert checkpoint layout."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        out.update(unfuse_experts(name, tensor))
    return out
