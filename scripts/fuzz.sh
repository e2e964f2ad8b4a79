#!/usr/bin/env bash
# Fuzzes every reader of hostile input: builds the libFuzzer harnesses of tests/fuzz with clang
# and ASan + UBSan (build-fuzz/), writes their seed corpora, and runs each harness for a fixed
# time, several at once. Installs what it needs first (scripts/setup.sh).
#
# Usage: bash scripts/fuzz.sh [--seconds N] [--jobs J] [harness...]
#   --seconds N  how long each harness runs (default 20; scripts/test.sh's smoke run uses 15)
#   --jobs J     harnesses running at the same time (default 2; 1 on a one-core machine)
#   harness      any of: safetensors artifact calib_state dataset gguf runtime_config
#                runtime_decode calib_config metrics cache (default: all), with or without the
#                fuzz_ prefix
#
# The long run, after changing a reader or before a release (an hour per harness):
#   bash scripts/fuzz.sh --seconds 3600 --jobs "$(nproc)"
#
# Prints one line per harness: executions, edge coverage (cov:) and features (ft:) at the end,
# and the result. Exits 1 if any harness found a crash, a leak, a timeout or an input that runs
# out of memory; the reproducer is kept under build-fuzz/crashes/<harness>/ and its path printed.
# Replay it with build-fuzz/tests/fuzz/fuzz_<harness> <reproducer>. Corpora grow in
# build-fuzz/corpus/<harness>/ and carry over to the next run; seeds are regenerated into
# build-fuzz/seeds/<harness>/ every time (from the library's writers, tests/data and configs/),
# and nothing is written into the source tree.
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"

ALL=(safetensors artifact calib_state dataset gguf runtime_config runtime_decode calib_config
     metrics cache)
seconds=20
jobs=2
[ "$(nproc)" -lt 2 ] && jobs=1
harnesses=()
while (($#)); do
  case $1 in
    --seconds) seconds=${2:?--seconds needs a number}; shift 2 ;;
    --jobs) jobs=${2:?--jobs needs a number}; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    -*) echo "fuzz.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
    *) harnesses+=("${1#fuzz_}"); shift ;;
  esac
done
((${#harnesses[@]})) || harnesses=("${ALL[@]}")
for h in "${harnesses[@]}"; do
  [[ " ${ALL[*]} " == *" $h "* ]] || { echo "fuzz.sh: no harness '$h' (${ALL[*]})" >&2; exit 2; }
done

# Per harness: the longest input (a little above its largest seed; longer inputs cost time and
# explore nothing new), the dictionary, and the repository files added to its seeds.
max_len() {
  case $1 in
    cache) echo 256 ;;
    runtime_config|runtime_decode|calib_config) echo 4096 ;;
    *) echo 16384 ;;
  esac
}
dict() {
  case $1 in
    safetensors|artifact|calib_state|dataset) echo safetensors.dict ;;
    runtime_config|runtime_decode|calib_config) echo yaml.dict ;;
    metrics) echo json.dict ;;
  esac
}
repo_seeds() {
  local d=$KVCAP_ROOT/tests/data
  case $1 in
    safetensors) echo "$d"/bad/*.safetensors "$d"/schema/*.safetensors ;;
    artifact|calib_state|dataset) echo "$d"/schema/*.safetensors ;;
    runtime_config) echo "$KVCAP_ROOT"/configs/runtime*.yaml "$d"/configs/good/*.yaml \
                         "$d"/configs/bad/runtime-*.yaml ;;
    runtime_decode) echo "$KVCAP_ROOT"/configs/runtime*.yaml "$d"/configs/good/*.yaml \
                         "$d"/configs/bad/runtime-*.yaml ;;
    calib_config) echo "$KVCAP_ROOT"/configs/*.calib.yaml "$d"/configs/bad/calib-*.yaml ;;
  esac
}

kvcap_prepare
command -v clang >/dev/null || { echo "fuzz.sh: clang is not installed" >&2; exit 1; }

# Unoptimised (Debug): clang 14 needs minutes to optimise the unrolled attention kernels with
# every sanitizer on; at -O0 the tree builds in about a minute and is just as checked.
dir=$KVCAP_ROOT/build-fuzz
log=$dir/kvcap-build.log
mkdir -p "$dir"
echo "== fuzz: configure and build ($dir)" >&2
if ! { cmake -S "$KVCAP_ROOT" -B "$dir" --log-level=WARNING -DCMAKE_C_COMPILER=clang \
         -DCMAKE_BUILD_TYPE=Debug -DKVCAP_FUZZ=ON -DKVCAP_CUDA=OFF -DKVCAP_TESTS=OFF &&
       cmake --build "$dir" --target kvcap_fuzzers -j"$(nproc)"; } >"$log" 2>&1; then
  cat "$log" >&2
  echo "== fuzz: build failed (log above, also in $log)" >&2
  exit 1
fi
grep -i "warning" "$log" >&2 || true

# The harnesses call BLAS on small matrices: one thread, none for LeakSanitizer to stop.
export OPENBLAS_NUM_THREADS=1
echo "== fuzz: seeds ($dir/seeds)" >&2
rm -rf "$dir/seeds"
# The seed writer is a tool, not a test: LeakSanitizer's stop-the-world at its exit has crashed
# ("Tracer caught signal 11") with OpenBLAS's threads alive, so it runs without leak checking.
ASAN_OPTIONS=detect_leaks=0 \
  "$dir/tests/fuzz/kvcap-fuzz-seeds" "$dir/seeds" "$KVCAP_ROOT/tests/data/eval/metrics-sample.json"
for h in "${harnesses[@]}"; do
  mkdir -p "$dir/seeds/$h" "$dir/corpus/$h" "$dir/crashes/$h" "$dir/logs"
  for f in $(repo_seeds "$h"); do
    [ -f "$f" ] && cp "$f" "$dir/seeds/$h/"
  done
done

# Scratch files of the harnesses that read paths: on a RAM disk when there is one.
scratch=$(mktemp -d "$( [ -w /dev/shm ] && echo /dev/shm || echo "$dir")/kvcap-fuzz.XXXXXX")
trap 'rm -rf "$scratch"' EXIT

run_one() {
  local h=$1
  local args=(-max_total_time="$seconds" -max_len="$(max_len "$h")" -timeout=30
              -rss_limit_mb=2048 -print_final_stats=1 -artifact_prefix="$dir/crashes/$h/")
  local d
  d=$(dict "$h")
  [ -n "$d" ] && args+=(-dict="$KVCAP_ROOT/tests/fuzz/$d")
  TMPDIR=$scratch ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    "$dir/tests/fuzz/fuzz_$h" "${args[@]}" "$dir/corpus/$h" "$dir/seeds/$h" \
    >"$dir/logs/$h.log" 2>&1
}

# One line from a harness's log: executions, cov/ft of its last status line, the result.
report() {
  local h=$1 rc=$2 f=$dir/logs/$1.log
  local execs stats result
  execs=$(grep -o 'number_of_executed_units: [0-9]*' "$f" | tail -1 | grep -o '[0-9]*$' || true)
  [ -n "$execs" ] || execs=$(grep -o '^#[0-9]*' "$f" | tail -1 | tr -d '#' || true)
  stats=$(grep -o 'cov: [0-9]* ft: [0-9]*' "$f" | tail -1 || true)
  if [ "$rc" -eq 0 ]; then
    result=ok
  else
    local what unit
    what=$(grep -m1 -oE 'check failed: .*|runtime error: [^:]*|ERROR: [A-Za-z]+: [a-z -]*[a-z]' \
             "$f" || echo "exit $rc")
    unit=$(grep -o 'Test unit written to .*' "$f" | tail -1 | sed 's/^Test unit written to //' ||
           true)
    result="FAILED: $what${unit:+ — reproducer $unit} (log $f)"
  fi
  printf '%-20s %10s execs  %-22s %5ss  %s\n' "fuzz_$h" "${execs:-?}" "${stats:-cov: ? ft: ?}" \
    "$seconds" "$result"
}

echo "== fuzz: ${#harnesses[@]} harness(es), ${seconds}s each, $jobs at a time" >&2
failed=0
declare -A pid_of=()
pending=("${harnesses[@]}")
running=()
while ((${#pending[@]} || ${#running[@]})); do
  while ((${#pending[@]})) && ((${#running[@]} < jobs)); do
    h=${pending[0]}
    pending=("${pending[@]:1}")
    run_one "$h" &
    pid_of[$h]=$!
    running+=("$h")
  done
  wait -n || true
  still=()
  for h in "${running[@]}"; do
    if kill -0 "${pid_of[$h]}" 2>/dev/null; then
      still+=("$h")
    else
      rc=0
      wait "${pid_of[$h]}" || rc=$?
      report "$h" "$rc"
      [ "$rc" -eq 0 ] || failed=1
    fi
  done
  running=("${still[@]}")
done
exit "$failed"
