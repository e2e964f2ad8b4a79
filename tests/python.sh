#!/bin/sh
# tests/python.sh — the Python package's tests (tests/python, pytest) against the libkvcap of
# this build, whose folder also holds the tools the tests run (KVCAP_TOOLS).
# Usage: python.sh SOURCE_DIR LIBKVCAP SANITIZED TEST_FILE. Exits 77 (skipped) without the
# project's venv (scripts/setup-python.sh) or in a sanitizer build, whose instrumented library
# cannot be loaded into an uninstrumented Python.
src=$1
libkvcap=$2
sanitized=$3
test_file=$4
py=${KVCAP_PYTHON:-}
if [ "$sanitized" = "1" ]; then
  echo "SKIP: the sanitizer build's libkvcap cannot be loaded into Python (tested in the release build)"
  exit 77
fi
if [ -z "$py" ] || ! "$py" -c "import numpy, pytest" 2>/dev/null; then
  echo "SKIP: no Python with numpy and pytest (scripts/setup-python.sh makes one)"
  exit 77
fi
cd "$src/python" || exit 1
KVCAP_LIBRARY=$libkvcap KVCAP_TOOLS=$(dirname "$libkvcap") HF_HUB_OFFLINE=1 \
  exec "$py" -m pytest -q -rs -p no:cacheprovider "$src/tests/python/$test_file"
