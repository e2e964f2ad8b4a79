#!/usr/bin/env bash
# gpu-check.sh — every GPU check in one command, for a machine with a CUDA device and an existing
# build (Release, KVCAP_CUDA=ON, tests on; its target gpu-checks builds what is run here):
#   tests      the GPU tests under ctest (each compares a device op with its CPU oracle);
#   bench      scripts/bench-gpu.sh with the build's kvcap-bench-cuda;
#   calibrate  kvcap-bench-calibrate, the CPU job and the device job side by side;
#   memcheck   the GPU test programs under compute-sanitizer's memcheck;
#   racecheck  the programs whose kernels use shared memory under racecheck: all but
#              test_calibrate_cuda, whose device work is cuBLAS and cuSOLVER's (calibrate/cuda
#              has no kernel of its own there) and takes over 420 s under racecheck.
# The sanitizers run last (they would disturb the timings), memcheck and racecheck side by side.
# Each step has its own time limit and writes its log to $OUT; a summary line per step ends the
# output. Exit status: 0 when every step that ran passed.
# Usage: bash scripts/gpu-check.sh BUILD_DIR [STEP,...]        (default: all steps, in order)
# Environment: OUT (results folder, default ./gpu-check-out), KVCAP_CHECK_TIMEOUT (seconds per
# sanitized program, default 120), KVCAP_CHECK_PROGRAMS (the test programs to sanitize, default
# all nine; racecheck leaves out test_calibrate_cuda unless it is named here), KVCAP_BENCH_ARGS (kvcap-bench-cuda options, e.g. "--sections bandwidth,decode"),
# KVCAP_CALIB_ARGS (kvcap-bench-calibrate options, default "--spans 12"), KVCAP_CALIB_CPUS (CPUs
# the CPU job may use, default 2, as on the CI machine).
set -uo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=$(cd "${1:?usage: gpu-check.sh BUILD_DIR [STEP,...]}" && pwd) || exit 2
steps=${2:-tests,bench,calibrate,memcheck,racecheck}
outdir=${OUT:-./gpu-check-out}
mkdir -p "$outdir" && outdir=$(cd "$outdir" && pwd)
per_program=${KVCAP_CHECK_TIMEOUT:-120}
calib_cpus=${KVCAP_CALIB_CPUS:-2}
read -r -a calib_args <<<"${KVCAP_CALIB_ARGS:---spans 12}"
summary=()

# The GPU test programs the build has (the CMake target gpu-checks builds them all).
gpu_tests=()
for f in "$build"/tests/test_cuda_device "$build"/tests/test_*_cuda; do
  [ -x "$f" ] && gpu_tests+=("$(basename "$f")")
done
[ ${#gpu_tests[@]} -gt 0 ] || { echo "gpu-check: no GPU tests in $build/tests (build the target gpu-checks)" >&2; exit 2; }

read -r -a sanitized <<<"${KVCAP_CHECK_PROGRAMS:-${gpu_tests[*]}}"
raced=()
for name in "${sanitized[@]}"; do
  [[ -z ${KVCAP_CHECK_PROGRAMS:-} && $name == test_calibrate_cuda ]] || raced+=("$name")
done
read -r -a bench_args <<<"${KVCAP_BENCH_ARGS:-}"

has_step() { [[ ",$steps," == *",$1,"* ]]; }
note() { summary+=("$(printf '%-10s %s' "$1" "$2")"); }

echo "== gpu-check: $(date -u '+%Y-%m-%d %H:%M:%S UTC'), $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo 'no git'), build $build"
nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.max.sm --format=csv,noheader || true
export TMPDIR=${TMPDIR:-/tmp}

# The GPU test programs under compute-sanitizer: sanitize_start launches every program under one
# tool (all at once, each within its own limit), sanitize_report waits for them and prints one
# line per program with the sanitizer's error summary. Both tools can run at the same time.
declare -A san_pids=()
sanitize_start() {
  local tool=$1 extra=$2 name
  local -n programs=$3
  for name in "${programs[@]}"; do
    # shellcheck disable=SC2086  # $extra is a list of options
    timeout "$per_program" compute-sanitizer --tool "$tool" $extra --error-exitcode 99 \
      --print-limit 20 "$build/tests/$name" >"$outdir/$tool-$name.log" 2>&1 &
    san_pids[$tool/$name]=$!
  done
}
sanitize_report() {
  local tool=$1 failed=0 name log rc
  local -n programs=$2
  echo
  echo "== $tool: compute-sanitizer --tool $tool, ${per_program}s per program"
  for name in "${programs[@]}"; do
    wait "${san_pids[$tool/$name]}"
    rc=$?
    log="$outdir/$tool-$name.log"
    case $rc in
      0) printf '  %-22s ok   %s\n' "$name" "$(grep -m1 'ERROR SUMMARY' "$log")" ;;
      77) printf '  %-22s skipped (no device)\n' "$name"; failed=1 ;;
      124) printf '  %-22s TIMEOUT after %ss\n' "$name" "$per_program"; failed=1 ;;
      *) printf '  %-22s FAILED (exit %d): %s\n' "$name" "$rc" "$(grep -m1 'ERROR SUMMARY' "$log")"
         grep -m 12 -E '^=+ +(Invalid|Race|Error|Uninit|Program hit|at |Saved host backtrace)' "$log" |
           sed 's/^/      /'
         failed=1 ;;
    esac
  done
  note "$tool" "$([ $failed = 0 ] && echo passed || echo "FAILED ($tool-*.log)")"
}

if has_step tests; then
  echo
  echo "== tests: ctest -R '_cuda|cuda_device'"
  if ! command -v ctest >/dev/null; then
    echo "(no ctest here: the programs one after another)"
    ok=1
    for name in "${gpu_tests[@]}"; do
      (cd "$build/tests" && TMPDIR=$PWD timeout 300 "./$name") >>"$outdir/ctest.log" 2>&1
      rc=$?
      printf '  %-22s exit %d\n' "$name" "$rc" | tee -a "$outdir/ctest.log"
      [ $rc = 0 ] || ok=0
    done
    note tests "$([ $ok = 1 ] && echo passed || echo 'FAILED (ctest.log)')"
  elif ctest --test-dir "$build" -R '_cuda$|^test_cuda_device$' -j4 --timeout 300 \
       --output-on-failure 2>&1 | tee "$outdir/ctest.log"; then
    if grep -q 'Not Run\|\*\*\*Skipped' "$outdir/ctest.log"; then
      note tests "SKIPPED some (see ctest.log)"
    else
      note tests passed
    fi
  else
    note tests "FAILED (ctest.log)"
  fi
fi
if has_step bench; then
  echo
  echo "== bench: scripts/bench-gpu.sh"
  if OUT="$outdir" KVCAP_BENCH_BIN="$build/kvcap-bench-cuda" bash "$root/scripts/bench-gpu.sh" \
       "${bench_args[@]}"; then
    note bench "done (bench-gpu.txt)"
  else
    note bench "FAILED (exit $?)"
  fi
fi
if has_step calibrate; then
  echo
  echo "== calibrate: kvcap-bench-calibrate ${calib_args[*]}, CPU job on $calib_cpus CPUs"
  cpus="0-$((calib_cpus - 1))"
  if OPENBLAS_NUM_THREADS=$calib_cpus taskset -c "$cpus" "$build/kvcap-bench-calibrate" \
       "${calib_args[@]}" --device auto 2>&1 | tee "$outdir/bench-calibrate.txt"; then
    note calibrate "done (bench-calibrate.txt)"
  else
    note calibrate "FAILED"
  fi
fi

# Last: the sanitizers slow every kernel down and would disturb the timings above.
if command -v compute-sanitizer >/dev/null; then
  has_step memcheck && sanitize_start memcheck "" sanitized
  has_step racecheck && sanitize_start racecheck "--racecheck-report all" raced
  has_step memcheck && sanitize_report memcheck sanitized
  has_step racecheck && sanitize_report racecheck raced
else
  has_step memcheck && note memcheck "SKIPPED: no compute-sanitizer"
  has_step racecheck && note racecheck "SKIPPED: no compute-sanitizer"
fi

echo
echo "== summary"
status=0
for line in "${summary[@]}"; do
  echo "  $line"
  [[ $line == *FAILED* || $line == *SKIPPED* ]] && status=1
done
exit $status
