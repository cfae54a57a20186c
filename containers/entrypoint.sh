#!/usr/bin/env bash
# Entry point of containers/Containerfile: `demo` (scripts/demo.sh: a 4-node job loses
# a node and finishes on the spare, bit-identical) or `test` (scripts/test.sh: the
# test suite); both start the local 6-node Slurm cluster (scripts/local-cluster)
# first. Anything else runs as a command (e.g. `bash`), after the cluster started.
set -euo pipefail
cd /opt/slurm_resilience
cmd="${1:-demo}"
[ $# -gt 0 ] && shift
case "$cmd" in
    demo) exec scripts/demo.sh "$@" ;;
    test) exec scripts/test.sh "$@" ;;
    *)    scripts/local-cluster start >/dev/null
          eval "$(scripts/local-cluster env)"
          exec "$cmd" "$@" ;;
esac
