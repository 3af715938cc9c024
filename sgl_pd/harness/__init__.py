"""CPU harness: what lets real SGLang serve on a machine without a GPU.

Only one thing is stood in for: the driver library that the sgl-kernel wheel links
(``libcuda_stub.c``). Everything else about the CPU path is SGLang's own CPU engine,
selected by flags and environment in :mod:`sgl_pd.harness.cpu`, plus the missing pieces
:mod:`sgl_pd.harness.cpu_shims` supplies at run time.

Multi-rank servers on the CPU engine (SGLang 0.5.23, gloo collectives between ranks):

- runs: ``--tp N`` for the tiny Llama, DeepSeek-V3 (MLA, MoE, NEXTN) and Qwen3-MoE, as
  monolithic servers and on both sides of a PD pair, at any pairing of TP sizes; each
  rank is pinned to its entry of ``SGLANG_CPU_OMP_THREADS_BIND`` (one '|'-separated
  entry per rank), which the local tooling sets from its placement;
- does not run: pipeline parallelism and DP replicas (``--pp-size``, ``--dp-size``
  without DP attention), which sgl_pd refuses; ``--enable-two-batch-overlap`` and CUDA
  graphs need a GPU. DP attention: see the README's test section.
"""
