#!/usr/bin/env bash
# Installs everything (launch/install.sh), then runs the main job on the bundled model.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$root/launch/install.sh"
cd "$root"
exec "$root/.venv/bin/python" -m sgl_pd.demo "$@"
