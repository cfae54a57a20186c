#!/usr/bin/env bash
# The podman image of the container tests: an almost empty root filesystem (the
# directories and Debian's merged-/usr links) that the tests' containers fill by
# bind-mounting the host's /usr, the interpreter's prefix and the repository
# (tests/e2e/test_containers_slurm.py: container.mounts). Built with `podman import`
# of a tar made here: no registry, no network, ~1 s. Idempotent: an existing image is
# kept (one build per machine, shared by every test of a run).
# Usage: containers/test-image.sh [IMAGE]     (default localhost/sr-hostbind:1)
set -euo pipefail
IMAGE="${1:-localhost/sr-hostbind:1}"
if podman image exists "$IMAGE"; then
    echo "$IMAGE"
    exit 0
fi
ROOTFS="$(mktemp -d)"
trap 'rm -rf "$ROOTFS"' EXIT
mkdir -p "$ROOTFS"/{usr,etc,tmp,proc,sys,dev,run,var/tmp,root,home,work}
chmod 1777 "$ROOTFS/tmp" "$ROOTFS/var/tmp"
for d in bin sbin lib lib64; do ln -s "usr/$d" "$ROOTFS/$d"; done
tar -C "$ROOTFS" -c . | podman import -q - "$IMAGE" >/dev/null
echo "$IMAGE"
