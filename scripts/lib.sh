# lib.sh — sourced by demo.sh and test.sh: installs prerequisites and configures + builds a tree.
# shellcheck shell=bash
KVCAP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

# kvcap_pip: prints a pip to download wheels with (the project's venv first, then the system's,
# else the venv made by scripts/setup-python.sh); prints nothing when there is none.
kvcap_pip() {
  local cand python
  for cand in "${KVCAP_VENV:-$KVCAP_ROOT/.venv}/bin/pip" "$(command -v pip3 || true)" \
    "$(command -v pip || true)"; do
    if [ -n "$cand" ] && [ -x "$cand" ]; then echo "$cand"; return 0; fi
  done
  python=$(bash "$KVCAP_ROOT/scripts/setup-python.sh" 2>/dev/null || true)
  if [ -n "$python" ] && [ -x "$(dirname "$python")/pip" ]; then echo "$(dirname "$python")/pip"; fi
}

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
