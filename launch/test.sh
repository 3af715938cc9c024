#!/usr/bin/env bash
# Installs what is missing (launch/install.sh), then runs the whole test suite.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/launch/install.sh"
cd "$root"
exec "$root/.venv/bin/python" -m pytest "$@"
