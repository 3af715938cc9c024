#!/usr/bin/env bash
# Installs what is missing (the runtime and the test tools: launch/install_test_tools.sh),
# then runs the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/launch/install_test_tools.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
