#!/usr/bin/env bash
# The CUDA checks on a GPU machine without network or ROS: this is gpu_probe.sh (the
# environment, the CUDA tests, fig1-4 and fig6 in bf16, one output folder, non-zero exit
# when a stage fails or a result file is missing). Kept so older instructions still work.
#
#   bash flashrt_ros/bench/run_device.sh [OUT_DIR]   # FLASHRT_DEVICE=cpu: the --dry-run
here=$(cd "$(dirname "$0")" && pwd)
if [ "${FLASHRT_DEVICE:-cuda}" = cpu ]; then
  exec bash "$here/gpu_probe.sh" --dry-run "$@"
fi
exec bash "$here/gpu_probe.sh" "$@"
