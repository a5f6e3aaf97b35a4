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
#   TORCH_CUDA_INDEX    where to get a CUDA torch if the venv's cannot run on this GPU
#                       (default: cu130 for Thor or a CUDA 13 driver, else cu128; a Jetson
#                       before Thor is told to use JetPack's torch)
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

# 2. A torch with kernels for this GPU. torch.cuda.is_available() is not enough: a wheel
#    built without this device's capability reports available and fails at the first kernel,
#    so gpu_env checks the capability against torch.cuda.get_arch_list() and runs one.
usable() { PYTHONPATH="$root" "$vpy" -m flashrt_ros.bench.gpu_env --device cuda --no-sdpa \
  --out "$results/gpu-env.json" > "$results/gpu-env.log" 2>&1; }
cap=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' ' || true)
driver_cuda=$(nvidia-smi 2>/dev/null | sed -n 's/.*CUDA Version: *\([0-9]*\).*/\1/p' | head -n1 || true)
if [ -f /etc/nv_tegra_release ] && [ "$cap" != 11.0 ]; then
  # Jetson before Thor (Orin: sm_87): the package index's aarch64 wheels are for server GPUs.
  wheel_index=""
elif [ "$cap" = 11.0 ] || [ "${driver_cuda:-0}" -ge 13 ]; then
  wheel_index=https://download.pytorch.org/whl/cu130  # Thor (sm_110) needs CUDA 13
else
  wheel_index=https://download.pytorch.org/whl/cu128
fi
wheel_index=${TORCH_CUDA_INDEX:-$wheel_index}
if ! usable; then
  if [ -z "$wheel_index" ]; then
    cat "$results/gpu-env.log" >&2
    echo "this Jetson needs JetPack's torch (a pip wheel has no kernels for sm_${cap/./}):" \
      "install it as NVIDIA's JetPack docs say, then run the probe with the system Python:" \
      "PYTHON=/usr/bin/python3 bash flashrt_ros/bench/gpu_probe.sh" >&2
    exit 1
  fi
  log "the venv's torch cannot run kernels on this GPU (capability ${cap:-?}, driver CUDA" \
    "${driver_cuda:-?}); installing torch==2.13.0 from $wheel_index"
  "$vpy" -m pip uninstall -y --quiet torch
  PIP_FIND_LINKS= "$vpy" -m pip install --quiet --disable-pip-version-check "torch==2.13.0" \
    --index-url "$wheel_index"
  usable || { cat "$results/gpu-env.log" >&2; echo "torch still cannot run on this GPU" >&2; exit 1; }
fi
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
