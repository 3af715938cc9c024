#!/usr/bin/env bash
# Runs one benchmark and keeps its whole output as a result to commit:
# benchmarks/results/NAME.txt starts with the command, the commit (and whether the tree
# had changes), the date and the machine, then everything the benchmark printed; the
# files it writes (plots, JSON) go to benchmarks/results/NAME/ through its --out flag.
# Progress bars redraw a line with carriage returns: the terminal sees them live, the
# result keeps each bar's last state only.
#   bash benchmarks/record.sh NAME benchmarks/bench_x.py [its arguments...]   (or a .sh script)
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
name="$1"
shift
out="benchmarks/results/$name"
mkdir -p "$out"
dirty=""
git diff --quiet HEAD -- sgl_pd benchmarks patches ':!benchmarks/results' || dirty=" (with uncommitted changes)"
{
    if [[ "$1" == *.sh ]]; then echo "# command: bash $* --out $out"; else echo "# command: .venv/bin/python $* --out $out"; fi
    echo "# commit: $(git rev-parse --short HEAD)$dirty"
    echo "# date: $(date -u +%Y-%m-%dT%H:%MZ)"
    echo "# machine: $(nproc) cores, $(awk '/MemTotal/ {printf "%.0f GiB", $2/1048576}' /proc/meminfo), $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
} >"benchmarks/results/$name.txt"
set -o pipefail
runner=(.venv/bin/python)
[[ "$1" == *.sh ]] && runner=(bash)
PYTHONUNBUFFERED=1 "${runner[@]}" "$@" --out "$out" 2>&1 | tee /dev/stderr \
    | python3 "$root/benchmarks/final_states.py" >>"benchmarks/results/$name.txt"
