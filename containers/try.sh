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
    if podman pull -q docker.io/library/debian:bookworm >/dev/null 2>&1; then
        podman tag docker.io/library/debian:bookworm "$BASE"
    else  # no registry: a minimal Debian from the package mirror apt already uses
        mirror="$(sed -n 's/^URIs: *//p' /etc/apt/sources.list.d/debian.sources 2>/dev/null | head -1)"
        rootfs="$(mktemp -d)"
        debootstrap --variant=minbase bookworm "$rootfs" "${mirror:-http://deb.debian.org/debian}" >"$OUT/debootstrap.log"
        tar -C "$rootfs" -c . | podman import -q - "$BASE" >/dev/null
        rm -rf "$rootfs"
    fi
fi
t1=$(date +%s)
# The build host's pip settings (a local wheel directory / index), mounted read-only.
pip_opts=() volumes=()
for d in /opt/wheels /opt/pypi /opt/pypi-more; do
    [ -d "$d" ] || continue
    volumes+=(-v "$d:$d:ro")
    if [ "$d" = /opt/wheels ]; then pip_opts+=(--find-links "$d"); else pip_opts+=(--extra-index-url "file://$d/simple"); fi
done
# A site proxy's CA (pip on this host trusts it through the system bundle; Debian's
# bundle in the image does not have it).
if [ -f /etc/ssl/certs/ca-certificates.crt ]; then
    volumes+=(-v /etc/ssl/certs/ca-certificates.crt:/opt/host-ca.crt:ro)
    pip_opts+=(--cert /opt/host-ca.crt)
fi
torch_index=https://download.pytorch.org/whl/cpu
ls /opt/wheels/torch-*+cpu-* >/dev/null 2>&1 && torch_index=""  # the CPU wheel is on disk
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
