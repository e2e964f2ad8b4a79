#!/usr/bin/env bash
# The main job on the embedded default: builds kvcap, generates a synthetic dataset for the
# SmolLM2-135M geometry (known low-rank K/V structure, RoPE offsets, queries) and validates and
# inspects it. Output goes to build/demo/.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

kvcap_prepare
kvcap_build "$KVCAP_ROOT/build" "release" -DCMAKE_BUILD_TYPE=Release
bin="$KVCAP_ROOT/build"
out="$KVCAP_ROOT/build/demo"
rm -rf "$out"

echo "== synthesise a dataset (embedded default config: SmolLM2-135M geometry)"
"$bin/kvcap-synth" --out "$out/data" --spans 16
echo "== inspect and validate it"
"$bin/kvcap-convert" --inspect "$out"/data/*.safetensors
