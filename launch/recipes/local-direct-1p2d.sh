#!/usr/bin/env bash
# Direct mode on this machine with the bundled tiny model: one prefill server feeding two
# decoders, no router. Clients send requests (SGLang's /generate or the OpenAI API) to
# either decoder, which submits the prefill to the prefill server itself (D3).
#
#   bash launch/recipes/local-direct-1p2d.sh serve   start all three here (Ctrl-C stops them)
#   bash launch/recipes/local-direct-1p2d.sh print   the three commands
#   python -m sgl_pd.demo --direct                   the same cluster, with a few requests
#
# Ports: prefill 30000 (bootstrap 8998), decoders 30001 and 30002 (PORT_BASE moves them).
# Each server gets its own core where there are enough, and one torch thread per core.
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
MODEL="${MODEL_PATH:-$ROOT/sgl_pd/models/tiny_llama}"
BASE="${PORT_BASE:-30000}"
PREFILLS=(127.0.0.1)
DECODES=(127.0.0.1 127.0.0.1)
SECRET_FILE="${SGLPD_SECRET_FILE:-${SGL_PD_SECRET_FILE:-$ROOT/.cluster.secret}}"

# small pools (the model is tiny; SGLang's CPU engine sizes them from free host memory,
# which three servers starting together all see at once) and no idle polling
_local_args() {
    printf '%s\n' --model-path "$MODEL" --host 127.0.0.1 --disaggregation-transfer-backend sgl_pd \
        --pd-auth-secret-file "$SECRET_FILE" --mem-fraction-static 0.2 \
        --max-total-tokens 32768 --max-running-requests 64 --sleep-on-idle
}

prefill_args() {
    printf '%s\n' --port "$BASE" --disaggregation-mode prefill \
        --disaggregation-bootstrap-port "$BOOTSTRAP_PORT"
    _local_args
}

decode_args() {
    printf '%s\n' --port "$((BASE + 1 + $1))" --disaggregation-mode decode \
        --pd-prefill-bootstrap "127.0.0.1:$BOOTSTRAP_PORT"
    decode_cache_args
    _local_args
}

serve_here() {
    if [[ ! -s "$SECRET_FILE" ]]; then
        (umask 077 && openssl rand -hex 32 >"$SECRET_FILE")
    fi
    local cores
    cores=$(nproc)
    local pids=() args=() i=0 role
    # each server in its own process group: stopping one stops its schedulers too
    trap 'for p in "${pids[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done; wait' EXIT
    trap 'exit 130' INT TERM
    for role in "prefill 0" "decode 0" "decode 1"; do
        mapfile -t args < <(${role%% *}_args "${role##* }")
        OMP_NUM_THREADS=1 setsid taskset --cpu-list "$((i % cores))" \
            "$PYTHON" -m sgl_pd.launch_server "${args[@]}" &
        pids+=($!)
        i=$((i + 1))
    done
    echo "prefill http://127.0.0.1:$BASE; send requests to http://127.0.0.1:$((BASE + 1)) or" \
        "http://127.0.0.1:$((BASE + 2)) once they answer /health"
    wait -n
}

run_recipe "$@"
