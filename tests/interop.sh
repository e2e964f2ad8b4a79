#!/bin/sh
# interop.sh ST_TOOL WORKDIR — runs interop.py (kvcap's safetensors layer against the PyPI
# reference implementation) with the Python named by $KVCAP_PYTHON; exits 77 (skipped) when
# that Python is not set or lacks numpy/safetensors.
set -u

if [ $# -ne 2 ]; then
  echo "usage: interop.sh ST_TOOL WORKDIR" >&2
  exit 2
fi
st_tool=$1
workdir=$2
py=${KVCAP_PYTHON:-}

if [ -z "$py" ] || ! "$py" -c 'import numpy, safetensors.numpy' >/dev/null 2>&1; then
  echo "SKIP: interop test needs python with numpy and safetensors (run scripts/setup-python.sh)"
  exit 77
fi

mkdir -p "$workdir" || exit 1
exec "$py" "$(dirname "$0")/interop.py" "$st_tool" "$workdir"
