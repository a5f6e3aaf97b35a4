#!/usr/bin/env bash
# `make demo`: start the flashrt node on the embedded model, run a scripted client session
# over ROS 2 and print a short report (flashrt_ros/demo.py). Stops everything it started.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
. ./env.sh
# A private DDS domain and localhost-only discovery: the demo talks only to its own node.
export ROS_DOMAIN_ID=${ROS_DOMAIN_ID:-$(( ($$ % 100) + 1 ))}
export ROS_AUTOMATIC_DISCOVERY_RANGE=LOCALHOST
export PYTHONDONTWRITEBYTECODE=1
# Files a demo writes (the policy demo's plot) go to build/.
export FLASHRT_DEMO_OUT=${FLASHRT_DEMO_OUT:-$root/build}
# Run from outside the source tree so `flashrt_ros` (with its generated msg/srv/action
# modules) is imported from install/, not from the source folder.
cd "${TMPDIR:-/tmp}"
# DEMO_MODULE=flashrt_ros.demo_policy (`make demo-policy`): the robot-policy session;
# flashrt_ros.demo_speech (`make demo-speech`): the speech session.
exec python -m "${DEMO_MODULE:-flashrt_ros.demo}" "$@"
