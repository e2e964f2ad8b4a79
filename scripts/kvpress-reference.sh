#!/usr/bin/env bash
# kvpress-reference.sh — kvpress (NVIDIA's KV-compression library for transformers, pinned) as
# an outside reference beside a kvcap-eval run (text track, or image track through the span
# embeddings the run writes): the same model, prompts, span and retentions, only the span
# compressed. Prints kvpress's presses and kvcap's policies in one
# table (dNLL and KL against the full cache, next-token agreement, realised retention) and
# writes kvpress.json beside the run's metrics.json.
# Usage: bash scripts/kvpress-reference.sh [RUN_DIR] [kvpress_reference.py options]
#   RUN_DIR: a `kvcap-eval run` output (default build/demo/text/test, the demo's).
# Makes its own venv (${KVCAP_KVPRESS_VENV:-<repo>/.venv-kvpress}): kvpress 0.5.5 needs
# transformers < 5.3, the project venv has a newer one. About 2 minutes per retention for the
# seven presses on the demo's 8 prompts (2 cores).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
run=${1:-$root/build/demo/text/test}
[ $# -gt 0 ] && shift
if [ ! -f "$run/metrics.json" ]; then
  echo "kvpress-reference: $run/metrics.json not found (run scripts/demo.sh --track text, or kvcap-eval run --out DIR)" >&2
  exit 2
fi
venv=${KVCAP_KVPRESS_VENV:-$root/.venv-kvpress}
pins=("kvpress==0.5.5" "transformers==5.2.0" "torch==2.15.0" "accelerate==1.15.0" "gguf==0.19.0"
      "numpy==2.4.6")
if ! "$venv/bin/python" -c "import kvpress, transformers; assert transformers.__version__ == '5.2.0'" \
    2>/dev/null; then
  echo "== kvpress-reference: making $venv (${pins[*]})" >&2
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "${pins[@]}"
fi
HF_HUB_OFFLINE=1 exec "$venv/bin/python" "$root/scripts/kvpress_reference.py" \
  --metrics "$run/metrics.json" --out "$run/kvpress.json" "$@"
