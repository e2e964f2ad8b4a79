#!/usr/bin/env bash
# Creates (once) the Python environment the interop and Python-package tests use: a venv with
# the reference safetensors implementation, numpy and pytest, at ${KVCAP_VENV:-<repo>/.venv}.
# With --vision it also installs what scripts/vision_features.py needs (onnxruntime, pillow,
# onnx); with --hf what kvcap.hf and its tests need (torch, transformers, accelerate, gguf:
# several GB, torch's CUDA libraries included; pip keeps them in its cache for the next venv).
# Prints the venv's python path on stdout and nothing else. When the venv cannot be made
# (no python3-venv, no network), prints nothing on stdout, warns on stderr and exits 0, so
# the build goes on and the interop test reports itself as skipped.
set -u

NUMPY_PIN="numpy==2.4.6"
SAFETENSORS_PIN="safetensors==0.8.0"
PYTEST_PIN="pytest==9.2.0"
VISION_PINS=("onnxruntime==1.32.0" "pillow==13.0.0" "onnx==1.23.2")
HF_PINS=("torch==2.15.0" "transformers==5.24.0" "accelerate==1.15.0" "gguf==0.19.0")

pins=("$NUMPY_PIN" "$SAFETENSORS_PIN" "$PYTEST_PIN")
imports="import numpy, safetensors.numpy, pytest"
skipped="the interop and Python tests"
for arg in "$@"; do
  case "$arg" in
    --vision)
      pins+=("${VISION_PINS[@]}")
      imports="$imports, onnxruntime, PIL.Image, onnx"
      skipped="$skipped, the vision tests" ;;
    --hf)
      pins+=("${HF_PINS[@]}")
      imports="$imports, torch, transformers, accelerate, gguf"
      skipped="$skipped, the Hugging Face tests" ;;
    *)
      echo "setup-python: unknown option '$arg' (--vision, --hf)" >&2
      exit 2 ;;
  esac
done
pins_text="${pins[*]}"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVCAP_VENV:-$repo/.venv}"
py="$venv/bin/python"

warn() {
  echo "setup-python: $*; $skipped will be skipped" >&2
  exit 0
}

have_pins() {
  "$py" - "$imports" "${pins[@]}" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
for pin in sys.argv[2:]:
    name, want = pin.split("==")
    if version(name) != want:
        sys.exit(1)
exec(sys.argv[1])  # importable, not just installed
EOF
}

if [ -x "$py" ] && have_pins; then
  echo "$py"
  exit 0
fi

if [ ! -x "$py" ]; then
  command -v python3 >/dev/null 2>&1 || warn "python3 not found"
  python3 -m venv "$venv" >/dev/null 2>&1 ||
    warn "python3 -m venv $venv failed (is python3-venv installed?)"
fi

"$py" -m pip install --quiet --disable-pip-version-check --no-input --retries 2 --timeout 30 \
  "${pins[@]}" >/dev/null 2>&1 ||
  warn "pip install ${pins[*]} into $venv failed"

have_pins || warn "$venv has no working $pins_text after install"
echo "$py"
