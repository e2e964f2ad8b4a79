#!/bin/sh
# splits.sh SOURCE_DIR — the evaluation data's splits, from the manifests alone (nothing is
# downloaded): scripts/vision-photos.tsv's calibration, development and test photos are
# disjoint (no id, file or package path in two, nor twice in one), the photos from before the
# test split keep the split they always had (index % 4 == 3 development) and the test photos
# come after them (so no earlier photo's index moves); scripts/eval-texts.tsv's test documents
# are none of kvcap-eval's calibration or development documents, and no two are the same text.
set -u
src=$1
py=$(command -v python3 || true)
if [ -z "$py" ]; then
  echo "SKIP: no python3"
  exit 77
fi
"$py" - "$src" <<'PY'
import hashlib, os, re, sys

src = sys.argv[1]
fails = []
def check(ok, what):
    if not ok:
        fails.append(what)

def rows(path, ncols):
    out = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line or line.startswith("#"):
                continue
            cols = line.split("\t")
            check(len(cols) == ncols, f"{path}:{n}: {len(cols)} columns, expected {ncols}")
            out.append(cols)
    return out

# --- photos ----------------------------------------------------------------------------------
photos = rows(os.path.join(src, "scripts", "vision-photos.tsv"), 8)
splits = [p[-1] for p in photos]
check(set(splits) == {"calibration", "development", "test"}, f"photo splits {sorted(set(splits))}")
for key, name in ((0, "id"), (3, "sha256")):
    seen = {}
    for p in photos:
        check(p[key] not in seen, f"photo {name} {p[key]} in {seen.get(p[key])} and {p[0]}")
        seen[p[key]] = p[0]
seen = {}
for p in photos:  # the same file of a package, at any version
    where = (p[1].split("=")[0], p[2])
    check(where not in seen, f"photo {p[0]}: {where} is {seen.get(where)}'s file")
    seen[where] = p[0]
first_test = splits.index("test") if "test" in splits else len(splits)
check(all(s == "test" for s in splits[first_test:]), "a non-test photo after the first test photo")
for i, s in enumerate(splits[:first_test]):
    check(s == ("development" if i % 4 == 3 else "calibration"),
          f"photo {photos[i][0]} (index {i}) is {s}: photos before the test split keep index % 4")
by = {s: sum(1 for x in splits if x == s) for s in ("calibration", "development", "test")}
check(by["test"] >= 8, f"{by['test']} test photos, fewer than 8")

# --- texts -----------------------------------------------------------------------------------
texts = rows(os.path.join(src, "scripts", "eval-texts.tsv"), 7)
main = open(os.path.join(src, "eval", "options.c"), encoding="utf-8").read()
docs = {}
for macro, split in (("DEFAULT_CALIB_DOCS", "calibration"), ("DEFAULT_HELDOUT_DOCS", "development")):
    m = re.search(r'#define %s "([^"]*)"' % macro, main)
    check(m is not None, f"options.c: no {macro}")
    for d in (m.group(1).split(",") if m else []):
        docs[d] = split
check(len(texts) >= 1, "no test document")
for key, name in ((0, "id"), (3, "file sha256"), (4, "text sha256")):
    seen = set()
    for t in texts:
        check(t[key] not in seen, f"test document {name} {t[key]} twice")
        seen.add(t[key])
for t in texts:
    check(t[0].lower() not in {d.lower() for d in docs},
          f"test document {t[0]} is a {docs.get(t[0], 'calibration or development')} document")
# the development and calibration texts themselves, where this machine has them
licenses = "/usr/share/common-licenses"
for d, split in docs.items():
    path = os.path.join(licenses, d)
    if os.path.isfile(path):
        h = hashlib.sha256(open(path, "rb").read()).hexdigest()
        for t in texts:
            check(h not in (t[3], t[4]), f"test document {t[0]} is the {split} document {d}")

for f in fails:
    print("FAIL:", f)
if fails:
    sys.exit(1)
print(f"splits ok: photos {by['calibration']} calibration, {by['development']} development, "
      f"{by['test']} test; {len(texts)} test documents")
PY
