#!/usr/bin/env bash
# The simulator's figures for each recipe in launch/recipes/ (the setups their headers
# quote), under the assumptions `python -m sgl_pd.sim reproduce` prints.
#   bash benchmarks/sim_recipes.sh [--out DIR]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out="benchmarks/out"
[[ "${1:-}" == --out ]] && out="$2"
py=.venv/bin/python
echo "== deepseek-r1-tp8-1p3d: 1 prefill : 3 decode TP8 H200 nodes, 3 req/s"
$py -m sgl_pd.sim predict --model deepseek-r1 --rate 3 --prefill-nodes 1 --decode-nodes 3 \
    --requests 1500 --out "$out/deepseek-r1-tp8-1p3d"
echo "== deepseek-r1-dp-decode: 11 prefill TP8 nodes : DP32+EP32 decode over 4 nodes, 32 req/s"
$py -m sgl_pd.sim predict --model deepseek-r1 --rate 32 --prefill-nodes 11 --decode-nodes 1 \
    --decode-dp --decode-gpus 32 --requests 3000 --out "$out/deepseek-r1-dp-decode"
echo "== qwen3-coder-480b-tp8-1p3d: 1 prefill : 3 decode TP8 H200 nodes, 16k-token code contexts, 3 req/s"
$py -m sgl_pd.sim predict --model qwen3-coder-480b --rate 3 --prompt-mean 16000 \
    --output-mean 600 --prefill-nodes 1 --decode-nodes 3 --requests 1500 \
    --out "$out/qwen3-coder-480b-tp8-1p3d"
