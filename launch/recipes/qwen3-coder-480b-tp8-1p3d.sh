#!/usr/bin/env bash
# Qwen3-Coder-480B-A35B (GQA, 8 KV heads), one prefill node feeding three decode nodes,
# TP8 on both sides: one KV head per rank, rank i sends its slice to rank i over its NIC.
# Usage and environment: launch/recipes/common.sh. Defaults: PREFILL_HOSTS="10.0.0.11",
# DECODE_HOSTS="10.0.0.21 10.0.0.22 10.0.0.23".
#
# Simulated on 8 x H200 + 8 x 400 Gb/s per node, long code contexts (prompts ~16k tokens,
# outputs ~600), 3 req/s (benchmarks/sim_recipes.sh -> benchmarks/results/sim_recipes.txt):
#   PD 1P:3D:        TTFT p50 1129 ms / p99 4.4 s (the one prefill node is busy), ITL p50
#                    6.2 / p99 11.7 / max 13 ms, 154 tok/s per stream, KV exposed 0.41 ms
#   4 mixed nodes:   TTFT p50 292 ms, ITL p50 5.9 / p99 8.5 / max 2796 ms, 140 tok/s
#   A second prefill node (2P:3D) brings TTFT p50 to 316 ms (`python -m sgl_pd.sim predict
#   --model qwen3-coder-480b --rate 3 --prompt-mean 16000 --output-mean 600 --prefill-nodes 2`)
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
MODEL="${MODEL_PATH:-Qwen/Qwen3-Coder-480B-A35B-Instruct-FP8}"

prefill_args() {
    tp8_prefill_args "$1"
}

decode_args() {
    tp8_decode_args "$1"
}

router_args() {
    router_common_args
}

run_recipe "$@"
