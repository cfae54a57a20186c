#!/usr/bin/env bash
# The demo, from a fresh machine: install what is missing, start the local Slurm
# cluster, run a job that loses a node and finishes on a spare, bit-identical.
# Usage: scripts/demo.sh [--out DIR]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
scripts/install-deps.sh
scripts/local-cluster start
eval "$(scripts/local-cluster env)"
scripts/local-cluster reset
exec python3 scripts/demo.py "$@"
