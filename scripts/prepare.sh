#!/usr/bin/env bash
# Sourced by demo.sh and test.sh: from a fresh machine, install what is missing,
# start the local Slurm cluster (one, shared), export its SLURM_CONF, reset it.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
scripts/install-deps.sh
scripts/local-cluster start
eval "$(scripts/local-cluster env)"
scripts/local-cluster reset
