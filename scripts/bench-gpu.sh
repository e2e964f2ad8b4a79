#!/usr/bin/env bash
# bench-gpu.sh — the GPU benchmark in one command: builds kvcap-bench-cuda (Release, CUDA on)
# when needed, checks for a device (exit 77 without one), runs it, then PyTorch's
# scaled_dot_product_attention on the same decode shapes when torch with CUDA is installed
# (scripts/bench_sdpa.py), and prints the summary: plain, fused and SDPA decode side by side, and
# FreeKV's decode steps when that section ran.
# Everything printed also goes to $OUT/bench-gpu.txt (./bench-gpu-out/ when OUT is unset), with
# the raw results as .tsv files beside it. Installs nothing and needs no network.
# Usage: bash scripts/bench-gpu.sh [kvcap-bench-cuda options]   e.g. --dtype bf16 --reps 50
# Environment: KVCAP_BENCH_BUILD (build folder, default build-bench-gpu), KVCAP_BENCH_JOBS
# (parallel build jobs, default: all cores), KVCAP_BENCH_BIN (a kvcap-bench-cuda already built,
# e.g. on a machine without the build dependencies: no build step), PYTHON (python3).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
build=${KVCAP_BENCH_BUILD:-$root/build-bench-gpu}
outdir=${OUT:-./bench-gpu-out}
python=${PYTHON:-python3}
jobs=${KVCAP_BENCH_JOBS:-$(nproc)}
mkdir -p "$outdir"
outdir=$(cd "$outdir" && pwd)
exec > >(tee "$outdir/bench-gpu.txt") 2>&1

# cuFFT (FlashCache) is loaded at run time; make the toolkit's copy findable.
for dir in "${CUDA_HOME:-/usr/local/cuda}/lib64" /usr/local/cuda/lib64; do
  if [ -d "$dir" ]; then
    export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    break
  fi
done

echo "== kvcap GPU benchmark: $(date -u '+%Y-%m-%d %H:%M UTC'), $(git -C "$root" rev-parse --short HEAD 2>/dev/null || echo 'no git')"

# ---- Build (incremental: a no-op when up to date) ---------------------------------------------
if [ -n "${KVCAP_BENCH_BIN:-}" ]; then
  bench=$KVCAP_BENCH_BIN
  echo "== prebuilt: $bench"
else
  log="$build/bench-gpu-build.log"
  mkdir -p "$build"
  echo "== build: kvcap-bench-cuda in $build (log: $log)"
  if ! { cmake -S "$root" -B "$build" --log-level=WARNING -DCMAKE_BUILD_TYPE=Release \
           -DKVCAP_CUDA=ON -DKVCAP_TESTS=OFF &&
         cmake --build "$build" --target kvcap-bench-cuda -j"$jobs"; } >"$log" 2>&1; then
    tail -n 40 "$log"
    echo "== build failed (full log: $log)"
    exit 1
  fi
  bench="$build/kvcap-bench-cuda"
fi

# ---- Device -------------------------------------------------------------------------------------
set +e
"$bench" --probe
rc=$?
set -e
if [ "$rc" -eq 77 ]; then
  echo "== no CUDA device: nothing to measure (exit 77)"
  exit 77
elif [ "$rc" -ne 0 ]; then
  exit "$rc"
fi

# The options that set the decode shapes and timing rule are given to the SDPA run as well.
sdpa_args=()
args=("$@")
for ((i = 0; i < ${#args[@]}; i++)); do
  a=${args[i]}
  case "$a" in
    --dtype=* | --contexts=* | --batches=* | --heads=* | --head-dim=* | --reps=* | --warmup=* | --device=*)
      sdpa_args+=("$a") ;;
    --dtype | --contexts | --batches | --heads | --head-dim | --reps | --warmup | --device)
      sdpa_args+=("$a" "${args[i + 1]:-}") ;;
    -n) sdpa_args+=(--contexts "${args[i + 1]:-}") ;;
    -b) sdpa_args+=(--batches "${args[i + 1]:-}") ;;
    -d) sdpa_args+=(--head-dim "${args[i + 1]:-}") ;;
    --warm | --no-graph) sdpa_args+=("$a") ;;
  esac
done

# ---- kvcap --------------------------------------------------------------------------------------
echo
"$bench" --tsv "$outdir/kvcap.tsv" "$@"

# ---- PyTorch SDPA -------------------------------------------------------------------------------
sdpa_tsv="$outdir/sdpa.tsv"
rm -f "$sdpa_tsv"
echo
if ! "$python" -c 'import torch' >/dev/null 2>&1; then
  echo "PyTorch not available: SDPA column omitted"
elif ! "$python" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
  echo "PyTorch has no CUDA device: SDPA column omitted"
else
  copy=$(awk -F'\t' '$1 == "bandwidth" && $2 == "d2d_copy_gbs" { print $3 }' "$outdir/kvcap.tsv")
  if ! "$python" "$root/scripts/bench_sdpa.py" --tsv "$sdpa_tsv" --copy-gbs "${copy:-0}" \
         "${sdpa_args[@]}"; then
    echo "SDPA run failed: SDPA column omitted"
    rm -f "$sdpa_tsv"
  fi
fi

# ---- Summary ------------------------------------------------------------------------------------
# kvcap.tsv decode lines: decode dtype layers n B plain_us fused_us plain_bytes fused_bytes copy;
# sdpa.tsv: sdpa dtype n B us read gqa mode. Times are per layer (a kvcap step covers --layers).
echo
echo "summary: decode attention, microseconds per layer, all measured in this run"
[ -f "$sdpa_tsv" ] || sdpa_tsv=/dev/null
awk -F'\t' -v sdpa_file="$sdpa_tsv" '
  FILENAME == sdpa_file { if ($1 == "sdpa") sdpa[$3 " " $4] = $5; next }
  $1 == "decode" {
    if (!header++)
      printf "%8s %3s %11s %11s %11s %12s %11s\n", "context", "B", "plain us", "fused us",
             "SDPA us", "fused/plain", "plain/SDPA"
    plain = $6 / $3; fused = $7 / $3; key = $4 " " $5
    if (key in sdpa)
      printf "%8d %3d %11.1f %11.1f %11.1f %12.3f %11.3f\n", $4, $5, plain, fused, sdpa[key],
             fused / plain, plain / sdpa[key]
    else
      printf "%8d %3d %11.1f %11.1f %11s %12.3f %11s\n", $4, $5, plain, fused, "-",
             fused / plain, "-"
  }
  END { if (!header) print "  (no decode results)" }
' "$sdpa_tsv" "$outdir/kvcap.tsv"

# kvcap.tsv freekv lines: freekv dtype layers n layer_us steps hidden_share corr_per_step
# pages_per_step bytes_per_step step_us_mean step_us_median h2d_gbs recall_us_at_h2d.
if awk -F'\t' '$1 == "freekv" { found = 1 } END { exit !found }' "$outdir/kvcap.tsv"; then
  echo
  echo "summary: FreeKV decode steps (all layers), from the same run"
  awk -F'\t' '
    $1 == "freekv" {
      if (!header++)
        printf "%8s %6s %9s %8s %11s %11s %14s\n", "context", "layers", "layer us", "hidden",
               "step us", "recall MB", "recall us@H2D"
      hidden = ($7 == "nan" || $7 == "-nan") ? "-" : sprintf("%.1f%%", 100 * $7)
      need = ($14 == "nan" || $14 == "-nan") ? "-" : sprintf("%.1f", $14)
      printf "%8d %6d %9g %8s %11.1f %11.2f %14s\n", $4, $3, $5, hidden, $11, $10 / 1e6, need
    }
  ' "$outdir/kvcap.tsv"
fi
echo
echo "== results: $outdir/bench-gpu.txt (raw: kvcap.tsv$( [ "$sdpa_tsv" != /dev/null ] && echo ', sdpa.tsv'))"
