#!/usr/bin/env python3
"""Writes the kvcap-schema test corpus into tests/data/schema/ (python3 stdlib only).

good_*.safetensors are minimal valid files of each kind; bad_*.safetensors each break exactly
one schema rule (formats/SPEC.md §2-6). The container itself is always valid here: container
failures live in tests/data/bad/. tests/test_schema.c lists each bad file with the status and
the field its error must name. Re-run after changing the spec; the outputs are committed.
"""
import json
import os
import struct

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "schema")

MODEL = {"name": "tiny", "layers": 2, "q_heads": 2, "kv_heads": 1, "head_dim": 64,
         "rope": {"type": "rope", "pairing": "half", "theta": 10000.0, "dim": 64}}
D = 64


def f32(values):
    return struct.pack("<%df" % len(values), *values)


def i32(values):
    return struct.pack("<%di" % len(values), *values)


def write(name, tensors, meta):
    """tensors: list of (name, dtype, shape, bytes); laid out contiguously, header padded."""
    header = {"__metadata__": meta} if meta is not None else {}
    offset = 0
    for tname, dtype, shape, data in tensors:
        header[tname] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - (8 + len(text)) % 8) % 8)
    with open(os.path.join(OUT, name), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(t[3] for t in tensors))


def meta(kind, config, version="1"):
    m = {"kvcap.kind": kind, "kvcap.format_version": version}
    if config is not None:
        m["kvcap.config"] = json.dumps(config)
    return m


def dataset_tensors(rows=2, cols=2, p0=5, layers=2, queries=True):
    n = rows * cols
    ts = [("s0.grid", "I32", [3], i32([rows, cols, p0]))]
    for l in range(layers):
        kv = f32([((l + 1) * 0.01 * i) % 1.0 for i in range(n * D)])
        ts.append(("s0.l%d.k" % l, "F32", [1, n, D], kv))
        ts.append(("s0.l%d.v" % l, "F32", [1, n, D], kv))
        if queries:
            ts.append(("s0.l%d.q_dec" % l, "F32", [2, 3, D], f32([0.5] * (2 * 3 * D))))
    return ts


def dataset_config(spans=1, model=MODEL):
    return {"model": model, "dataset": {"spans": spans, "source": "handcrafted test file"},
            "provenance": {"tool": "make_schema_files.py"}}


BUCKETS = [{"rows": 2, "cols": 2, "structure": "dense"}]


def artifact_tensors(mask=(0, 2), m=4, rv=2, h=2, drop=None):
    ts = []
    for l in range(2):
        p = "l%d.h0.b0." % l
        ts += [(p + "U", "F32", [rv, m], f32([0.5] * (rv * m))),
               (p + "k_mask", "I32", [len(mask)], i32(list(mask))),
               (p + "k_w1", "F32", [len(mask), h], f32([0.1] * (len(mask) * h))),
               (p + "k_b1", "F32", [h], f32([0.0] * h)),
               (p + "k_w2", "F32", [h, m], f32([0.2] * (h * m))),
               (p + "k_b2", "F32", [m], f32([0.0] * m))]
    return [t for t in ts if t[0] != drop]


def artifact_config(**over):
    art = {"storage": "f32", "activation": "gelu", "fallback": "flashcache",
           "schedule": {"keys": [0.5, 0.5], "values": [0.5, 0.5]}}
    art.update(over)
    return {"model": MODEL, "buckets": BUCKETS, "artifact": art}


def calib_tensors(drop=None):
    ts = []
    for l in range(2):
        p = "l%d.h0.b0." % l
        ts += [(p + "v_gram", "F64", [4, 4], struct.pack("<16d", *([1.0] * 16))),
               (p + "k_gram", "F64", [4, 4], struct.pack("<16d", *([2.0] * 16)))]
    return [t for t in ts if t[0] != drop]


CALIB_CONFIG = {"model": MODEL, "buckets": BUCKETS, "calib": {"spans": [[9, 1]]}}


def main():
    os.makedirs(OUT, exist_ok=True)
    write("good_dataset.safetensors", dataset_tensors(), meta("dataset", dataset_config()))
    write("good_artifact.safetensors", artifact_tensors(), meta("artifact", artifact_config()))
    write("good_calib.safetensors", calib_tensors(), meta("calib", CALIB_CONFIG))

    write("bad_no_metadata.safetensors", dataset_tensors(), None)
    write("bad_no_kind.safetensors", dataset_tensors(),
          {"kvcap.format_version": "1", "kvcap.config": json.dumps(dataset_config())})
    write("bad_unknown_kind.safetensors", dataset_tensors(), meta("weights", dataset_config()))
    write("bad_version_newer.safetensors", dataset_tensors(), meta("dataset", dataset_config(), "99"))
    write("bad_version_garbage.safetensors", dataset_tensors(), meta("dataset", dataset_config(), "1a"))
    write("bad_no_config.safetensors", dataset_tensors(), meta("dataset", None))
    bad = meta("dataset", None)
    bad["kvcap.config"] = "{not json"
    write("bad_config_json.safetensors", dataset_tensors(), bad)
    geo = dict(MODEL, head_dim=100)
    write("bad_head_dim.safetensors", dataset_tensors(), meta("dataset", dataset_config(model=geo)))
    geo = dict(MODEL, q_heads=3, kv_heads=2)
    write("bad_gqa.safetensors", dataset_tensors(), meta("dataset", dataset_config(model=geo)))
    write("bad_missing_value.safetensors",
          [t for t in dataset_tensors() if t[0] != "s0.l1.v"], meta("dataset", dataset_config()))
    ts = dataset_tensors()
    ts[1] = ("s0.l0.k", "F32", [1, 2, 2 * D], ts[1][3])
    write("bad_key_shape.safetensors", ts, meta("dataset", dataset_config()))
    ts = dataset_tensors()
    ts[2] = ("s0.l0.v", "F16", [1, 4, D * 2], ts[2][3])
    write("bad_value_dtype.safetensors", ts, meta("dataset", dataset_config()))
    write("bad_span_count.safetensors", dataset_tensors(), meta("dataset", dataset_config(spans=2)))
    ts = dataset_tensors(queries=True)
    ts = [t for t in ts if t[0] != "s0.l1.q_dec"]
    write("bad_queries_partial.safetensors", ts, meta("dataset", dataset_config()))

    write("bad_artifact_missing_w2.safetensors", artifact_tensors(drop="l1.h0.b0.k_w2"),
          meta("artifact", artifact_config()))
    write("bad_artifact_mask_order.safetensors", artifact_tensors(mask=(2, 0)),
          meta("artifact", artifact_config()))
    write("bad_artifact_schedule.safetensors", artifact_tensors(),
          meta("artifact", artifact_config(schedule={"keys": [0.5], "values": [0.5, 0.5]})))
    write("bad_artifact_storage.safetensors", artifact_tensors(),
          meta("artifact", artifact_config(storage="f16")))
    cfg = artifact_config()
    cfg["buckets"] = [{"rows": 2, "cols": 2, "structure": "tiled", "tile": [3, 1]}]
    write("bad_artifact_tile.safetensors", artifact_tensors(), meta("artifact", cfg))
    write("bad_calib_missing_gram.safetensors", calib_tensors(drop="l1.h0.b0.k_gram"),
          meta("calib", CALIB_CONFIG))


if __name__ == "__main__":
    main()
