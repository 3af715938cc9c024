"""GPUs, NICs and the efficiency factors that turn datasheet peaks into step times.

Peaks are the vendors' dense (no sparsity) datasheet figures. Efficiencies are calibrated,
not measured here (these machines have no GPU); `Efficiency` documents each one, and
`sgl_pd.sim.reproduce` prints the set it used beside its results.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Gpu:
    name: str
    bf16_tflops: float  # dense
    fp8_tflops: float  # dense
    hbm_tb_s: float  # TB/s
    memory_gb: float
    nvlink_gb_s: float  # per GPU, one direction


GPUS = {
    "H100": Gpu("H100", 989.0, 1979.0, 3.35, 80.0, 450.0),
    "H200": Gpu("H200", 989.0, 1979.0, 4.8, 141.0, 450.0),
    "B200": Gpu("B200", 2250.0, 4500.0, 8.0, 180.0, 900.0),
}


@dataclass(frozen=True)
class Nics:
    per_node: int = 8
    gbit_s: float = 400.0  # line rate of one NIC

    def node_bytes_s(self, efficiency: float) -> float:
        return self.per_node * self.gbit_s / 8 * 1e9 * efficiency


@dataclass(frozen=True)
class Efficiency:
    """Fractions of peak a served step reaches, and fixed costs the roofline leaves out."""

    # GEMM throughput saturates with the rows a weight matrix sees per step (tokens per
    # expert for routed experts, tokens per step otherwise): eff(m) = peak_mfu * m/(m + m_half)
    peak_mfu: float = 0.55
    gemm_m_half: float = 96.0
    # fraction of HBM bandwidth reached streaming weights and KV (decode)
    hbm: float = 0.80
    # per step: scheduling, launch (CUDA graphs in decode), sampling
    decode_overhead_ms: float = 1.0
    prefill_overhead_ms: float = 4.0
    # tensor-parallel all-reduce, two per layer: latency + bytes over NVLink
    allreduce_us: float = 10.0
    # expert-parallel dispatch + combine per MoE layer (DP attention + EP decode), inter-node
    all_to_all_us: float = 40.0
    # Mooncake/RDMA utilisation of line rate (measured 77-82%) and per-transfer latency
    nic: float = 0.80
    transfer_latency_ms: float = 0.2

    def gemm(self, rows: float) -> float:
        """Fraction of peak FLOPs for a GEMM that sees `rows` tokens per weight matrix."""
        return self.peak_mfu * rows / (rows + self.gemm_m_half) if rows > 0 else self.peak_mfu
