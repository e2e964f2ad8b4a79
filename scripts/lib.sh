# lib.sh — sourced by demo.sh and test.sh: installs prerequisites and configures + builds a tree.
# shellcheck shell=bash
KVCAP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

kvcap_prepare() {
  bash "$KVCAP_ROOT/scripts/setup.sh"
}

# kvcap_build DIR LABEL [CMAKE ARGS...]: quiet configure + build; prints the log on failure.
kvcap_build() {
  local dir=$1 label=$2
  shift 2
  local log="$dir/kvcap-build.log"
  mkdir -p "$dir"
  echo "== $label: configure and build ($dir)" >&2
  if ! { cmake -S "$KVCAP_ROOT" -B "$dir" --log-level=WARNING "$@" &&
         cmake --build "$dir" -j"$(nproc)"; } >"$log" 2>&1; then
    cat "$log" >&2
    echo "== $label: build failed (log above, also in $log)" >&2
    return 1
  fi
  grep -i "warning" "$log" >&2 || true
}
