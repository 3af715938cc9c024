"""The roofline against hand-computed step times of a small dense model."""

from __future__ import annotations

import pytest

from sgl_pd.sim.hardware import GPUS, Efficiency
from sgl_pd.sim.model import PRESETS, ModelSpec
from sgl_pd.sim.roofline import MeasuredCost, RooflineCost, Work

# every fraction 1, no fixed costs: the step is the bare roofline
IDEAL = Efficiency(
    peak_mfu=1.0, gemm_m_half=0.0, hbm=1.0, decode_overhead_ms=0.0, prefill_overhead_ms=0.0,
    allreduce_us=0.0, all_to_all_us=0.0,
)  # fmt: skip

DENSE = ModelSpec.from_hf_config(
    {
        "hidden_size": 1024,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 8,
        "intermediate_size": 4096,
        "vocab_size": 1000,
    },
    name="dense",
    weight_bytes=2,
)
# per layer: q, k, v, o 1024x1024 each + gate, up, down 1024x4096 each
LAYER = 4 * 1024 * 1024 + 3 * 1024 * 4096
LM_HEAD = 1000 * 1024
KV_PER_TOKEN = 2 * 2 * 8 * 128 * 2  # layers x (K, V) x heads x head_dim x bf16


def test_the_model_counts_match_the_configs() -> None:
    assert DENSE.dense_params == 2 * LAYER + LM_HEAD
    assert DENSE.kv_bytes_per_token == KV_PER_TOKEN
    r1, coder = PRESETS["deepseek-r1"](), PRESETS["qwen3-coder-480b"]()
    assert r1.total_params == pytest.approx(671e9, rel=0.01)
    assert r1.active_params == pytest.approx(37e9, rel=0.03)
    assert r1.kv_bytes_per_token == 70_272  # 61 layers x (512 + 64) x 2 B
    assert coder.total_params == pytest.approx(480e9, rel=0.01)
    assert coder.active_params == pytest.approx(35e9, rel=0.03)
    assert coder.kv_bytes_per_token == 253_952  # 62 x 2 x 8 x 128 x 2 B


def test_one_decode_step_of_one_request_reads_the_weights_once() -> None:
    cost = RooflineCost(DENSE, GPUS["H100"], gpus=1, eff=IDEAL)
    weights = (2 * LAYER + LM_HEAD) * 2  # bf16
    expected = (weights + KV_PER_TOKEN * 1) / 3.35e12  # memory-bound at 3.35 TB/s
    assert cost.step_s([[Work(1, 0)]]) == pytest.approx(expected, rel=1e-9)


def test_a_long_prefill_is_compute_bound() -> None:
    cost = RooflineCost(DENSE, GPUS["H100"], gpus=1, eff=IDEAL)
    n = 4096
    gemm = 2 * n * (2 * LAYER) + 2 * 1 * LM_HEAD  # the LM head runs for the last token
    attention = 2 * 8 * 2 * n * (0 + (n + 1) / 2) * (128 + 128)  # causal: half the pairs
    expected = (gemm + attention) / 989e12
    assert cost.step_s([[Work(n, 0)]]) == pytest.approx(expected, rel=1e-9)


def test_tensor_parallel_splits_work_and_adds_two_all_reduces_per_layer() -> None:
    eff = Efficiency(**{**IDEAL.__dict__, "allreduce_us": 10.0})
    one = RooflineCost(DENSE, GPUS["H100"], gpus=1, eff=IDEAL).step_s([[Work(1, 0)]])
    two = RooflineCost(DENSE, GPUS["H100"], gpus=2, eff=eff)
    ring = 1 * 1024 * 2 * 2 * (2 - 1) / 2 / 450e9  # one token's activations, bf16
    kv_half = KV_PER_TOKEN / 2  # heads shard over both ranks
    weights_half = (2 * LAYER + LM_HEAD) * 2 / 2
    expected = (weights_half + kv_half) / 3.35e12 + 2 * 2 * (10e-6 + ring)
    assert two.step_s([[Work(1, 0)]]) == pytest.approx(expected, rel=1e-9)
    assert expected < one + 2 * 2 * 10e-6


def test_routed_experts_read_grows_with_the_tokens_until_every_expert_is_read() -> None:
    cost = RooflineCost(PRESETS["deepseek-r1"](), GPUS["H200"], eff=IDEAL)
    steps = [cost.step_s([[Work(1, 1000)] * b]) for b in (1, 4, 16, 64, 256)]
    assert steps == sorted(steps)
    # 256 tokens x top-8 of 256 experts touch nearly all: doubling again adds little
    assert cost.step_s([[Work(1, 1000)] * 512]) < 1.5 * steps[-1]


def test_data_parallel_ranks_step_together_at_the_slowest_rank() -> None:
    cost = RooflineCost(PRESETS["deepseek-r1"](), GPUS["H200"], gpus=8, dp=8)
    light = cost.step_s([[Work(1, 1000)]] * 8)
    one_heavy = cost.step_s([[Work(1, 1000)]] * 7 + [[Work(1, 1000)] * 16])
    assert one_heavy > light
    with pytest.raises(ValueError, match="DP ranks"):
        RooflineCost(DENSE, GPUS["H100"], gpus=8, dp=3)


def test_measured_cost_adds_prefill_tokens_and_a_growing_decode_step() -> None:
    cost = MeasuredCost(prefill_s_per_token=0.001, decode_step_s=0.010, decode_per_request_s=0.002)
    assert cost.step_s([[Work(100, 0)]]) == pytest.approx(0.1)
    assert cost.step_s([[Work(1, 5)] * 3]) == pytest.approx(0.014)
    assert cost.step_s([[Work(100, 0), Work(1, 5)]]) == pytest.approx(0.11)
