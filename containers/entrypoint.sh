#!/usr/bin/env bash
# Entry point of containers/Containerfile: `demo` (scripts/demo.sh: a 4-node job loses
# a node and finishes on the spare, bit-identical) or `test` (scripts/test.sh: the
# test suite); both start the local 6-node Slurm cluster (scripts/local-cluster)
# first. Anything else runs as a command (e.g. `bash`), after the cluster started.
set -euo pipefail
cd /opt/slurm_resilience
# Slurm resolves even "127.0.0.1" with getaddrinfo(AI_ADDRCONFIG), which finds nothing
# while the only IPv4 address is the loopback's (`--network none`): slurmctld then
# never answers. A veth pair with a private address inside the container's own
# network namespace is enough (needs --privileged; measured in docs/containers.md).
if ! ip -4 -o addr show scope global | grep -q inet; then
    ip link add sr0 type veth peer name sr1
    ip addr add 10.254.254.1/30 dev sr0
    ip link set sr0 up
    ip link set sr1 up
fi
cmd="${1:-demo}"
[ $# -gt 0 ] && shift
case "$cmd" in
    demo) exec scripts/demo.sh "$@" ;;
    test) exec scripts/test.sh "$@" ;;
    *)    scripts/local-cluster start >/dev/null
          eval "$(scripts/local-cluster env)"
          exec "$cmd" "$@" ;;
esac
