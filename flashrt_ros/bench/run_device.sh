#!/usr/bin/env bash
# The CUDA checks on a GPU machine that already has torch and transformers and may have no
# network or ROS (a CUDA container image, a Jetson with JetPack's torch): the runtime tests,
# CUDA-graph and GPU-tier tests included, then the benchmark figures that need no ROS
# (fig1-4, fig6), all inside a time budget.
#
#   bash flashrt_ros/bench/run_device.sh [OUT_DIR]   # default OUT_DIR: build/bench-results
#
# Environment knobs:
#   PYTHON                 the interpreter that has a CUDA torch (default python3)
#   FLASHRT_WHEELS         a folder of wheels to install first with --no-deps (default .whl
#                          when it exists), e.g. a newer transformers fetched on a machine
#                          with network:  pip download --no-deps -d .whl transformers==5.24.0
#   FLASHRT_DEVICE_BUDGET_S  seconds for the whole script (default 480)
#   FLASHRT_GPU_ARGS       extra options for python -m flashrt_ros.bench
#   FLASHRT_DEVICE         cuda (default); cpu makes a dry run of this script without a GPU
#   FLASHRT_PLOTS          where the PNGs go (default /tmp/flashrt-plots, so that OUT_DIR
#                          holds four files); redraw them elsewhere from gpu.json:
#                          python -c "import json; from flashrt_ros.bench.plots import
#                          plot_all; plot_all(json.load(open('gpu.json')), 'docs/img', 'gpu')"
set -uo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mkdir -p "${1:-$root/build/bench-results}" && cd "${1:-$root/build/bench-results}" && pwd)
py=${PYTHON:-python3}
device=${FLASHRT_DEVICE:-cuda}
dtype=$([ "$device" = cpu ] && echo float32 || echo bfloat16)
budget=${FLASHRT_DEVICE_BUDGET_S:-480}
log() { printf '[run_device %4ds] %s\n' "$SECONDS" "$*"; }
cd "$root"

wheels=${FLASHRT_WHEELS:-.whl}
if [ -d "$wheels" ] && ls "$wheels"/*.whl >/dev/null 2>&1; then
  log "installing $(ls "$wheels"/*.whl | wc -l) wheel(s) from $wheels into /tmp/flashrt-site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/flashrt-site "$wheels"/*.whl || { echo "wheel install failed" >&2; exit 1; }
  export PYTHONPATH=/tmp/flashrt-site:$root
else
  export PYTHONPATH=$root
fi
export PYTHONUNBUFFERED=1

{
  date -Is
  nvidia-smi || true
  "$py" -c 'import torch, transformers; print("torch", torch.__version__, "cuda",
    torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "-",
    "transformers", transformers.__version__)'
} > "$out/device-env.txt" 2>&1
cat "$out/device-env.txt"
if [ "$device" != cpu ]; then
  "$py" -c 'import torch; assert torch.cuda.is_available(), "torch sees no GPU"' || exit 1
fi

# 1. The runtime tests: the CUDA ones run here instead of skipping.
log "runtime tests (test/runtime)"
timeout --signal=INT 240 "$py" -m pytest test/runtime -q -p no:randomly 2>&1 |
  tee "$out/device-tests.txt" | tail -15
tests=${PIPESTATUS[0]}

# 2. The figures without ROS, in what is left of the budget.
left=$(( budget - SECONDS ))
if [ "$left" -gt 60 ]; then
  log "benchmark figures 1-4 and 6 (time left: ${left} s)"
  # shellcheck disable=SC2086  # FLASHRT_GPU_ARGS is a list of options
  timeout --signal=INT --kill-after=20 "$left" "$py" -m flashrt_ros.bench --device "$device" \
    --dtype "$dtype" --only fig1,fig2,fig3,fig4,fig6 --repeats 5 --budget-s 30 \
    --name gpu --out "$out" --plots "${FLASHRT_PLOTS:-/tmp/flashrt-plots}" \
    ${FLASHRT_GPU_ARGS:-} 2>&1 | tail -25
else
  log "no time left for the figures"
fi
log "done (tests exit code $tests): $out/device-tests.txt, gpu.json, gpu.md"
exit "$tests"
