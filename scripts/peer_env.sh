#!/usr/bin/env bash
# Build the llama.cpp peer for the benchmark into build/peer-venv: llama-cpp-python compiled
# from source (minutes on a small CPU), the gguf writer and what llama.cpp's HF->GGUF
# converter imports. Separate from .venv on purpose; never part of `make test`.
# Idempotent: skipped when the stamp matches the pinned versions.
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
venv=build/peer-venv
llama_version=0.3.36
stamp="llama-cpp-python==$llama_version"
log() { printf '[peer] %s\n' "$*"; }

if [ "$(cat "$venv/.flashrt-peer" 2>/dev/null)" = "$stamp" ]; then
  log "build/peer-venv is up to date ($stamp)"
  exit 0
fi
python=${PYTHON:-python3}
log "creating $venv with $("$python" --version)"
rm -rf "$venv"
"$python" -m venv "$venv"
pip() { "$venv/bin/python" -m pip --disable-pip-version-check "$@"; }
# The converter imports torch, transformers, numpy and safetensors; the same pins as .venv keep the
# tensors it reads identical to the runtime's.
pins=$(grep -E '^(torch|transformers|numpy|safetensors|pyyaml)==' requirements/venv.txt)
log "installing converter dependencies: $(echo $pins)"
# shellcheck disable=SC2086
pip install --quiet $pins gguf sentencepiece
# Keep the sdist: the converter (convert_hf_to_gguf.py) ships inside it under vendor/llama.cpp.
mkdir -p "$venv/src"
pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$llama_version" -d "$venv/src"
tar -xzf "$venv/src/llama_cpp_python-$llama_version.tar.gz" -C "$venv/src"
log "compiling llama.cpp (llama-cpp-python $llama_version) from source; this takes minutes"
CMAKE_ARGS=${CMAKE_ARGS:--DGGML_NATIVE=ON} CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
  pip install --quiet "$venv/src/llama_cpp_python-$llama_version"
"$venv/bin/python" -c 'import llama_cpp, gguf; print("llama_cpp", llama_cpp.__version__)'
echo "$stamp" > "$venv/.flashrt-peer"
log "done"
