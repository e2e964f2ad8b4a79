#!/usr/bin/env bash
# Creates (once) the Python environment the interop test uses: a venv with the reference
# safetensors implementation and numpy, at ${KVCAP_VENV:-<repo>/.venv}.
# Prints the venv's python path on stdout and nothing else. When the venv cannot be made
# (no python3-venv, no network), prints nothing on stdout, warns on stderr and exits 0, so
# the build goes on and the interop test reports itself as skipped.
set -u

NUMPY_PIN="numpy==2.4.6"
SAFETENSORS_PIN="safetensors==0.8.0"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
venv="${KVCAP_VENV:-$repo/.venv}"
py="$venv/bin/python"

warn() {
  echo "setup-python: $*; the interop test will be skipped" >&2
  exit 0
}

have_pins() {
  "$py" - "$NUMPY_PIN" "$SAFETENSORS_PIN" <<'EOF' >/dev/null 2>&1
import sys
from importlib.metadata import version
for pin in sys.argv[1:]:
    name, want = pin.split("==")
    if version(name) != want:
        sys.exit(1)
import numpy, safetensors.numpy  # noqa: E401,F401  (importable, not just installed)
EOF
}

if [ -x "$py" ] && have_pins; then
  echo "$py"
  exit 0
fi

if [ ! -x "$py" ]; then
  command -v python3 >/dev/null 2>&1 || warn "python3 not found"
  python3 -m venv "$venv" >/dev/null 2>&1 ||
    warn "python3 -m venv $venv failed (is python3-venv installed?)"
fi

"$py" -m pip install --quiet --disable-pip-version-check --no-input --retries 2 --timeout 30 \
  "$NUMPY_PIN" "$SAFETENSORS_PIN" >/dev/null 2>&1 ||
  warn "pip install $NUMPY_PIN $SAFETENSORS_PIN into $venv failed"

have_pins || warn "$venv has no working $NUMPY_PIN and $SAFETENSORS_PIN after install"
echo "$py"
