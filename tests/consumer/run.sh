#!/bin/sh
# run.sh BUILD_DIR SRC_DIR WORK_DIR CC [CFLAGS] — installs the build into a scratch prefix, then builds
# and runs consumer.c against it twice: via pkg-config and via find_package(kvcap). Also checks
# that libkvcap exports exactly the KVCAP_API functions of kvcap.h.
set -eu
build=$1 src=$2 work=$3 cc=$4 extra=${5:-}
rm -rf "$work"
mkdir -p "$work"
prefix="$work/prefix"
cmake --install "$build" --prefix "$prefix" >/dev/null

lib=$(find "$prefix" -name 'libkvcap.so' | head -n 1)
libdir=$(dirname "$lib")
[ -n "$lib" ] || { echo "FAIL: libkvcap.so not installed"; exit 1; }
soname=$(readelf -d "$lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
echo "installed $(basename "$(readlink -f "$lib")"), SONAME $soname"
case "$soname" in libkvcap.so.[0-9]*) ;; *) echo "FAIL: SONAME '$soname' has no major version"; exit 1 ;; esac

# Exported symbols == functions declared with KVCAP_API in the installed header.
header="$prefix/include/kvcap.h"
sed -n 's/.*KVCAP_API[^(]*[ *]\(kvcap_[a-z0-9_]*\)(.*/\1/p' "$header" | sort >"$work/declared"
nm -D --defined-only "$lib" | awk '$2 ~ /^[TDBRW]$/ {print $3}' | sort >"$work/exported"
if ! diff -u "$work/declared" "$work/exported"; then
  echo "FAIL: exported symbols differ from the KVCAP_API declarations (- declared, + exported)"
  exit 1
fi
echo "exports: $(wc -l <"$work/exported") symbols, all declared in kvcap.h"

# 1. pkg-config
pc=$(find "$prefix" -name kvcap.pc | head -n 1)
export PKG_CONFIG_PATH="$(dirname "$pc")"
# shellcheck disable=SC2046
"$cc" -std=c11 -Wall -Wextra -Werror $extra "$src/consumer.c" -o "$work/consumer-pkgconfig" \
  $(pkg-config --cflags --libs kvcap) -Wl,-rpath,"$libdir"
"$work/consumer-pkgconfig"
echo "pkg-config consumer: ok (kvcap $(pkg-config --modversion kvcap))"

# 2. find_package
cmake -S "$src" -B "$work/cmake-build" -DCMAKE_PREFIX_PATH="$prefix" -DCMAKE_C_COMPILER="$cc" \
  -DCMAKE_BUILD_RPATH="$libdir" -DCMAKE_C_FLAGS="$extra" >/dev/null
cmake --build "$work/cmake-build" >/dev/null
"$work/cmake-build/consumer"
echo "find_package consumer: ok"
