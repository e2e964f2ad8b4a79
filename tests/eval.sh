#!/bin/sh
# eval.sh BIN_DIR SOURCE_DIR WORK_DIR — the real-model pipeline end to end on a small scale:
# kvcap-eval record → kvcap-calibrate → kvcap-convert → kvcap-eval run, then checks the
# metrics: full agrees with itself, every policy ran, the report and CSV exist. Also the
# tool's --help and named usage errors. Skipped (77) when SmolLM2-135M-Instruct is not present
# (bash scripts/fetch-model.sh downloads it).
set -u
bin=$1 src=$2 work=$3
rm -rf "$work" && mkdir -p "$work"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

eval_bin="$bin/kvcap-eval"
"$eval_bin" --help | grep -q "usage: kvcap-eval record" || fail "--help"
"$eval_bin" >"$work/noargs.out" 2>&1; rc=$?
[ "$rc" -eq 2 ] && grep -q "expected a command" "$work/noargs.out" || fail "no command: exit $rc"
"$eval_bin" run --out "$work/x" >"$work/noheld.out" 2>&1; rc=$?
[ "$rc" -eq 2 ] && grep -q "heldout-data" "$work/noheld.out" || fail "run without --heldout-data: exit $rc"
"$eval_bin" run --out "$work/x" --heldout-data d --kvcapsule nonsense >"$work/badart.out" 2>&1; rc=$?
[ "$rc" -eq 2 ] && grep -q "VARIANT:RETENTION:FILE" "$work/badart.out" || fail "bad --kvcapsule: exit $rc"
"$eval_bin" record --out "$work/x" --model "$work/missing.gguf" >"$work/nomodel.out" 2>&1; rc=$?
[ "$rc" -eq 1 ] && grep -q "missing.gguf" "$work/nomodel.out" || fail "missing model: exit $rc"

model="${KVCAP_SMOLLM2_GGUF:-$HOME/.cache/kvcap/models/SmolLM2-135M-Instruct.Q4_1.gguf}"
if [ ! -f "$model" ]; then
  [ "$failures" -eq 0 ] || exit 1
  echo "SKIP: real-model pipeline ($model not found; bash scripts/fetch-model.sh gets it)"
  exit 77
fi

corpus=/usr/share/common-licenses
"$eval_bin" record -q --model "$model" --corpus "$corpus" --docs GPL-3,LGPL-2.1 --tail 8 --decode 4 \
  --max-chunks 24 --out "$work/calib" || fail "record calibration"
"$eval_bin" record -q --model "$model" --corpus "$corpus" --docs Apache-2.0 --tail 8 --decode 4 \
  --max-chunks 2 --out "$work/heldout" || fail "record held-out"
"$bin/kvcap-calibrate" -q --config "$src/configs/smollm2-135m-text-tiled.calib.yaml" \
  --data "$work/calib" --out "$work/tiled.kvcs" || fail "calibrate"
"$bin/kvcap-convert" "$work/tiled.kvcs" --out "$work/tiled.kvcap" --keys uniform:0.4 \
  --values uniform:0.4 >/dev/null || fail "convert"
"$eval_bin" run -q --model "$model" --corpus "$corpus" --docs Apache-2.0 --tail 8 --prompts 2 \
  --generate 12 --retentions 0.4 --heldout-data "$work/heldout" \
  --kvcapsule "tiled:0.4:$work/tiled.kvcap" --out "$work/out" >"$work/run.out" || fail "run"
grep -q "report.html" "$work/run.out" || fail "run did not print the report path"
for f in metrics.json metrics.csv report.html; do
  [ -s "$work/out/$f" ] || fail "$f missing"
done
python3 - "$work/out/metrics.json" <<'PY' || fail "metrics.json content"
import json, sys
m = json.load(open(sys.argv[1]))
runs = {r["id"]: r for r in m["runs"]}
policies = {r["policy"] for r in m["runs"]}
want = {"full", "streaming", "flashcache", "vlcache", "freekv", "kvcapsule", "composition"}
assert policies == want, policies
full = runs["full"]
assert full["token_agreement"] == 1.0 and full["nll_delta"] == 0.0, full
assert full["next_token_agreement"] == 1.0, full
# full reads every row it holds (and the generated ones); every policy reads less per step.
assert full["bytes_read_per_step"] >= full["bytes_held"], full
for r in m["runs"]:
    if r["policy"] != "full":
        assert r["bytes_read_per_step"] < full["bytes_read_per_step"], r["id"]
assert all(abs(c - 1.0) < 1e-6 for c in full["attn_cosine"]), full["attn_cosine"]
assert len(full["attn_cosine"]) == m["model"]["layers"] == 30
for r in m["runs"]:
    assert 0.0 <= r["token_agreement"] <= 1.0, r
    assert r["bytes_held"] > 0 and r["step_ms"] > 0, r
    if r["policy"] not in ("full", "freekv"):
        assert r["bytes_held"] < full["bytes_held"], r["id"]
    assert 0.0 <= r["next_token_agreement"] <= 1.0, r
    assert all(-1.0 <= c <= 1.0 + 1e-6 for c in r["attn_cosine"]), (r["id"], r["attn_cosine"])
    # Eviction keeps exact rows: its outputs stay close to full's on average.
    if r["policy"] in ("streaming", "flashcache", "vlcache", "freekv"):
        assert sum(r["attn_cosine"]) / len(r["attn_cosine"]) > 0.7, (r["id"], r["attn_cosine"])
assert len(m["masks"]) == 1 and len(m["masks"][0]["kept"]) == 30
print("metrics ok:", ", ".join(f'{r["id"]} {r["token_agreement"]:.2f}' for r in m["runs"]))
PY
[ "$failures" -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "eval pipeline ok"
