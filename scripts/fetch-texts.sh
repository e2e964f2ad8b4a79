#!/usr/bin/env bash
# Obtains the text track's test documents listed in scripts/eval-texts.tsv into
# ${KVCAP_CACHE:-$HOME/.cache/kvcap}/texts/<id>, for `kvcap-eval run --corpus DIR --docs IDS`:
# licence texts taken from a pinned Debian package (apt-get download + dpkg-deb -x; nothing is
# installed), each the part of its file after the YAML front matter. The package's file is
# checked against its sha256 and the extracted text against its own before it gets its final
# name, so the cache never holds a partial or unverified file. Idempotent and silent when
# everything is cached; progress goes to stderr; on failure prints why and exits 1. Prints
# nothing on stdout. (The download follows scripts/fetch-vision.sh, which fetches the photos.)
set -euo pipefail

repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
manifest="$repo/scripts/eval-texts.tsv"
cache="${KVCAP_CACHE:-$HOME/.cache/kvcap}"
texts="$cache/texts"

say() { echo "fetch-texts: $*" >&2; }
fail() { say "$*"; exit 1; }
sha_ok() { [ -f "$2" ] && echo "$1  $2" | sha256sum -c --status; }

tmp=""
cleanup() {
  [ -z "$tmp" ] || rm -rf "$tmp"
  rm -f "$texts"/*.tmp.$$
}
trap cleanup EXIT

# body SRC DEST: what follows SRC's YAML front matter (its first line is ---, it ends at the
# next line that is exactly ---), without the blank lines that begin it; fails without one.
body() {
  awk 'NR == 1 && $0 != "---" { bad = 1; exit }
       d < 2 { if ($0 == "---") d++; next }
       !s && /^[[:space:]]*$/ { next }
       { s = 1; print }
       END { if (bad || d < 2) exit 3 }' "$1" >"$2"
}

[ -f "$manifest" ] || fail "$manifest not found"
declare -a ids=() pkgs=() paths=() fshas=() tshas=()
declare -A needed=()
while IFS=$'\t' read -r id pkg path fsha tsha _rest; do
  case "$id" in '' | '#'*) continue ;; esac
  [ -n "$pkg" ] && [ -n "$path" ] && [ ${#fsha} -eq 64 ] && [ ${#tsha} -eq 64 ] ||
    fail "$manifest: malformed line for '$id'"
  case "$id" in */* | .*) fail "$manifest: '$id' is not a plain file name" ;; esac
  sha_ok "$tsha" "$texts/$id" && continue
  ids+=("$id") pkgs+=("$pkg") paths+=("$path") fshas+=("$fsha") tshas+=("$tsha")
  needed[$pkg]=1
done <"$manifest"
[ ${#ids[@]} -gt 0 ] || exit 0

source "$repo/scripts/lib.sh"
tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvcap-fetch-texts.XXXXXX")
mkdir -p "$texts"
bad=0
for pkg in $(printf '%s\n' "${!needed[@]}" | sort); do
  say "downloading Debian package $pkg"
  dir="$tmp/deb/${pkg%%=*}"
  kvcap_deb_extract "$pkg" "$dir" || fail "cannot fetch $pkg (above)"
  for i in "${!ids[@]}"; do
    [ "${pkgs[$i]}" = "$pkg" ] || continue
    src="$dir/x/${paths[$i]}" dest="$texts/${ids[$i]}"
    if [ ! -f "$src" ]; then
      say "${ids[$i]}: ${paths[$i]} is not in $pkg"
      bad=$((bad + 1))
    elif ! sha_ok "${fshas[$i]}" "$src"; then
      say "${ids[$i]}: sha256 mismatch for ${paths[$i]} in $pkg (expected ${fshas[$i]}, got $(sha256sum "$src" | cut -d' ' -f1))"
      bad=$((bad + 1))
    elif ! body "$src" "$dest.tmp.$$" || ! sha_ok "${tshas[$i]}" "$dest.tmp.$$"; then
      # the text is renamed into place only once verified
      rm -f "$dest.tmp.$$"
      say "${ids[$i]}: the text extracted from ${paths[$i]} does not match its sha256 (expected ${tshas[$i]})"
      bad=$((bad + 1))
    else
      mv -f "$dest.tmp.$$" "$dest"
    fi
  done
  rm -rf "$dir"
done
[ "$bad" -eq 0 ] || fail "$bad text(s) could not be verified; the others are in $texts"
say "${#ids[@]} text(s) ready in $texts"
