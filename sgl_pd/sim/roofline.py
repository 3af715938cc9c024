"""Step latency of one engine instance from a roofline of the model on its GPUs.

A step runs every request of the batch once: `Work(new_tokens, context)` per request
(prefill chunk: new_tokens > 1; decode: 1). An instance is `gpus` GPUs serving one model
copy: tensor parallel (dp=1), or data-parallel attention over `dp` ranks of gpus/dp each
with the routed experts spread over all gpus (expert parallel), the DP decode of the brief.

Each phase costs max(FLOPs / achievable FLOP/s, bytes / achievable HBM bandwidth):
  attention side per rank: projections, dense MLPs, shared experts, LM head; attention
    math over the context; reads the non-expert weights (1/tp each) and the KV it attends
    (MLA keeps a full replica per rank, GQA heads shard over tp)
  routed experts, whole instance: the experts the step's tokens pick,
    E * (1 - (1 - k/E)^T) of them for T tokens of top-k routing
plus communication (two all-reduces per layer under TP, dispatch + combine per MoE layer
under EP) and a fixed per-step overhead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from sgl_pd.sim.hardware import Efficiency, Gpu
from sgl_pd.sim.model import ModelSpec


@dataclass(frozen=True)
class Work:
    new_tokens: int  # tokens this step pushes through the model for the request
    context: int  # tokens already in its KV cache


class StepCost(Protocol):
    def step_s(self, ranks: Sequence[Sequence[Work]]) -> float:
        """Seconds of one step; `ranks` holds each DP rank's works (one entry under TP)."""
        ...


@dataclass(frozen=True)
class RooflineCost:
    model: ModelSpec
    gpu: Gpu
    gpus: int = 8
    dp: int = 1
    eff: Efficiency = field(default_factory=Efficiency)

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.dp < 1 or self.gpus % self.dp:
            raise ValueError(f"{self.gpus} GPUs do not split into {self.dp} DP ranks")

    @property
    def tp(self) -> int:
        return self.gpus // self.dp

    @property
    def peak_flops(self) -> float:
        tflops = self.gpu.fp8_tflops if self.model.weight_bytes <= 1 else self.gpu.bf16_tflops
        return tflops * 1e12

    @property
    def hbm_bytes_s(self) -> float:
        return self.gpu.hbm_tb_s * 1e12 * self.eff.hbm

    def step_s(self, ranks: Sequence[Sequence[Work]]) -> float:
        works = [w for rank in ranks for w in rank]
        if not works:
            return 0.0
        attention = max(self._rank_s(rank) for rank in ranks)
        tokens = sum(w.new_tokens for w in works)
        prefill = any(w.new_tokens > 1 for w in works)
        overhead = self.eff.prefill_overhead_ms if prefill else self.eff.decode_overhead_ms
        return attention + self._experts_s(tokens) + self._comm_s(ranks) + overhead / 1e3

    def kv_weights_bytes_per_gpu(self) -> float:
        m = self.model
        experts = m.num_moe_layers * m.num_experts * m.expert_params * m.weight_bytes
        return m.dense_params * m.weight_bytes / self.tp + experts / self.gpus

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        """KV tokens one rank holds beside its weights (a fraction of HBM kept for activations)."""
        free = self.gpu.memory_gb * 1e9 * memory_fraction - self.kv_weights_bytes_per_gpu()
        per_token = self.model.kv_bytes_per_token / self._kv_shards()
        return max(0, int(free / per_token))

    def _kv_shards(self) -> int:
        m = self.model
        return 1 if m.mla else min(self.tp, m.kv.num_kv_heads)

    def _rank_s(self, works: Sequence[Work]) -> float:
        if not works:
            return 0.0
        m = self.model
        tokens = sum(w.new_tokens for w in works)
        per_token = (
            m.num_layers * m.attn_params
            + m.num_dense_layers * m.dense_mlp_params
            + m.num_moe_layers * m.shared_expert_params
        )
        gemm_flops = 2.0 * tokens * per_token + 2.0 * len(works) * m.vocab * m.hidden
        attn_flops = 0.0
        kv_tokens = 0
        for w in works:
            n, c = w.new_tokens, w.context
            qk, v = (m.qk_dim_decode, m.v_dim_decode) if n == 1 else (m.qk_dim, m.v_dim)
            attn_flops += 2.0 * m.num_heads * m.num_layers * n * (c + (n + 1) / 2) * (qk + v)
            kv_tokens += c + n
        compute = gemm_flops / (self.tp * self.peak_flops * self.eff.gemm(tokens))
        compute += attn_flops / (self.tp * self.peak_flops * self.eff.peak_mfu)
        weights = m.dense_params * m.weight_bytes / self.tp
        kv = kv_tokens * m.kv_bytes_per_token / self._kv_shards()
        return max(compute, (weights + kv) / self.hbm_bytes_s)

    def _experts_s(self, tokens: int) -> float:
        m = self.model
        if not m.num_experts or not tokens:
            return 0.0
        picks = tokens * m.experts_per_token
        touched = m.num_experts * (1.0 - (1.0 - m.experts_per_token / m.num_experts) ** tokens)
        flops = 2.0 * picks * m.expert_params * m.num_moe_layers
        compute = flops / (self.gpus * self.peak_flops * self.eff.gemm(picks / touched))
        weights = touched * m.expert_params * m.num_moe_layers * m.weight_bytes / self.gpus
        return max(compute, weights / self.hbm_bytes_s)

    def _comm_s(self, ranks: Sequence[Sequence[Work]]) -> float:
        m = self.model
        s = 0.0
        if self.tp > 1:
            tokens = max(sum(w.new_tokens for w in rank) for rank in ranks)
            ring = 2.0 * (self.tp - 1) / self.tp
            per = self.eff.allreduce_us / 1e6 + tokens * m.hidden * 2 * ring / (
                self.gpu.nvlink_gb_s * 1e9
            )
            s += 2 * m.num_layers * per
        if self.dp > 1 and m.num_experts:
            s += 2 * m.num_moe_layers * self.eff.all_to_all_us / 1e6
        return s


@dataclass(frozen=True)
class MeasuredCost:
    """Step times measured on a real server (one rank): prefill cost per token and a
    decode step that grows with the batch. Used to check the simulator against a run."""

    prefill_s_per_token: float
    decode_step_s: float  # batch of one
    decode_per_request_s: float  # each further request in the batch

    def step_s(self, ranks: Sequence[Sequence[Work]]) -> float:
        works = [w for rank in ranks for w in rank]
        prefill = sum(w.new_tokens for w in works if w.new_tokens > 1)
        decodes = sum(1 for w in works if w.new_tokens == 1)
        s = prefill * self.prefill_s_per_token
        if decodes:
            s += self.decode_step_s + (decodes - 1) * self.decode_per_request_s
        return s
