"""CPU harness: what lets real SGLang serve on a machine without a GPU.

Only one thing is stood in for: the driver library that the sgl-kernel wheel links
(``libcuda_stub.c``). Everything else about the CPU path is SGLang's own CPU engine,
selected by flags and environment in :mod:`sgl_pd.harness.cpu`, plus the missing pieces
:mod:`sgl_pd.harness.cpu_shims` supplies at run time.

Multi-rank servers on the CPU engine (SGLang 0.5.23, gloo collectives between ranks):

- runs (tested): ``--tp 2`` as monolithic servers and on either side of a PD pair - the
  tiny Llama at TP2 -> TP2, TP2 -> TP1 and TP1 -> TP2, DeepSeek-V3 with NEXTN at TP2 ->
  TP1 and TP1 -> TP2, Qwen3-MoE at TP2 -> TP2 - and a DP-attention DeepSeek-V3 decoder
  (``--tp 2 --dp 2 --enable-dp-attention``); each rank is pinned to its entry of
  ``SGLANG_CPU_OMP_THREADS_BIND`` (one '|'-separated entry per rank), which the local
  tooling sets from its placement;
- does not run: pipeline parallelism and DP replicas (``--pp-size``, ``--dp-size``
  without DP attention), which sgl_pd refuses; ``--enable-two-batch-overlap`` and CUDA
  graphs need a GPU; expert parallelism (``--ep``) fails in SGLang's CPU MoE itself
  (``moe_forward_native`` indexes experts with the -1 ids of the other rank's experts).
"""
