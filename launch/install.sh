#!/usr/bin/env bash
# Installs what sgl_pd needs to serve into .venv at the checkout's root, on a fresh Linux
# machine, with or without a GPU (the test tools are launch/install_test_tools.sh's).
# Safe to run again: finished steps are skipped quickly.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
python="${PYTHON:-python3.11}"
command -v "$python" >/dev/null 2>&1 || python=python3

say() { printf '[install] %s\n' "$*"; }

# pip's own output (hundreds of lines, mostly warnings about packages it does not touch)
# goes to a log file; the terminal gets a line every 15 s with the packages pip has
# collected so far, and the log's tail only if pip fails.
pip_log="${TMPDIR:-/tmp}/sgl_pd-install-pip.log"
pip_quietly() {
    local what="$1"
    shift
    say "$what (pip's log: $pip_log)"
    "$venv/bin/python" -m pip install --progress-bar off "$@" >>"$pip_log" 2>&1 &
    local pid=$! waited=0
    while kill -0 "$pid" 2>/dev/null; do
        sleep 1
        waited=$((waited + 1))
        if ((waited % 15 == 0)); then
            say "  ... ${waited} s, $(grep -c '^Collecting' "$pip_log" || true) packages collected"
        fi
    done
    if ! wait "$pid"; then
        say "pip failed; the last lines of $pip_log:"
        tail -n 40 "$pip_log" >&2
        exit 1
    fi
}

# Mooncake's transfer engine links the RDMA and NUMA libraries even when it only uses TCP;
# gcc builds the stand-in driver library, patch applies patches/.
system_libs=(libibverbs1 librdmacm1 libnuma1 patch gcc)
missing=()
for lib in "${system_libs[@]}"; do
    dpkg -s "$lib" >/dev/null 2>&1 || missing+=("$lib")
done
if ((${#missing[@]})); then
    say "installing system libraries: ${missing[*]}"
    sudo_cmd=()
    [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq "${missing[@]}" >/dev/null
fi

if [[ ! -x "$venv/bin/python" ]]; then
    say "creating $venv with $("$python" --version)"
    "$python" -m venv "$venv"
fi

# GPU hosts take Mooncake's CUDA build; every other host the build without CUDA.
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    extra=cuda
else
    extra=cpu
fi

stamp="$venv/.sgl_pd-installed"
fingerprint="$extra $(sha256sum "$root/pyproject.toml" | cut -c1-16)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$fingerprint" ]]; then
    : >"$pip_log"
    say "installing sgl_pd[$extra] and SGLang into $venv (first run: about 5 minutes)"
    pip_quietly "upgrading pip" --upgrade pip
    pip_quietly "installing sgl_pd and its dependencies" -e "$root[$extra]"
    echo "$fingerprint" >"$stamp"
else
    say "python packages up to date"
fi

# The stand-in driver library for hosts without a GPU (see sgl_pd/harness/libcuda_stub.c).
"$venv/bin/python" -m sgl_pd.harness.build_stub

# Version-pinned patches to SGLang, if any (patches/README.md).
"$venv/bin/python" -m sgl_pd.harness.patches apply

say "ready: $venv"
