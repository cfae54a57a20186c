#!/usr/bin/env bash
# The demo, from a fresh machine: install what is missing, start the local Slurm
# cluster, run a job that loses a node and finishes on a spare, bit-identical.
# Usage: scripts/demo.sh [--out DIR] [--tasks-per-node G] [--fault kill-node|freeze-node]
#        (G ranks per node: 4 x G ranks; freeze-node: the silent node loss)
source "$(dirname "${BASH_SOURCE[0]}")/prepare.sh"
exec python3 scripts/demo.py "$@"
