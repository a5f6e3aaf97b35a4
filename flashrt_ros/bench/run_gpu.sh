#!/usr/bin/env bash
# Set up and run the benchmark suite on an NVIDIA GPU, all inside 10 minutes.
#
#   bash flashrt_ros/bench/run_gpu.sh   # from anywhere; needs nvidia-smi and network for set-up
#
# Writes build/bench-results/gpu.json, gpu.md and gpu-fig1..6.png, plus gpu-env.txt
# (nvidia-smi and torch facts). Environment knobs:
#   FLASHRT_GPU_DTYPE   model dtype (default bfloat16)
#   FLASHRT_GPU_ARGS    extra options for python -m flashrt_ros.bench (e.g. "--only fig1,fig2")
#   FLASHRT_FLA=1       also install flash-linear-attention (Triton kernels for the linear-
#                       attention layers; without them transformers runs its slow reference
#                       torch code, which makes cold prefill slower and the TTFT speedup larger)
#   TORCH_CUDA_INDEX    where to get a CUDA torch if the venv's is CPU-only
#                       (default https://download.pytorch.org/whl/cu128)
#   FLASHRT_GPU_BUDGET_S  seconds for the whole script (default 570: under 10 minutes)
set -euo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
budget=${FLASHRT_GPU_BUDGET_S:-570}
results="$root/build/bench-results"
mkdir -p "$results"
log() { printf '[run_gpu %4ds] %s\n' "$SECONDS" "$*"; }

command -v nvidia-smi >/dev/null || { echo "nvidia-smi not found: this script needs an NVIDIA GPU" >&2; exit 1; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit \
  --format=csv || true  # some boards (Jetson) answer only part of the query

# 1. The venv, the ROS core and this package (idempotent; the first run takes a few minutes).
log "set-up (make setup)"
make setup
vpy="$root/.venv/bin/python"

# 2. A CUDA build of torch. The pin torch==2.13.0 resolves to the CUDA build from the package
#    index on Linux x86_64, but to the CPU build where a local +cpu wheel is offered.
if ! "$vpy" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
  log "the venv's torch has no CUDA; installing torch==2.13.0 from ${TORCH_CUDA_INDEX:-https://download.pytorch.org/whl/cu128}"
  "$vpy" -m pip uninstall -y --quiet torch
  PIP_FIND_LINKS= "$vpy" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" \
    --index-url "${TORCH_CUDA_INDEX:-https://download.pytorch.org/whl/cu128}"
fi
"$vpy" -c 'import torch; assert torch.cuda.is_available(), "torch still sees no GPU"'
if [ "${FLASHRT_FLA:-0}" = 1 ]; then
  log "installing flash-linear-attention (best effort)"
  "$vpy" -m pip install --quiet --disable-pip-version-check flash-linear-attention ||
    log "flash-linear-attention did not install; continuing with the reference kernels"
fi

# 3. Record the environment next to the results.
{
  date -Is
  nvidia-smi
  nvidia-smi -q -d CLOCK,PERFORMANCE,POWER
  "$vpy" -c 'import torch, transformers; print("torch", torch.__version__, "cuda",
    torch.version.cuda, torch.cuda.get_device_name(0), "transformers", transformers.__version__)'
} > "$results/gpu-env.txt" 2>&1 || true

# 4. The suite, from build/bench-results so the installed package (with its generated ROS
#    interfaces) is imported. 16k tokens is in; any length whose cold prefills would not fit
#    --budget-s is skipped and the JSON says why.
left=$(( budget - SECONDS ))
[ "$left" -gt 60 ] || { echo "set-up used the time budget ($SECONDS s); run this script again" >&2; exit 1; }
log "running the GPU suite (time left: ${left} s)"
. ./env.sh
cd "$results"
# shellcheck disable=SC2086  # FLASHRT_GPU_ARGS is a list of options
timeout --signal=INT --kill-after=20 "$left" python -m flashrt_ros.bench \
  --device cuda --dtype "${FLASHRT_GPU_DTYPE:-bfloat16}" --name gpu --out . \
  --repeats 10 --budget-s 45 ${FLASHRT_GPU_ARGS:-}
log "done: $results/gpu.json, gpu.md, gpu-fig*.png"
