#!/usr/bin/env bash
# The whole test suite, from a fresh machine: install what is missing, start the
# local Slurm cluster (shared by every Slurm test), run pytest.
# Usage: scripts/test.sh [pytest args...]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
scripts/install-deps.sh
scripts/local-cluster start
eval "$(scripts/local-cluster env)"
scripts/local-cluster reset
exec python3 -m pytest -q -p no:cacheprovider --durations=15 "$@"
