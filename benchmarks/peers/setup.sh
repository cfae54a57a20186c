#!/bin/bash
# Install the peers of benchmarks/peers.py, each into its own virtual environment, pinned.
#
#   benchmarks/peers/setup.sh [--prefix DIR]     (default ${XDG_CACHE_HOME:-~/.cache}/slurm_resilience/peers)
#
# Each venv is made with --system-site-packages, so it reuses the torch already installed
# (CPU); every package goes in with --no-deps, one by one, so pip never pulls a second
# torch. pip uses its own configured index. torchrun ships with torch; Lightning is the
# version installed for our own extra (pip show pytorch-lightning), in its own venv too.
# Prints the venvs' bin directories as PEERS_* lines for benchmarks/peers.py --prefix.
set -euo pipefail
prefix="${XDG_CACHE_HOME:-$HOME/.cache}/slurm_resilience/peers"
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "setup.sh: unknown argument $1 (try --help)" >&2; exit 2 ;;
  esac
done
python="${PYTHON:-python3}"
NVRX=0.7.0 TORCHFT=0.2.0
LIGHTNING=$("$python" -c 'import importlib.metadata as m; print(m.version("pytorch-lightning"))' 2>/dev/null || echo 2.6.6)
umask 077
mkdir -p "$prefix"
wheels=$(mktemp -d)
trap 'rm -rf "$wheels"' EXIT

venv() {  # venv NAME: a fresh venv on the system site-packages
  local dir="$prefix/$1"
  [ -x "$dir/bin/python" ] || "$python" -m venv --system-site-packages "$dir"
  "$dir/bin/python" -m pip install -q --upgrade --no-deps pip >/dev/null 2>&1 || true
}
add() {  # add NAME PKG...: pip install --no-deps, one package at a time
  local dir="$prefix/$1"; shift
  for p in "$@"; do "$dir/bin/python" -m pip install -q --no-deps "$p" 2> >(grep -v "is ignored: it is neither" >&2); done
}

# NVIDIA nvidia-resiliency-ext: its 0.7.0 wheels are tagged cp312 / manylinux_2_39 only. Its
# fault_tolerance and inprocess packages are pure Python (the one compiled module is a CUDA
# profiler, unused on CPU), so the cp312 wheel installs as a pure-Python one.
venv nvrx
"$prefix/nvrx/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_39_x86_64 -d "$wheels" "nvidia-resiliency-ext==$NVRX"
cp "$wheels"/nvidia_resiliency_ext-"$NVRX"-*.whl "$wheels/nvidia_resiliency_ext-$NVRX-py3-none-any.whl"
add nvrx "$wheels/nvidia_resiliency_ext-$NVRX-py3-none-any.whl" psutil defusedxml h11 anyio httpcore httpx \
  "protobuf>=6,<7" "grpcio>=1.7,<2"

# torchft (with the Rust lighthouse, torchft_lighthouse) and its OpenTelemetry dependencies.
venv torchft
OTEL=1.45.2 OTEL_B=0.66b2
add torchft "torchft==$TORCHFT" "opentelemetry-api==$OTEL" "opentelemetry-sdk==$OTEL" "opentelemetry-proto==$OTEL" \
  "opentelemetry-exporter-otlp-proto-common==$OTEL" "opentelemetry-exporter-otlp-proto-http==$OTEL" \
  "opentelemetry-semantic-conventions==$OTEL_B" "opentelemetry-exporter-otlp-common==$OTEL_B" \
  "opentelemetry-exporter-http-transport==$OTEL_B" googleapis-common-protos "protobuf>=6,<7"

# PyTorch Lightning, the same version as our extra's.
venv lightning
add lightning "pytorch-lightning==$LIGHTNING" tqdm torchmetrics lightning-utilities

"$prefix/nvrx/bin/python" -c 'import nvidia_resiliency_ext.fault_tolerance' 
"$prefix/torchft/bin/python" -c 'import torchft'
"$prefix/lightning/bin/python" -c 'import pytorch_lightning'
echo "PEERS_PREFIX=$prefix"
for n in nvrx torchft lightning; do
  echo "$n: $("$prefix/$n/bin/python" -m pip list 2>/dev/null | grep -i -E '^(nvidia-resiliency-ext|torchft|pytorch-lightning|torch) ' | tr -s ' ' | paste -sd, -)"
done
