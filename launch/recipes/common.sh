# Shared by the recipes in this folder: the environment, role dispatch, dry runs.
#
#   bash launch/recipes/<recipe>.sh prefill <i>   on the i-th prefill node (0-based)
#   bash launch/recipes/<recipe>.sh decode <i>    on the i-th decode node
#   bash launch/recipes/<recipe>.sh router        anywhere that reaches every node
#   bash launch/recipes/<recipe>.sh print         every node's command, to review
#   bash launch/recipes/<recipe>.sh serve         single-host recipes: everything, here
#
# Environment (the same on every node):
#   PREFILL_HOSTS   cluster-network addresses of the prefill nodes, in order ("10.0.0.11 ...")
#   DECODE_HOSTS    the same for the decode nodes
#   SGLPD_SECRET_FILE   the cluster secret, mode 600 (default /etc/sgl_pd/pd.secret):
#                   `umask 077; openssl rand -hex 32 > /etc/sgl_pd/pd.secret`, copied to every node
#   IB_DEVICES      the node's RDMA NICs, one per GPU in GPU order (default mlx5_0 .. mlx5_7)
#   MODEL_PATH      local path or Hugging Face id (default: the recipe's model)
#   ROUTER_PORT     (default 8000)
#   RECIPE_DRY_RUN=1  print the command's arguments one per line instead of running it
set -euo pipefail

RECIPES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(cd "$RECIPES_DIR/../.." && pwd)"
PYTHON="${PYTHON:-$ROOT/.venv/bin/python}"
SECRET_FILE="${SGLPD_SECRET_FILE:-${SGL_PD_SECRET_FILE:-/etc/sgl_pd/pd.secret}}"
read -r -a IB <<<"${IB_DEVICES:-mlx5_0 mlx5_1 mlx5_2 mlx5_3 mlx5_4 mlx5_5 mlx5_6 mlx5_7}"
read -r -a PREFILLS <<<"${PREFILL_HOSTS:-10.0.0.11}"
read -r -a DECODES <<<"${DECODE_HOSTS:-10.0.0.21 10.0.0.22 10.0.0.23}"
SERVER_PORT=30000
BOOTSTRAP_PORT=8998

# '{"0": "mlx5_0", "1": "mlx5_1", ...}' for shard ranks [first, first + count): each rank
# sends over the NIC beside its GPU (Mooncake then uses that NIC's NUMA node)
nic_per_rank() {
    local first="$1" count="$2" out="" r
    for ((r = first; r < first + count; r++)); do
        out+="${out:+, }\"$r\": \"${IB[$((r % ${#IB[@]}))]}\""
    done
    printf '{%s}' "$out"
}

# the flags every sgl_pd server of a recipe shares
pd_common_args() {
    # --pd-harness gpu: a node whose GPUs are not visible refuses at once, rather than
    # serve the model on the CPU engine
    printf '%s\n' --disaggregation-transfer-backend sgl_pd --pd-harness gpu \
        --pd-auth-secret-file "$SECRET_FILE" --port "$SERVER_PORT" --trust-remote-code
}

# a TP8 node of either role, one NIC per rank; the recipe sets MODEL
tp8_prefill_args() {
    printf '%s\n' --model-path "$MODEL" --tp-size 8 \
        --disaggregation-mode prefill --disaggregation-bootstrap-port "$BOOTSTRAP_PORT" \
        --disaggregation-ib-device "$(nic_per_rank 0 8)" \
        --host "${PREFILLS[$1]}" --chunked-prefill-size 16384 --max-running-requests 64 \
        --mem-fraction-static 0.85 --pd-kv-send layerwise
    pd_common_args
}

# a decoder keeps a prefix cache: a conversation's next turn, or a prompt sharing a
# system prompt, moves only the KV after the prefix it holds
decode_cache_args() {
    printf '%s\n' --disaggregation-decode-enable-radix-cache
}

tp8_decode_args() {
    printf '%s\n' --model-path "$MODEL" --tp-size 8 \
        --disaggregation-mode decode --disaggregation-ib-device "$(nic_per_rank 0 8)" \
        --host "${DECODES[$1]}" --max-running-requests 128 --mem-fraction-static 0.85
    decode_cache_args
    pd_common_args
}

# the router sends a request to the decoder whose cache holds most of its prompt
router_common_args() {
    local args=(--pd-disaggregation --host 0.0.0.0 --port "${ROUTER_PORT:-8000}"
        --decode-policy cache_aware) h
    for h in "${PREFILLS[@]}"; do args+=(--prefill "http://$h:$SERVER_PORT" "$BOOTSTRAP_PORT"); done
    for h in "${DECODES[@]}"; do args+=(--decode "http://$h:$SERVER_PORT"); done
    printf '%s\n' "${args[@]}"
}

# run one role: the recipe defines prefill_args I, decode_args I and router_args, each
# printing one argument per line
_run() {
    local module="$1"
    shift
    local args=()
    mapfile -t args < <("$@")
    if [[ "${RECIPE_DRY_RUN:-0}" == 1 ]]; then
        printf '%s\n' "$module" "${args[@]}"
        return
    fi
    exec "$PYTHON" -m "$module" "${args[@]}"
}

# one command, quoted for a shell
_print() {
    local module="$1" args=()
    shift
    mapfile -t args < <("$@")
    local out="$PYTHON -m $module" a
    for a in "${args[@]}"; do
        if [[ "$a" =~ ^[A-Za-z0-9_./:=,@+-]+$ ]]; then
            out+=" $a"
        else
            out+=" '${a//\'/\'\\\'\'}'"
        fi
    done
    echo "$out"
}

run_recipe() {
    local role="${1:-}" index="${2:-0}"
    case "$role" in
    prefill) _run sgl_pd.launch_server prefill_args "$index" ;;
    decode) _run sgl_pd.launch_server decode_args "$index" ;;
    router)
        if ! declare -F router_args >/dev/null; then
            echo "this recipe has no router: clients send requests to the decoders" >&2
            exit 2
        fi
        _run sglang_router.launch_router router_args
        ;;
    print)
        local i
        for ((i = 0; i < ${#PREFILLS[@]}; i++)); do
            echo "# prefill node $i (${PREFILLS[$i]})"
            _print sgl_pd.launch_server prefill_args "$i"
        done
        for ((i = 0; i < ${#DECODES[@]}; i++)); do
            echo "# decode node $i (${DECODES[$i]})"
            _print sgl_pd.launch_server decode_args "$i"
        done
        if declare -F router_args >/dev/null; then
            echo "# router"
            _print sglang_router.launch_router router_args
        fi
        ;;
    serve)
        if ! declare -F serve_here >/dev/null; then
            echo "this recipe runs on several nodes: start each role on its own node" >&2
            exit 2
        fi
        serve_here
        ;;
    *)
        echo "usage: bash $0 prefill|decode <node index> | router | print" >&2
        exit 2
        ;;
    esac
}
