#!/usr/bin/env bash
# The first run on a GPU machine: everything the CUDA path needs settled, in one folder,
# in under ten minutes, with no network and no ROS (a CUDA container image, a Jetson with
# JetPack's torch). docs/benchmarks.md ("On a GPU") says how to run it and what to read.
#
#   bash flashrt_ros/bench/gpu_probe.sh [--dry-run] [OUT_DIR]   # default build/gpu-probe
#
# Stages, each under its own timeout, each with a log in OUT_DIR:
#   env        torch/CUDA versions, capability vs torch.cuda.get_arch_list(), one real
#              kernel, fast-kernel packages, SDPA backends on the arena's strided KV views
#              (env.json); no usable GPU stops the probe here
#   cuda-tests the CUDA tests (pytest -m cuda test/runtime; cuda-tests.xml)
#   figures    fig1-fig4 and fig6 in bf16 (gpu.json, gpu.md, plots/ when matplotlib exists)
#   speculative  plain vs speculative rounds on the trained default, float32, graphs on
#              (speculative/speculative.md)
# The exit code is non-zero when any stage fails or a result file is missing; summary.txt
# lists each stage. --dry-run runs it on the CPU (float32, tiny sizes) in under two minutes:
# the GPU stages say they are skipped, the rest runs.
#
# Environment knobs:
#   PYTHON            the interpreter with a CUDA torch (default python3; on a Jetson the
#                     system python3 with JetPack's torch)
#   FLASHRT_WHEELS    a folder of wheels installed first with --no-deps into a private
#                     folder (default .whl when it exists), e.g. fetched on a machine with
#                     network:  pip download --no-deps -d .whl transformers==5.24.0
#   FLASHRT_PROBE_BUDGET_S  seconds for the whole probe (default 570)
#   FLASHRT_GPU_ARGS  extra options for python -m flashrt_ros.bench
set -uo pipefail

dry=0
if [ "${1:-}" = --dry-run ]; then dry=1; shift; fi
root=$(cd "$(dirname "$0")/../.." && pwd)
out=$(mkdir -p "${1:-$root/build/gpu-probe}" && cd "${1:-$root/build/gpu-probe}" && pwd)
py=${PYTHON:-python3}
budget=${FLASHRT_PROBE_BUDGET_S:-570}
log() { printf '[gpu_probe %4ds] %s\n' "$SECONDS" "$*" | tee -a "$out/summary.txt"; }
failed=()
: > "$out/summary.txt"
cd "$root"

if [ "$dry" = 1 ]; then
  device=cpu dtype=float32 name=dry-run
  figure_args=(--smoke --model builtin:tiny-hybrid --lengths 128 --repeats 1 --budget-s 10)
else
  device=cuda dtype=bfloat16 name=gpu
  figure_args=(--repeats 5 --budget-s 30)
fi

wheels=${FLASHRT_WHEELS:-.whl}
export PYTHONPATH=$root PYTHONUNBUFFERED=1
if [ -d "$wheels" ] && ls "$wheels"/*.whl >/dev/null 2>&1; then
  log "installing $(ls "$wheels"/*.whl | wc -l) wheel(s) from $wheels into $out/site"
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$out/site" "$wheels"/*.whl || { log "wheel install FAILED"; exit 1; }
  export PYTHONPATH=$out/site:$root
fi

stage() {  # stage NAME SECONDS COMMAND...: run under a timeout, log to NAME.log, keep the status
  local name=$1 limit=$2 rc
  shift 2
  log "$name: start (limit ${limit} s)"
  timeout --signal=INT --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1
  rc=$?
  tail -n 8 "$out/$name.log"
  if [ "$rc" = 0 ]; then
    log "$name: ok"
  else
    [ "$rc" = 124 ] && log "$name: TIMED OUT after ${limit} s"
    log "$name: FAILED (exit $rc; see $name.log)"
    failed+=("$name")
  fi
  return "$rc"
}

skip() { log "$1: skipped ($2)"; }

# 1. The environment. Without a device that runs a kernel nothing else can be measured.
{ date -Is; uname -a; cat /etc/nv_tegra_release 2>/dev/null; nvidia-smi 2>&1; } \
  > "$out/machine.txt"
if ! stage env 120 "$py" -m flashrt_ros.bench.gpu_env --device "$device" --out "$out/env.json"; then
  log "no usable device: stopping (env.json and env.log say why)"
  exit 1
fi

# 2. The CUDA tests (the rest of the runtime suite is the CPU's).
if [ "$dry" = 1 ]; then
  skip cuda-tests "--dry-run: they need a GPU"
else
  stage cuda-tests 240 "$py" -m pytest test/runtime -m cuda -q -p no:randomly \
    --junitxml "$out/cuda-tests.xml"
fi

# 3. The figures without ROS, in what is left of the budget (at most 300 s).
left=$(( budget - SECONDS - 115 ))  # 100 s stay for the speculative stage
[ "$left" -gt 300 ] && left=300
if [ "$left" -gt 30 ]; then
  # shellcheck disable=SC2086  # FLASHRT_GPU_ARGS is a list of options
  stage figures "$left" "$py" -m flashrt_ros.bench --device "$device" --dtype "$dtype" \
    --only fig1,fig2,fig3,fig4,fig6 "${figure_args[@]}" --name "$name" --out "$out" \
    --plots "$out/plots" ${FLASHRT_GPU_ARGS:-}
else
  log "figures: FAILED (no time left: ${left} s)"
  failed+=(figures)
fi

# 4. Speculative rounds on the trained default, float32 (every row must decode plain
# decoding's tokens): the rounds' CUDA graphs beside the decode step's.
left=$(( budget - SECONDS - 10 ))
[ "$left" -gt 120 ] && left=120
if [ "$dry" = 1 ]; then
  skip speculative "--dry-run: the CPU figure is make bench's"
elif [ "$left" -gt 30 ]; then
  stage speculative "$left" "$py" -m flashrt_ros.bench.speculative --model default \
    --device cuda --dtype float32 --tokens 96 --repeats 3 --out "$out/speculative"
else
  log "speculative: FAILED (no time left: ${left} s)"
  failed+=(speculative)
fi

# 5. Every result file is there (a stage can exit 0 and still write nothing).
expected=(env.json "$name.json" "$name.md")
[ "$dry" = 1 ] || expected+=(speculative/speculative.json)
[ "$dry" = 1 ] || expected+=(cuda-tests.xml)
if "$py" -c 'import matplotlib' 2>/dev/null; then
  for fig in fig1 fig2 fig3 fig4 fig6; do expected+=("plots/$name-$fig.png"); done
else
  log "matplotlib is not installed: no plots (elsewhere: python -m flashrt_ros.bench.plots $name.json)"
fi
for f in "${expected[@]}"; do
  [ -s "$out/$f" ] || { log "missing result file: $f"; failed+=("file:$f"); }
done

if [ "${#failed[@]}" -gt 0 ]; then
  log "FAILED: ${failed[*]} (results in $out)"
  exit 1
fi
log "all stages ok in ${SECONDS} s: $out"
