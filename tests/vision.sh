#!/bin/sh
# vision.sh SOURCE_DIR WORK_DIR — scripts/vision_features.py on 3 photos with a few crops: two runs
# give byte-identical files with the shapes, boxes and metadata formats/SPEC.md section 7 gives;
# a third run keeps the up-to-date files; adding a test photo leaves the other photos' crops as
# they were. Also --help and named usage errors. Uses the Python in
# $KVCAP_PYTHON; skipped (77) when it lacks onnxruntime/pillow/onnx (bash scripts/setup-python.sh
# --vision) or when the encoder or the photos are not cached (bash scripts/fetch-vision.sh).
set -u
src=$1 work=$2
rm -rf "$work" && mkdir -p "$work"
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }

py=${KVCAP_PYTHON:-}
[ -n "$py" ] || py=$(command -v python3 || true)
if [ -z "$py" ]; then
  echo "SKIP: no python (bash scripts/setup-python.sh --vision makes one)"
  exit 77
fi
script="$src/scripts/vision_features.py"

# Argument errors come before any heavy import, so they are checked with any python.
"$py" "$script" --help | grep -q "features-g16.safetensors" || fail "--help"
"$py" "$script" --photos no-such-photo --out "$work/x" >"$work/badphoto.out" 2>&1; rc=$?
[ "$rc" -eq 2 ] && grep -q "not in .*vision-photos.tsv: no-such-photo" "$work/badphoto.out" ||
  fail "unknown --photos: exit $rc"
"$py" "$script" --crops16 -1 --out "$work/x" >"$work/badcrops.out" 2>&1; rc=$?
[ "$rc" -eq 2 ] && grep -q -- "--crops16" "$work/badcrops.out" || fail "negative --crops16: exit $rc"

if ! "$py" -c "import numpy, safetensors.numpy, onnxruntime, PIL.Image, onnx" 2>/dev/null; then
  [ "$failures" -eq 0 ] || exit 1
  echo "SKIP: vision features need python with onnxruntime, pillow and onnx ($py has not;" \
       "bash scripts/setup-python.sh --vision installs them)"
  exit 77
fi

cache=${KVCAP_CACHE:-$HOME/.cache/kvcap}
photos="mate-greenmeadow,skimage-astronaut,skimage-coffee"
for f in models/vit_s_focus.onnx images/mate-greenmeadow.jpg images/skimage-astronaut.png \
         images/skimage-coffee.png; do
  if [ ! -f "$cache/$f" ]; then
    [ "$failures" -eq 0 ] || exit 1
    echo "SKIP: $cache/$f not found (bash scripts/fetch-vision.sh fetches the encoder and photos)"
    exit 77
  fi
done
"$py" "$script" --model "$work/missing.onnx" --photos "$photos" --out "$work/x" >"$work/nomodel.out" 2>&1; rc=$?
[ "$rc" -eq 1 ] && grep -q "missing.onnx not found (bash scripts/fetch-vision.sh" "$work/nomodel.out" ||
  fail "missing model: exit $rc"

run() {
  "$py" "$script" --photos "$photos" --crops16 6 --crops32 2 "$@"
}
run --out "$work/a" 2>"$work/a.err" || fail "run a ($(cat "$work/a.err"))"
run --out "$work/b" --threads 2 -q 2>"$work/b.err" || fail "run b ($(cat "$work/b.err"))"
for g in 16 32; do
  cmp -s "$work/a/features-g$g.safetensors" "$work/b/features-g$g.safetensors" ||
    fail "features-g$g.safetensors differs between two runs"
done
grep -q "wrote $work/a/features-g16.safetensors: 6 crops x 256 tokens x 384" "$work/a.err" ||
  fail "run a did not report the g16 file"
run --out "$work/a" 2>"$work/c.err" || fail "run c"
grep -q "features-g16.safetensors is up to date (6 crops)" "$work/c.err" &&
  grep -q "features-g32.safetensors is up to date (2 crops)" "$work/c.err" || fail "up-to-date files were not kept"
run --out "$work/a" --crops16 5 --crops32 0 -q 2>"$work/d.err" || fail "run d"
"$py" - "$work/a" "$work/b" <<'PY' || fail "file content"
import json, sys
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

ids = ["mate-greenmeadow", "skimage-astronaut", "skimage-coffee"]
sizes = [(1280, 1024), (512, 512), (600, 400)]
# The documented crop rule, worked by hand for these photos (x0, y0, w, h).
want_boxes = {
    16: [[0, 0, 1024, 1024], [384, 0, 512, 512], [0, 0, 512, 512], [0, 0, 256, 256],
         [0, 0, 400, 400], [200, 0, 400, 400]],
    32: [[0, 0, 1024, 1024], [0, 0, 512, 512]],
}
for g, n, path in ((16, 5, sys.argv[1] + "/features-g16.safetensors"),
                   (16, 6, sys.argv[2] + "/features-g16.safetensors"),
                   (32, 2, sys.argv[2] + "/features-g32.safetensors")):
    t = load_file(path)
    with safe_open(path, "np") as f:
        md = f.metadata()
    assert sorted(t) == ["box", "features", "photo", "thumb"], sorted(t)
    assert t["features"].dtype == np.float16 and t["features"].shape == (n, g * g, 384), t["features"].shape
    assert t["photo"].dtype == np.int32 and t["photo"].shape == (n,), t["photo"]
    assert t["box"].dtype == np.int32 and t["box"].shape == (n, 4)
    assert t["thumb"].dtype == np.uint8 and t["thumb"].shape == (n, 64, 64, 3)
    assert t["box"].tolist() == want_boxes[g][:n], (g, t["box"].tolist())
    assert (np.diff(t["photo"]) >= 0).all() and t["photo"].min() >= 0, t["photo"]
    for p, (x0, y0, w, h) in zip(t["photo"], t["box"]):
        W, H = sizes[p]
        assert w == h >= 14 * g and 0 <= x0 <= W - w and 0 <= y0 <= H - h, (p, x0, y0, w)
    feats = t["features"].astype(np.float32)
    assert np.isfinite(feats).all() and feats.std() > 0.1
    # Real image tokens: neighbouring patches are alike.
    x = feats / np.linalg.norm(feats, axis=2, keepdims=True)
    grid = x.reshape(n, g, g, 384)
    assert (grid[:, :, 1:] * grid[:, :, :-1]).sum(-1).mean() > 0.5
    assert json.loads(md["vision.photos"]) == ids, md["vision.photos"]
    # each photo's split, the manifest's last column
    assert json.loads(md["vision.splits"]) == ["calibration"] * 3, md
    assert json.loads(md["vision.crops"])["test_count"] == 0, md["vision.crops"]  # no test photo
    assert md["vision.grid"] == str(g) and md["vision.input_px"] == str(14 * g), md
    assert md["vision.encoder_sha256"] == "198644e37de36674974f453a9aebfc0120b168b9414cce18d4dceb576fbdf355"
    assert json.loads(md["vision.crops"])["count"] == n
    pre = json.loads(md["vision.preprocess"])
    assert pre["mean"] == [0.485, 0.456, 0.406] and pre["std"] == [0.229, 0.224, 0.225], pre
    for k in ("vision.script_version", "vision.manifest_sha256", "vision.tokens", "vision.runtime"):
        assert md.get(k), k
print("vision files ok")
PY
# --crops16 5 replaced the g16 file; --crops32 0 left the g32 file alone.
cmp -s "$work/a/features-g32.safetensors" "$work/b/features-g32.safetensors" || fail "--crops32 0 touched the g32 file"
for f in "$work"/a/*.tmp.*; do
  [ -e "$f" ] && fail "a temporary file was left: $f"
done

# A test photo gets crops of its own (--test-crops16) and changes no other photo's: the same
# photo's crops, boxes and features with and without it.
if [ -f "$cache/images/sklearn-china.jpg" ]; then
  "$py" "$script" --photos mate-greenmeadow,sklearn-china --crops16 2 --test-crops16 1 --crops32 0 \
    --test-crops32 0 -q --out "$work/t" 2>"$work/t.err" || fail "run with a test photo ($(cat "$work/t.err"))"
  "$py" "$script" --photos mate-greenmeadow --crops16 2 --crops32 0 -q --out "$work/u" \
    2>"$work/u.err" || fail "run without it ($(cat "$work/u.err"))"
  "$py" - "$work/t/features-g16.safetensors" "$work/u/features-g16.safetensors" <<'PY' || fail "test photo"
import json, sys
import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

t, u = load_file(sys.argv[1]), load_file(sys.argv[2])
with safe_open(sys.argv[1], "np") as f:
    md = f.metadata()
assert json.loads(md["vision.photos"]) == ["mate-greenmeadow", "sklearn-china"], md
assert json.loads(md["vision.splits"]) == ["calibration", "test"], md
crops = json.loads(md["vision.crops"])
assert crops["count"] == 2 and crops["test_count"] == 1, crops
assert t["photo"].tolist() == [0, 0, 1], t["photo"]
# china.jpg is 640 x 427: its one crop is the 427 px square nearest the centre (a tie: the first)
assert t["box"].tolist() == u["box"].tolist() + [[0, 0, 427, 427]], t["box"]
for k in ("features", "thumb"):
    assert np.array_equal(t[k][:2], u[k]), k
print("test photo ok")
PY
else
  echo "note: $cache/images/sklearn-china.jpg not cached (bash scripts/fetch-vision.sh); test-photo check skipped"
fi
[ "$failures" -eq 0 ] || { echo "$failures failure(s)"; exit 1; }
echo "vision features ok"
