# lib.sh — sourced by demo.sh and test.sh: installs prerequisites and configures + builds a tree.
# shellcheck shell=bash
KVCAP_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# OpenMP threads (kvcap's loops, OpenBLAS's OpenMP build) that wait sleep instead of spinning:
# ctest runs two tests at once, and libgomp's default spin took the cores from the other test
# (test_eval 559 s and test_hf 497 s side by side on two cores; 230 s and 262 s passive). A
# single evaluation runs as fast either way (149 s and 147 s). A value already set is kept.
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}

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

# kvcap_deb_extract PKG=VERSION DIR: downloads that Debian package (never installs it) and
# unpacks it into DIR/x; returns 1 with the reason on stderr when it cannot. A fresh machine
# has no package lists yet: as root, `apt-get update` runs once per shell when a download fails.
kvcap_deb_extract() {
  local pkg=$1 dir=$2 deb opts=()
  # apt downloads as the unprivileged _apt user when it can; as root into a private temp
  # folder it cannot, and says so on every call: download as root directly.
  [ "$(id -u)" -ne 0 ] || opts=(-o APT::Sandbox::User=root)
  command -v apt-get >/dev/null && command -v dpkg-deb >/dev/null || {
    echo "apt-get and dpkg-deb are needed to fetch $pkg (a Debian package)" >&2; return 1; }
  mkdir -p "$dir"
  if ! (cd "$dir" && apt-get download -q "${opts[@]}" "$pkg" >/dev/null 2>"$dir/apt.err"); then
    if [ "${KVCAP_APT_UPDATED:-0}" -eq 0 ] && [ "$(id -u)" -eq 0 ]; then
      echo "apt-get download $pkg failed; running apt-get update once" >&2
      apt-get update -qq >&2 || { echo "apt-get update failed" >&2; return 1; }
      KVCAP_APT_UPDATED=1
    fi
    (cd "$dir" && apt-get download -q "${opts[@]}" "$pkg" >/dev/null 2>"$dir/apt.err") || {
      cat "$dir/apt.err" >&2
      echo "apt-get download $pkg failed (is this Debian 12 with its main archive in the apt" \
        "sources?)" >&2
      return 1
    }
  fi
  deb=$(ls "$dir"/*.deb 2>/dev/null | head -n1)
  [ -n "$deb" ] || { echo "apt-get download $pkg produced no .deb" >&2; return 1; }
  dpkg-deb -x "$deb" "$dir/x" || { echo "dpkg-deb -x $(basename "$deb") failed" >&2; return 1; }
  rm -f "$deb"
}

# phase NAME: what runs from here on is timed as NAME (the table is printed at the end)
phase_names=() phase_starts=()
phase() { phase_names+=("$1") phase_starts+=("$SECONDS"); }
phase_table() {
  local i n=${#phase_names[@]} end
  ((n > 0)) || return 0
  echo "== time per phase (seconds)"
  for ((i = 0; i < n; i++)); do
    end=$SECONDS
    ((i + 1 < n)) && end=${phase_starts[i + 1]}
    printf '   %6d  %s\n' $((end - phase_starts[i])) "${phase_names[i]}"
  done
  printf '   %6d  total\n' $((SECONDS - phase_starts[0]))
}

# Uniform up to the tile: a tile of 16 keeps a whole number of rows, so R = r x 16 is spread
# over the layers as its floor and ceiling (e.g. 6 and 7 for r = 0.4) with the exact mean;
# rounding every layer alike would hold 0.375 at r = 0.4 and compare it at a smaller budget.
tile_uniform() { # tile_uniform R: a list schedule for 30 layers and tiles of 16
  awk -v r="$1" 'BEGIN { for (l = 0; l < 30; l++) {
    a = int((l + 1) * r * 16 + 1e-9) - int(l * r * 16 + 1e-9); s = s (l ? "," : "") a / 16 }
    print "list:" s }'
}
# exact_ratio R TILES: kvcap's exact tiles hold one of a span's TILES tiles exactly, the others
# are compressed at (R - 1/TILES) / ((TILES - 1)/TILES), so that the span's bytes are R of full's.
exact_ratio() { awk -v r="$1" -v t="$2" 'BEGIN { printf "%.6f", (r - 1 / t) / ((t - 1) / t) }'; }
