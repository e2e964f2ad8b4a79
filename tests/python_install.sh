#!/bin/sh
# tests/python_install.sh — `pip install ./python` into a new virtual environment (the package
# builds libkvcap and the calibration tools from this repository and bundles them), then the
# README's "From Python" example and the bundled tools run there. Usage: python_install.sh SOURCE_DIR WORK_DIR. Exits 77 (skipped) when no
# venv can be made or the package index cannot be reached.
src=$1
work=$2
rm -rf "$work" && mkdir -p "$work" || exit 1
if ! python3 -m venv "$work/venv" >"$work/venv.log" 2>&1; then
  echo "SKIP: python3 -m venv failed (see $work/venv.log)"
  exit 77
fi
py=$work/venv/bin/python
if ! "$py" -m pip install --disable-pip-version-check --no-input --retries 2 --timeout 30 \
    "$src/python" >"$work/pip.log" 2>&1; then
  if grep -qi 'connection\|resolve\|network\|No matching distribution' "$work/pip.log"; then
    echo "SKIP: the package index cannot be reached (see $work/pip.log)"
    exit 77
  fi
  tail -30 "$work/pip.log"
  echo "FAIL: pip install $src/python"
  exit 1
fi
# The README's example, taken from the README itself so the two cannot drift apart.
sed -n '/^<!-- python-example -->$/,/^<!-- \/python-example -->$/p' "$src/README.md" |
  sed '1,2d;$d' | sed '$d' >"$work/example.py"
if [ ! -s "$work/example.py" ]; then
  echo "FAIL: README.md has no example between <!-- python-example --> markers"
  exit 1
fi
cd "$work" && "$py" example.py || exit 1
# The bundled tools, as console scripts and through kvcap.tools.
"$work/venv/bin/kvcap-convert" --help >/dev/null || { echo "FAIL: kvcap-convert --help"; exit 1; }
"$work/venv/bin/kvcap-calibrate" --help >/dev/null || { echo "FAIL: kvcap-calibrate --help"; exit 1; }
"$py" -c "import kvcap.tools as t; p = t.find('kvcap-calibrate'); assert '/site-packages/kvcap/bin/' in p, p"
