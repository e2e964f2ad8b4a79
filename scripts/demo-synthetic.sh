#!/usr/bin/env bash
# The calibration pipeline on synthetic data (SmolLM2-135M geometry, configs/smollm2-135m.calib.yaml):
# builds kvcap, generates a dataset with known structure, calibrates compressors on it, converts
# the calibration state into an artifact, and inspects the result. Output goes to build/demo/. No model download needed.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

kvcap_prepare
kvcap_build "$KVCAP_ROOT/build" "release" -DCMAKE_BUILD_TYPE=Release
bin="$KVCAP_ROOT/build"
out="$KVCAP_ROOT/build/demo"
rm -rf "$out"
mkdir -p "$out"

echo "== 1. synthesise 32 image spans on a 16x16 grid: smooth rank-24 K/V structure + 2% noise"
"$bin/kvcap-synth" --out "$out/data" --spans 32 --rank-k 24 --rank-v 24 --noise 0.02 --outliers 0
echo "== 2. calibrate (value PCA, closed-form key masks and reconstructors), validate on held-out spans"
"$bin/kvcap-calibrate" --data "$out/data" --out "$out/smollm2.kvcs" --metrics-json "$out/metrics.json"
echo "== 3. convert to an artifact (f16 maps, the calibrated schedule)"
"$bin/kvcap-convert" "$out/smollm2.kvcs" --out "$out/smollm2.kvcap"
echo "== 4. inspect it"
"$bin/kvcap-convert" --inspect "$out/smollm2.kvcap"
echo "== 5. decode through libkvcap with that artifact: time, bytes read and held per policy"
"$bin/kvcap-bench" --artifact "$out/smollm2.kvcap" --steps 5
echo "== 6. the same with 2 high-norm outlier tokens per span at random positions: a fixed"
echo "      retained set cannot reconstruct them, which the validation metrics show"
"$bin/kvcap-synth" --out "$out/data-outliers" --spans 32 --rank-k 24 --rank-v 24 --noise 0.02 --outliers 2
"$bin/kvcap-calibrate" --data "$out/data-outliers" --out "$out/outliers.kvcs" | grep -E "^ +[0-9]+ +mean|bucket  layer"
echo "== done: dataset, state, metrics and artifact are in $out"
