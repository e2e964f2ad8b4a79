#!/usr/bin/env bash
# gpu-bundle.sh — packs what scripts/gpu-check.sh needs into one archive for a GPU machine that
# has the CUDA toolkit but not the project's build dependencies (OpenBLAS, LAPACKE, libyaml,
# cJSON, KissFFT, cmocka): a Release CUDA build of the GPU tests and benchmarks (built here if
# needed, for KVCAP_CUDA_ARCHITECTURES, default 90) without its object files, and the shared
# libraries those programs load that are not CUDA's or the C library's.
# Usage: bash scripts/gpu-bundle.sh [OUT.tar.xz]     (default: build-gpu.tar.xz)
# On the GPU machine, from a checkout of the same commit at the same path as here:
#   tar -xJf build-gpu.tar.xz && export LD_LIBRARY_PATH=$PWD/rt:/usr/local/cuda/lib64
#   bash scripts/gpu-check.sh build-gpu
# (The tests name their data by absolute path: link the checkout there if it lives elsewhere.)
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=$(realpath -m "${1:-$root/build-gpu.tar.xz}")
build=$root/build-gpu
arch=${KVCAP_CUDA_ARCHITECTURES:-90}
echo "== build: target gpu-checks in $build (sm_$arch)" >&2
cmake -S "$root" -B "$build" --log-level=WARNING -DCMAKE_BUILD_TYPE=Release -DKVCAP_CUDA=ON \
  -DKVCAP_CUDA_ARCHITECTURES="$arch" >/dev/null
cmake --build "$build" -j"$(nproc)" --target gpu-checks >"$build/gpu-bundle-build.log" 2>&1 ||
  { tail -n 30 "$build/gpu-bundle-build.log"; exit 1; }

# The libraries to carry: what the programs load, less CUDA's (the GPU machine's toolkit has
# them) and the C library's.
stage=$(mktemp -d)
trap 'rm -rf "$stage"' EXIT
mkdir -p "$stage/rt"
for f in "$build"/kvcap-bench-cuda "$build"/kvcap-bench-calibrate "$build"/tests/test_cuda_device \
  "$build"/tests/test_*_cuda; do
  ldd "$f" | awk '$3 ~ /^\// { print $1, $3 }'
done | sort -u | while read -r name path; do
  case "$name" in
    libc.so* | libm.so* | libdl.so* | librt.so* | libpthread.so* | ld-linux* | libgcc_s.so* | \
      libstdc++.so* | libcu* | libnv*) ;;
    *) cp -L "$path" "$stage/rt/$name" ;;
  esac
done
tar -C "$root" -cf - --exclude='*.o' --exclude='*.a' --exclude='CMakeFiles' build-gpu |
  tar -C "$stage" -xf -
tar -C "$stage" -cf - build-gpu rt | xz -T0 -6 >"$out"
echo "== $out: $(du -h "$out" | cut -f1) ($(ls "$stage/rt" | tr '\n' ' '))" >&2
