#!/usr/bin/env bash
# Installs what building and testing kvcap needs on Debian 12, skipping what is present.
# Idempotent and quiet: prints one line per package it installs, nothing when all is there.
set -euo pipefail

# Build dependencies (Debian package names). Keep in sync with CMakeLists.txt.
PACKAGES=(
  build-essential cmake pkg-config
  libopenblas-dev liblapacke-dev
  libopenblas0-openmp # OpenBLAS on OpenMP's threads, the build CMakeLists.txt loads
  libyaml-dev libcjson-dev libkissfft-dev libcmocka-dev libpcre2-dev
  python3 python3-venv
  clang libclang-rt-14-dev libomp-dev # the libFuzzer harnesses (scripts/fuzz.sh)
)

missing=()
for p in "${PACKAGES[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done

if ((${#missing[@]})); then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "setup: installing ${missing[*]}" >&2
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq >/dev/null
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
