#!/usr/bin/env bash
# Build LeRobot for the ACT parity benchmark into build/lerobot-venv. Separate from .venv on
# purpose; never part of `make test`. Idempotent: skipped when the stamp matches the pins.
#
# What is installed and why:
# - lerobot 0.4.4 is the last release that installs on Python 3.11 (later ones need 3.12). It
#   asks for torch<2.11, which pip would fetch from PyPI as a CUDA build (about 8 GB). Instead
#   torch 2.14.1 + torchvision 0.29.1, which pip takes from the machine's local wheel store
#   where it has one (pip's find-links; about 5.5 GB in the venv, a minute; still a CUDA
#   build, run on the CPU here). The whole venv: about 6 GB, under 2 minutes.
#   torch 2.13.0+cpu (what .venv runs) cannot be used: PyPI's torchvision does not import
#   beside it ("operator torchvision::nms does not exist"), and ACT needs torchvision's resnet.
#   The torch versions differ between the two sides; the benchmark records both.
# - lerobot itself with --no-deps (its torch/torchvision pins would replace the above), plus
#   only what `lerobot.policies.act.modeling_act` and `lerobot.policies.factory` (the
#   processor factory and the policy configs it imports) need at import time, within
#   lerobot's own version bounds: no wandb, rerun, opencv, pynput, torchcodec, cmake.
#   datasets (with pyarrow, pandas), diffusers and gymnasium are imported by the factory's
#   module chain (dataset metadata, the GR00T config, env features), not used by ACT.
# - SmolVLA's extra (lerobot[smolvla]): transformers within lerobot's bounds (>=4.57.1,<5;
#   its tokenizers pin) and num2words (SmolVLM's processor refuses to load without it).
# Set LEROBOT_TORCH to override the torch/torchvision pair, e.g. on aarch64
# "torch==2.9.1 torchvision==0.24.1".
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=build/lerobot-venv
lerobot_version=0.4.4
torch_pair=${LEROBOT_TORCH:-torch==2.14.1 torchvision==0.29.1}
deps=(
  draccus==0.10.0 huggingface-hub==0.35.3 safetensors==0.8.0 einops==0.8.2 packaging==25.0
  datasets==4.8.5 accelerate==1.16.0 diffusers==0.35.2 imageio==2.38.2 av==15.1.0
  deepdiff==8.6.2 pyserial==3.5 gymnasium==1.4.0 numpy==2.4.6
  transformers==4.57.6 tokenizers==0.22.2 num2words==0.5.14
)
stamp="lerobot==$lerobot_version $torch_pair ${deps[*]}"
log() { printf '[lerobot] %s\n' "$*"; }

if [ "$(cat "$venv/.flashrt-lerobot" 2>/dev/null)" = "$stamp" ]; then
  log "build/lerobot-venv is up to date (lerobot==$lerobot_version, $torch_pair)"
  exit 0
fi
python=${PYTHON:-python3}
log "creating $venv with $("$python" --version)"
rm -rf "$venv"
"$python" -m venv "$venv"
# (this machine's pip configuration names index folders that may not exist: drop those lines)
pip() {
  "$venv/bin/python" -m pip --disable-pip-version-check "$@" \
    2> >(grep -v '^WARNING: Location .* is ignored' >&2)
}
log "installing $torch_pair and what LeRobot's ACT imports (minutes, about 6 GB)"
# shellcheck disable=SC2086
pip install --quiet $torch_pair "${deps[@]}"
pip install --quiet --no-deps "lerobot==$lerobot_version"
"$venv/bin/python" -c '
import torch, lerobot.policies.act.modeling_act, lerobot.policies.factory
import lerobot.policies.smolvla.modeling_smolvla
from importlib.metadata import version
print("lerobot", version("lerobot"), "torch", torch.__version__)'
echo "$stamp" > "$venv/.flashrt-lerobot"
log "done ($(du -sh "$venv" | cut -f1))"
