#!/usr/bin/env bash
# DeepSeek-R1 with data-parallel decode: the decode nodes form one instance of DP attention
# (one rank per GPU) with the routed experts spread over all of them (EP, DeepEP low-latency
# kernels); prefill nodes stay TP8. Any prefill rank holding a replica of the MLA cache can
# send (D14): each decode rank is given a random source rank, so all NICs share the load.
# Usage and environment: launch/recipes/common.sh. Defaults: 11 prefill nodes
# (PREFILL_HOSTS="10.0.0.11 ... 10.0.0.21"), 4 decode nodes (DECODE_HOSTS, the first one
# also hosts the decode instance's torch.distributed rendezvous on port 5757).
#
# Simulated on H200 nodes, prompts ~10k tokens, outputs ~950, 1 req/s per decode rank
# (32 req/s; benchmarks/sim_recipes.sh -> benchmarks/results/sim_recipes.txt):
#   PD:               TTFT p50 210 ms, ITL p50 19.6 / p99 20.0 ms, 51 tok/s per stream,
#                     ~1 req/s per rank, 8 ranks per node
#   15 mixed TP8 nodes (same GPUs): cannot keep up (11.5 of 32 req/s served)
# DP attention on the decode side runs with sgl_pd's backend on CPU (the bundled tiny
# DeepSeek-V3, TP1 prefill -> TP2 DP2 decode, tests/e2e/test_models.py); not yet on GPUs.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
MODEL="${MODEL_PATH:-deepseek-ai/DeepSeek-R1}"
if [[ -z "${PREFILL_HOSTS:-}" ]]; then
    read -r -a PREFILLS <<<"$(printf '10.0.0.%s ' $(seq 11 21))"
fi
if [[ -z "${DECODE_HOSTS:-}" ]]; then
    read -r -a DECODES <<<"10.0.0.31 10.0.0.32 10.0.0.33 10.0.0.34"
fi
DECODE_RANKS=$((8 * ${#DECODES[@]}))

prefill_args() {
    tp8_prefill_args "$1"
}

decode_args() {
    printf '%s\n' --model-path "$MODEL" --tp-size "$DECODE_RANKS" --dp-size "$DECODE_RANKS" \
        --enable-dp-attention --moe-a2a-backend deepep --deepep-mode low_latency \
        --nnodes "${#DECODES[@]}" --node-rank "$1" --dist-init-addr "${DECODES[0]}:5757" \
        --disaggregation-mode decode --disaggregation-ib-device "$(nic_per_rank 0 "$DECODE_RANKS")" \
        --host "${DECODES[$1]}" --max-running-requests 2048 --mem-fraction-static 0.85
    decode_cache_args
    pd_common_args
}

router_args() {
    # one decode instance: only its first node serves HTTP
    local saved=("${DECODES[@]}")
    DECODES=("${saved[0]}")
    router_common_args
    DECODES=("${saved[@]}")
}

run_recipe "$@"
