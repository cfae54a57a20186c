#!/usr/bin/env bash
# Build the single-node Slurm container (containers/Containerfile) with podman and run
# the demo in it, on a machine with no image registry: the Debian 12 base image is
# made here with debootstrap and `podman import`. Writes the demo's output and the
# timings to OUT (default /tmp/sr-try). Run as root; CPU-heavy (a few minutes).
# Usage: containers/try.sh [OUT]      (docs/containers.md has the measured result)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${1:-/tmp/sr-try}"
BASE=localhost/debian:bookworm
IMAGE=localhost/slurm-resilience:latest
mkdir -p "$OUT"
t0=$(date +%s)
if ! podman image exists "$BASE"; then
    # The base image by its short name, resolved by podman's own registries.conf; where
    # no registry answers, a minimal Debian from the package mirror apt already uses.
    if podman pull -q debian:bookworm >/dev/null 2>&1; then
        podman tag debian:bookworm "$BASE"
    else
        mirror="$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/*.sources 2>/dev/null | head -1)"
        [ -n "$mirror" ] || mirror="$(sed -n 's/^deb \(\[[^]]*\] \)\?\([^ ]*\) .*/\2/p' /etc/apt/sources.list 2>/dev/null | head -1)"
        if [ -z "$mirror" ]; then
            echo "try.sh: no image registry and no Debian mirror in apt's sources: podman pull a Debian 12 image as $BASE" >&2
            exit 2
        fi
        rootfs="$(mktemp -d)"
        debootstrap --variant=minbase bookworm "$rootfs" "$mirror" >"$OUT/debootstrap.log"
        tar -C "$rootfs" -c . | podman import -q - "$BASE" >/dev/null
        rm -rf "$rootfs"
    fi
fi
t1=$(date +%s)
# This host's own pip settings (`pip config list`: its files and PIP_* variables;
# index, extra indexes, find-links) are passed to the build; local directories they
# name are mounted read-only at the same path.
pip_opts=() volumes=()
declare -A seen=()
add_source() {  # $1: pip option, $2: its value (a URL or a path)
    [ -z "${seen[$1 $2]:-}" ] || return 0
    seen[$1 $2]=1
    pip_opts+=("$1" "$2")
    local dir="$2"
    case "$dir" in file:*) dir="${dir#file:}"; dir="/${dir#"${dir%%[!/]*}"}" ;; esac
    dir="${dir%/simple}"
    case "$dir" in /*) if [ -e "$dir" ] && [ -z "${seen[mount $dir]:-}" ]; then
        seen[mount $dir]=1; volumes+=(-v "$dir:$dir:ro"); fi ;; esac
}
while IFS= read -r line; do
    key="${line%%=*}" value="${line#*=}"
    value="${value#\'}" value="${value%\'}"
    name="${key#*.}"
    case "$name" in  # the package sources among pip's settings, passed as the same options
        index-url|extra-index-url|find-links) for v in $value; do add_source "--$name" "$v"; done ;;
    esac
done < <(python3 -m pip config list 2>/dev/null)
# A site proxy's CA (pip on this host trusts it through the system bundle; Debian's
# bundle in the image does not have it).
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    volumes+=(-v /etc/ssl/certs/ca-certificates.crt:/opt/host-ca.crt:ro)
    pip_opts+=(--cert /opt/host-ca.crt)
fi
# torch's CPU wheel index, if pip's own sources lack the CPU build: TORCH_INDEX=URL.
torch_index="${TORCH_INDEX:-}"
podman build --network host "${volumes[@]}" --build-arg BASE="$BASE" --build-arg TORCH_INDEX="$torch_index" \
    --build-arg PIP_OPTS="${pip_opts[*]}" -f "$REPO/containers/Containerfile" -t "$IMAGE" "$REPO" >"$OUT/build.log" 2>&1
t2=$(date +%s)
echo "base ${BASE}: $((t1 - t0)) s, build: $((t2 - t1)) s; running the demo" >&2
# --privileged: slurmd's task/proctrack cgroup plugins create cgroups under
# /sys/fs/cgroup (read-only in an unprivileged container), and the demo's kill-node
# freezes and kills a node's cgroup. --cgroupns=private: the container's Slurm
# cgroups (slurm_n1 ...) are made under its own cgroup, never beside a host's
# (cgroup v1 shares the host's tree otherwise). --network none: the cluster lives on the
# container's loopback (no port clash with the host), and nothing is downloaded.
set +e
podman run --rm --privileged --cgroupns=private --network none "$IMAGE" demo --out /tmp/demo >"$OUT/demo.log" 2>&1
rc=$?
set -e
t3=$(date +%s)
printf '{"base_s": %d, "build_s": %d, "demo_s": %d, "demo_exit": %d, "image_mb": %s}\n' \
    $((t1 - t0)) $((t2 - t1)) $((t3 - t2)) "$rc" \
    "$(podman image inspect "$IMAGE" --format '{{.Size}}' | awk '{printf "%d", $1/1e6}')" | tee "$OUT/try.json"
tail -20 "$OUT/demo.log"
exit "$rc"
