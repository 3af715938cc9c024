#!/usr/bin/env bash
# Installs the test tools on top of launch/install.sh's runtime (which it runs first):
# pytest, hypothesis, ruff, mypy, mkdocs and the schema checkers (sgl_pd's `test` extra),
# and the real components the tests use where a user would: kubectl renders the
# Kubernetes kustomizations (Debian's kubernetes-client unless a kubectl is there
# already: the two packages clash) and Debian's prometheus brings prometheus and promtool
# (without recommends: no exporters). Safe to run again.
set -euo pipefail

root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="$root/.venv"
say() { printf '[install-test-tools] %s\n' "$*"; }

"$root/launch/install.sh"

tools=()
command -v kubectl >/dev/null 2>&1 || tools+=(kubernetes-client)
dpkg -s prometheus >/dev/null 2>&1 || tools+=(prometheus)
if ((${#tools[@]})); then
    say "installing test tools: ${tools[*]}"
    sudo_cmd=()
    [[ $(id -u) -eq 0 ]] || sudo_cmd=(sudo)
    "${sudo_cmd[@]}" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive "${sudo_cmd[@]}" apt-get install -y -qq \
        --no-install-recommends "${tools[@]}" >/dev/null
fi

stamp="$venv/.sgl_pd-test-tools"
fingerprint="$(sha256sum "$root/pyproject.toml" | cut -c1-16)"
if [[ ! -f "$stamp" || "$(cat "$stamp")" != "$fingerprint" ]]; then
    log="${TMPDIR:-/tmp}/sgl_pd-install-test-tools.log"
    say "installing the test extra (pip's log: $log)"
    # the runtime (with its cpu or cuda extra) is installed: this adds the `test` extra
    if ! "$venv/bin/python" -m pip install --progress-bar off -e "$root[test]" >"$log" 2>&1; then
        say "pip failed; the last lines of $log:"
        tail -n 40 "$log" >&2
        exit 1
    fi
    echo "$fingerprint" >"$stamp"
else
    say "test tools up to date"
fi
say "ready"
