#!/usr/bin/env bash
# Renders an HTML file (e.g. kvcap-report's report.html) to a PNG with headless Chromium, to
# look at a report without a browser. Installs Debian's `chromium` package when it is missing.
#
# usage: bash scripts/screenshot.sh REPORT.html OUT.png [HEIGHT]
#   HEIGHT  viewport height in pixels (default 4000); the width is 1400. Content below
#           HEIGHT is cut off, so give a taller one for long reports.
set -euo pipefail

usage() {
  sed -n '2,8p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
}

if [ "$#" -lt 2 ] || [ "$#" -gt 3 ]; then usage; fi
case "$1" in -h | --help) usage ;; esac
html=$1
out=$2
height=${3:-4000}

if [ ! -f "$html" ]; then
  echo "screenshot: error: $html: no such file" >&2
  exit 1
fi
if ! [[ "$height" =~ ^[0-9]+$ ]] || [ "$height" -lt 100 ] || [ "$height" -gt 30000 ]; then
  echo "screenshot: error: height '$height' is not a number of pixels in 100..30000" >&2
  exit 2
fi

if ! command -v chromium >/dev/null 2>&1; then
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "screenshot: installing chromium (Debian package)" >&2
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq >/dev/null
  $SUDO apt-get install -y -qq --no-install-recommends chromium fonts-dejavu-core >/dev/null
fi

abs_html=$(cd "$(dirname "$html")" && pwd)/$(basename "$html")
case "$out" in
  /*) abs_out=$out ;;
  *) abs_out=$(pwd)/$out ;;
esac
out_dir=$(dirname "$abs_out")
if [ ! -d "$out_dir" ]; then
  echo "screenshot: error: $out_dir: no such directory" >&2
  exit 1
fi

# Chromium writes the screenshot into its working directory when given a bare name and
# keeps a profile in $HOME; a scratch profile keeps runs independent of each other.
profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
log="$profile/chromium.log"
if ! chromium --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --user-data-dir="$profile" --window-size=1400,"$height" \
    --screenshot="$abs_out" "file://$abs_html" >"$log" 2>&1; then
  cat "$log" >&2
  echo "screenshot: error: chromium failed on $abs_html" >&2
  exit 1
fi
if [ ! -s "$abs_out" ]; then
  cat "$log" >&2
  echo "screenshot: error: chromium wrote no $abs_out" >&2
  exit 1
fi
echo "screenshot: wrote $abs_out (1400x$height)" >&2
