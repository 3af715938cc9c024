#!/usr/bin/env bash
# Everything in sgl_pd that needs an NVIDIA GPU, in one command (about 5 minutes on one
# H200): the GPU tests (tests/gpu), the progress-counter benchmark (D8), Mooncake writes
# between GPU buffers through sgl_pd's transfer layer, and a cuMem export/import between
# two processes (D11), the KV checksums' cost on CUDA (the GPUDirect write flush is
# in tests/gpu), and DeepSeek-V4's and DSA's state components moved between device
# buffers of their shapes as planned (SGLang itself does not fit the machine). Runs from the checkout's root with the machine's python3 (CUDA,
# PyTorch, numpy, pytest); packages it lacks come from benchmarks/gpu/wheels and Debian
# libraries from benchmarks/gpu/debs (fetch_wheels.sh makes both; no network needed).
# Ends with one JSON line: every check's result.
#   bash benchmarks/gpu/check.sh
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$root"
out="${OUT:-$root/benchmarks/out/gpu}"
mkdir -p "$out"
py="${PYTHON:-python3}"
stage="$(mktemp -d)"
trap 'rm -rf "$stage"' EXIT

if compgen -G "benchmarks/gpu/debs/*.deb" >/dev/null; then
    for deb in benchmarks/gpu/debs/*.deb; do dpkg -x "$deb" "$stage/root"; done
    export LD_LIBRARY_PATH="$stage/root/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
if compgen -G "benchmarks/gpu/wheels/*.whl" >/dev/null; then
    "$py" -m pip install --quiet --no-index --no-deps --target "$stage/site" \
        benchmarks/gpu/wheels/*.whl >"$out/pip.log" 2>&1 || echo "[gpu] wheel install failed: $out/pip.log"
fi
export PYTHONPATH="$root:$stage/site${PYTHONPATH:+:$PYTHONPATH}"
# the CUDA 12 runtime Mooncake's engine links, from its wheel (the image's CUDA is newer)
if [[ -d "$stage/site/nvidia/cuda_runtime/lib" ]]; then
    export LD_LIBRARY_PATH="$stage/site/nvidia/cuda_runtime/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi
export PYTHONUNBUFFERED=1

# run NAME SECONDS CMD...: the command's output to $out/NAME.log; its last JSON line kept
results=()
run() {
    local name="$1" limit="$2"
    shift 2
    echo "[gpu] $name ..."
    local started=$SECONDS
    timeout "$limit" "$@" >"$out/$name.log" 2>&1
    local rc=$?
    local last
    last="$(grep -E '^\{.*\}$' "$out/$name.log" | tail -n 1)"
    [[ -n "$last" ]] || last='null'
    echo "[gpu] $name: rc $rc in $((SECONDS - started)) s"
    results+=("\"$name\": {\"rc\": $rc, \"result\": $last}")
}

# pytest prints no JSON line: its junit file is summarised into one after it
junit_summary='import json, sys, xml.etree.ElementTree as ET
s = ET.parse(sys.argv[1]).getroot()
s = s if s.tag == "testsuite" else s.find("testsuite")
print(json.dumps({k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}))'
run tests_gpu 150 bash -c '"$0" -m pytest -q -p no:cacheprovider tests/gpu --junitxml="$1"
    rc=$?; "$0" -c "$2" "$1"; exit $rc' "$py" "$out/tests_gpu.xml" "$junit_summary"
run progress_counter 150 "$py" benchmarks/gpu/bench_progress_counter.py --quick
run transfer_gpu 90 "$py" benchmarks/gpu/transfer_gpu.py
run cumem 60 "$py" benchmarks/gpu/cumem_check.py
run kv_checksum 120 "$py" benchmarks/bench_checksum.py --quick --device cuda
run state_components 90 "$py" benchmarks/gpu/state_components_gpu.py

joined="$(IFS=,; echo "${results[*]}")"
echo "{\"gpu_check\": {${joined}}}"
