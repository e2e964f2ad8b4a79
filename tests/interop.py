#!/usr/bin/env python3
"""interop.py — kvcap's safetensors container layer against the reference implementation
(PyPI safetensors + numpy), both directions. Run by interop.sh: interop.py ST_TOOL WORKDIR.

(a) kvcap writes, Python reads: `st_tool write-reference` writes a fixed set of tensors (every
    kvcap dtype, scalars, zero-size tensors, metadata with UTF-8 and quotes). safetensors'
    safe_open must accept the file and return the metadata; every tensor's dtype, shape and
    raw bytes must equal (1) what Python reads, (2) what `st_tool dump` reports, and (3) the
    values computed here independently from decimal literals and numpy's own conversions.
    BF16: numpy has no bfloat16, and safetensors' numpy backend raises TypeError for it
    ("data type 'bfloat16' not understood"), so load_file cannot load this file whole. The
    BF16 tensor is then read from the raw file by parsing the header here (struct + json) and
    compared as uint16 bit patterns; every other tensor is read through safe_open.get_tensor.
    If a future backend does return BF16 arrays, they are compared too.
(b) Python writes, kvcap reads: safetensors.numpy.save_file writes every numpy dtype kvcap
    supports (float32, float16, float64, int32, uint8), including scalars, zero-size arrays and
    a rank-8 array, plus metadata; `st_tool dump` must report identical dtypes, shapes, bytes
    and metadata.
(c) The bad-file corpus (tests/data/bad/, see make_bad_files.py): the reference must reject
    every file except the few that break only kvcap's stricter rules (KVCAP_ONLY below), so
    each file is malformed for the reason it claims and not by accident.

Exit 0 on success, 1 with a message per mismatch.
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import safetensors
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

NP_TO_ST = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16", np.dtype("<f8"): "F64",
            np.dtype("<i4"): "I32", np.dtype("u1"): "U8"}

failures = []


def check(cond, what):
    if not cond:
        failures.append(what)
        print(f"MISMATCH: {what}", file=sys.stderr)


def reference_tensors():
    """name -> (dtype, shape, raw little-endian bytes), independent of kvcap's C code."""
    f32 = np.array([0.0, -0.0, 1.5, -2.25, 0.1, 3.4028234663852886e38,
                    1.1754943508222875e-38, -1.401298464324817e-45], dtype="<f4").reshape(2, 4)
    f64 = np.array([0.1, -1e300, 5e-324, -0.0, 12345.678], dtype="<f8")
    f16 = np.array([1.0, -2.5, 65504.0, 2.0 ** -24, -0.0, 1.0 / 3.0, np.inf, 2.0 ** -14],
                   dtype="<f2")
    # BF16 = the upper half of binary32; these values are exact in bf16, so truncation is exact.
    bf_vals = np.array([1.0, -2.5, float.fromhex("0x1.fep127"), 2.0 ** -133, -0.0,
                        0.333984375], dtype="<f4")
    bits = bf_vals.view("<u4")
    assert not np.any(bits & 0xFFFF), "bf16 reference values must be exact"
    bf16 = (bits >> 16).astype("<u2").reshape(2, 3)
    return {
        "f32": ("F32", (2, 4), f32.tobytes()),
        "f64": ("F64", (5,), f64.tobytes()),
        "f16": ("F16", (8,), f16.tobytes()),
        "bf16": ("BF16", (2, 3), bf16.tobytes()),
        "i32": ("I32", (5,), np.array([0, -1, 2 ** 31 - 1, -2 ** 31, 42], "<i4").tobytes()),
        "u8": ("U8", (3, 2), np.array([0, 1, 127, 128, 254, 255], "u1").tobytes()),
        "layer.0.scalar": ("F32", (), np.array(3.25, "<f4").tobytes()),
        "layer.0.i32_scalar": ("I32", (), np.array(-7, "<i4").tobytes()),
        "empty": ("F32", (0, 4), b""),
        "empty.u8": ("U8", (0,), b""),
    }


REFERENCE_META = {"kvcap.kind": "dataset", "note": 'h\u00e9llo "q"'}


def st_dump(st_tool, path):
    r = subprocess.run([st_tool, "dump", path], capture_output=True)
    if r.returncode != 0:
        check(False, f"st_tool dump {path} failed ({r.returncode}): "
                     f"{r.stderr.decode(errors='replace').strip()}")
        return None
    return json.loads(r.stdout.decode("utf-8"))


def raw_header(path):
    """(header dict, data buffer bytes), parsed here without safetensors."""
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    return json.loads(blob[8:8 + n].decode("utf-8")), blob[8 + n:], n


def compare_dump(dump, expected, meta, label):
    if dump is None:
        return
    check(dump["metadata"] == meta, f"{label}: st_tool metadata {dump['metadata']!r} != {meta!r}")
    check(set(dump["tensors"]) == set(expected),
          f"{label}: st_tool tensors {sorted(dump['tensors'])} != {sorted(expected)}")
    for name, (dt, shape, raw) in expected.items():
        got = dump["tensors"].get(name)
        if got is None:
            continue
        check(got["dtype"] == dt, f"{label}: '{name}' dtype {got['dtype']} != {dt}")
        check(tuple(got["shape"]) == tuple(shape),
              f"{label}: '{name}' shape {got['shape']} != {list(shape)}")
        check(got["hex"] == raw.hex(), f"{label}: '{name}' bytes {got['hex']} != {raw.hex()}")


def kvcap_writes(st_tool, work):
    path = os.path.join(work, "kvcap_reference.safetensors")
    if os.path.exists(path):
        os.unlink(path)
    r = subprocess.run([st_tool, "write-reference", path], capture_output=True)
    if r.returncode != 0:
        check(False, f"st_tool write-reference failed: {r.stderr.decode(errors='replace')}")
        return
    expected = reference_tensors()

    # The container as kvcap promises it (SPEC §1): 8 + N aligned, tensors aligned.
    header, data, n = raw_header(path)
    check((8 + n) % 8 == 0, f"(a) header length {n}: 8 + N is not a multiple of 8")
    for name, info in header.items():
        if name == "__metadata__":
            continue
        size = np.dtype({"F32": "f4", "F16": "f2", "BF16": "u2", "F64": "f8", "I32": "i4",
                         "U8": "u1"}[info["dtype"]]).itemsize
        check(info["data_offsets"][0] % size == 0, f"(a) '{name}' is not aligned in the file")

    # Python's reading.
    python_view = {}
    try:
        whole = load_file(path)
        for name, arr in whole.items():
            python_view[name] = arr
        print("(a) load_file read every tensor, BF16 included")
    except TypeError as e:
        print(f"(a) load_file cannot load BF16 with numpy ({e}); reading per tensor")
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata()
        check(meta == REFERENCE_META, f"(a) safe_open metadata {meta!r} != {REFERENCE_META!r}")
        keys = set(f.keys())
        check(keys == set(expected), f"(a) safe_open keys {sorted(keys)} != {sorted(expected)}")
        for name in sorted(keys):
            if name in python_view:
                continue
            try:
                python_view[name] = f.get_tensor(name)
            except TypeError as e:
                if header[name]["dtype"] != "BF16":
                    check(False, f"(a) safe_open could not read '{name}': {e}")

    for name, (dt, shape, raw) in expected.items():
        arr = python_view.get(name)
        if arr is not None:
            if dt == "BF16":
                got_raw = np.ascontiguousarray(arr).view("<u2").tobytes()
            else:
                check(NP_TO_ST.get(arr.dtype.newbyteorder("<")) == dt,
                      f"(a) '{name}': Python reads dtype {arr.dtype}, expected {dt}")
                got_raw = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()
            check(tuple(arr.shape) == shape, f"(a) '{name}': Python shape {arr.shape} != {shape}")
            check(got_raw == raw, f"(a) '{name}': Python bytes {got_raw.hex()} != {raw.hex()}")
        elif dt == "BF16":
            # No numpy bfloat16: the raw header parse is the Python-side reader here.
            info = header.get(name, {})
            b, e = info.get("data_offsets", (0, 0))
            check(info.get("dtype") == "BF16", f"(a) '{name}': header dtype {info.get('dtype')}")
            check(tuple(info.get("shape", ())) == shape, f"(a) '{name}': header shape")
            check(data[b:e] == raw, f"(a) '{name}': raw BF16 bytes {data[b:e].hex()} != "
                                    f"{raw.hex()}")
        else:
            check(False, f"(a) '{name}' was not read by Python")

    compare_dump(st_dump(st_tool, path), expected, REFERENCE_META, "(a)")


def python_writes(st_tool, work):
    rng = np.random.default_rng(20261121)
    arrays = {
        "f32": (rng.standard_normal((3, 5)) * 1e3).astype("<f4"),
        "f16": rng.standard_normal((7,)).astype("<f2"),
        "f64": rng.standard_normal((2, 3, 2)),
        "i32": rng.integers(-2 ** 31, 2 ** 31, size=(4, 3), dtype="<i4"),
        "u8": rng.integers(0, 256, size=(11,), dtype="u1"),
        "scalar.f32": np.array(-0.0, "<f4"),
        "scalar.f64": np.array(np.pi),
        "scalar.u8": np.array(200, "u1"),
        "empty.f32": np.zeros((0, 3), "<f4"),
        "empty.i32": np.zeros((5, 0), "<i4"),
        "empty.f16": np.zeros((0,), "<f2"),
        "rank8": np.arange(16, dtype="<i4").reshape(1, 2, 1, 2, 1, 2, 2, 1),
        "special.f32": np.array([np.inf, -np.inf, 1e-45, -3.4e38], "<f4"),
        "special.f16": np.array([np.inf, 6e-8, -65504, 0.1], "<f2"),
        "model.layers.10.self_attn.k_proj.weight": rng.standard_normal((2, 4)).astype("<f4"),
    }
    meta = {"kvcap.kind": "dataset", "note": 'h\u00e9llo "q" \\ \u2713 \u65e5\u672c',
            "empty": "", "multi\nline": "tab\there"}
    path = os.path.join(work, "python_written.safetensors")
    save_file(arrays, path, metadata=meta)
    expected = {name: (NP_TO_ST[a.dtype], a.shape, a.tobytes()) for name, a in arrays.items()}
    dump = st_dump(st_tool, path)
    compare_dump(dump, expected, meta, "(b)")
    if dump is not None:
        _, _, n = raw_header(path)
        check(dump["header_size"] == n, f"(b) st_tool header_size {dump['header_size']} != {n}")


# Valid safetensors, rejected only by kvcap's rules (SPEC §1: rank <= 8, names of 1..255 bytes
# without NUL, the six kvcap dtypes).
KVCAP_ONLY = {"bad_rank", "empty_name", "json_nul_escape", "long_name", "unknown_dtype"}


def reference_on_bad_corpus():
    bad_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "bad")
    names = sorted(f[:-len(".safetensors")] for f in os.listdir(bad_dir)
                   if f.endswith(".safetensors"))
    check(len(names) >= 17, f"(c) only {len(names)} files in {bad_dir}")
    for name in names:
        try:
            with safe_open(os.path.join(bad_dir, name + ".safetensors"), framework="numpy") as f:
                list(f.keys())
            accepted = True
        except Exception:  # SafetensorError and friends: any rejection counts
            accepted = False
        if name in KVCAP_ONLY:
            check(accepted, f"(c) {name}: expected valid for the reference (kvcap-only rule)")
        else:
            check(not accepted, f"(c) {name}: the reference accepts it; is it really malformed?")


def main():
    if len(sys.argv) != 3:
        print("usage: interop.py ST_TOOL WORKDIR", file=sys.stderr)
        return 2
    st_tool, work = sys.argv[1], sys.argv[2]
    os.makedirs(work, exist_ok=True)
    print(f"interop: numpy {np.__version__}, safetensors {safetensors.__version__}")
    kvcap_writes(st_tool, work)
    python_writes(st_tool, work)
    reference_on_bad_corpus()
    if failures:
        print(f"interop: {len(failures)} mismatch(es)", file=sys.stderr)
        return 1
    print("interop: kvcap -> safetensors and safetensors -> kvcap agree")
    return 0


if __name__ == "__main__":
    sys.exit(main())
