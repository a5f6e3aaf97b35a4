#!/usr/bin/env bash
# Run the test suite against the installed package (the generated msg/srv/action
# modules exist only there), isolated from any other ROS 2 traffic on this machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
. ./env.sh
# A private DDS domain per run (1..100) and localhost-only discovery keep parallel
# runs on one machine apart.
export ROS_DOMAIN_ID=${ROS_DOMAIN_ID:-$(( ($$ % 100) + 1 ))}
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
export PYTHONDONTWRITEBYTECODE=1
# The suite holds many participants in one process (nodes in-process, clients): see the file.
export FASTDDS_DEFAULT_PROFILES_FILE=${FASTDDS_DEFAULT_PROFILES_FILE:-$root/config/fastdds_no_intraprocess.xml}
echo "[test] ROS_DOMAIN_ID=$ROS_DOMAIN_ID"
# The pytest script (not `python -m pytest`) so the source folder is not put first on sys.path.
exec "$root/.venv/bin/pytest" "$@"
