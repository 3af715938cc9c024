#!/usr/bin/env bash
# Downloads, on a machine with network access, what benchmarks/gpu/check.sh needs on a GPU
# machine without network that already has CUDA, PyTorch, numpy and pytest: the Python
# packages sgl_pd adds (as wheels for that machine's Python) and the RDMA/NUMA libraries
# Mooncake links even for TCP (as Debian packages, unpacked there without installing).
#   bash benchmarks/gpu/fetch_wheels.sh [python version, default 3.12]
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${1:-3.12}"
mkdir -p "$here/wheels" "$here/debs"
python3 -m pip download --quiet --no-deps --dest "$here/wheels" --only-binary=:all: \
    --python-version "$py" --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_17_x86_64 \
    mooncake-transfer-engine msgspec pyzmq nvidia-cuda-runtime-cu12
# Mooncake's engine links the CUDA 12 runtime, which a CUDA 13 image lacks (the wheel
# above brings it). Its wheel also bundles the store, EP and process-group libraries
# (about 90 MB): the slimmed copy keeps the transfer engine, so the whole set fits what
# a GPU host without network can be handed (64 MiB)
python3 "$here/slim_wheel.py" "$here"/wheels/mooncake_transfer_engine-*.whl
(cd "$here/debs" && apt-get download libibverbs1 librdmacm1 libnuma1 ibverbs-providers >/dev/null)
echo "wheels: $(ls "$here/wheels" | tr '\n' ' ')"
echo "debs:   $(ls "$here/debs" | tr '\n' ' ')"
echo "carry benchmarks/gpu/wheels and benchmarks/gpu/debs with the check (both git-ignored)"
