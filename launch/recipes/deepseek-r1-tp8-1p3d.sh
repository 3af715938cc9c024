#!/usr/bin/env bash
# DeepSeek-R1, one prefill node feeding three decode nodes, TP8 on both sides (identical
# sharding: shard i sends to shard i, every NIC busy; MLA replica sets spread the sending).
# Usage and environment: launch/recipes/common.sh. Defaults: PREFILL_HOSTS="10.0.0.11",
# DECODE_HOSTS="10.0.0.21 10.0.0.22 10.0.0.23".
#
# Simulated on 8 x H200 + 8 x 400 Gb/s per node, prompts ~10k tokens, outputs ~950, 3 req/s
# (benchmarks/sim_recipes.sh -> benchmarks/results/sim_recipes.txt; assumptions printed by
# `python -m sgl_pd.sim reproduce`):
#   PD 1P:3D:        TTFT p50 330 ms, ITL p50 10.9 / p99 15.3 / max 17 ms, 89.6 tok/s per
#                    stream, ~1 req/s per decode node, KV exposed after the prefill 0.24 ms
#   4 mixed nodes:   TTFT p50 215 ms, ITL p50 9.1 / p99 12.9 / max 2090 ms, 92.8 tok/s
#   (same GPUs)      per stream: as fast per stream at this load, but stalls of seconds
# MTP: add the same --speculative-algorithm EAGLE --speculative-num-steps 1
# --speculative-eagle-topk 1 --speculative-num-draft-tokens 2 to both roles (the prefiller
# then hands the first draft to the decoder); the figures above are without it.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
MODEL="${MODEL_PATH:-deepseek-ai/DeepSeek-R1}"

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
