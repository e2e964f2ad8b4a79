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


def artifact_tensors(mask=(0, 2), m=4, rv=2, h=2, drop=None, heads=1, sizes=None):
    """sizes: {(layer, head): (rv, h)} overriding the map sizes of single units."""
    ts = []
    for l in range(2):
        for kv in range(heads):
            p = "l%d.h%d.b0." % (l, kv)
            urv, uh = (sizes or {}).get((l, kv), (rv, h))
            ts += [(p + "U", "F32", [urv, m], f32([0.5] * (urv * m))),
                   (p + "k_mask", "I32", [len(mask)], i32(list(mask))),
                   (p + "k_w1", "F32", [len(mask), uh], f32([0.1] * (len(mask) * uh))),
                   (p + "k_b1", "F32", [uh], f32([0.0] * uh)),
                   (p + "k_w2", "F32", [uh, m], f32([0.2] * (uh * m))),
                   (p + "k_b2", "F32", [m], f32([0.0] * m))]
    return [t for t in ts if t[0] != drop]


def poison(ts, name, index, fmt="<f"):
    """ts with element `index` of tensor `name` replaced by a NaN."""
    out = []
    for t in ts:
        if t[0] == name:
            size = struct.calcsize(fmt)
            data = t[3][:index * size] + struct.pack(fmt, float("nan")) + t[3][(index + 1) * size:]
            t = (t[0], t[1], t[2], data)
        out.append(t)
    return out


def artifact_config(model=MODEL, **over):
    art = {"storage": "f32", "activation": "gelu", "fallback": "flashcache",
           "schedule": {"keys": [0.5, 0.5], "values": [0.5, 0.5]}}
    art.update(over)
    return {"model": model, "buckets": BUCKETS, "artifact": art}


def calib_tensors(drop=None):
    ts = []
    for l in range(2):
        p = "l%d.h0.b0." % l
        ts += [(p + "v_gram", "F64", [4, 4], struct.pack("<16d", *([1.0] * 16))),
               (p + "k_gram", "F64", [4, 4], struct.pack("<16d", *([2.0] * 16)))]
    return [t for t in ts if t[0] != drop]


FIT = {"keys_method": "closed_form", "activation": "linear", "hidden": 0, "ridge": 0.001,
       "storage": "F16", "schedule": {"keys": [0.5, 0.5], "values": [0.5, 0.5]}}
CALIB_CONFIG = {"model": MODEL, "buckets": BUCKETS, "calib": {"spans": [[9, 1]], "fit": FIT}}


def calib_config(spans=None, drop_fit=False, **fit):
    calib = {"spans": spans or [[9, 1]]}
    if not drop_fit:
        calib["fit"] = dict(FIT, **fit)
    return {"model": MODEL, "buckets": BUCKETS, "calib": calib}


def with_number(meta_dict, old, new):
    """Replaces the JSON text `old` by `new` in kvcap.config (numbers json.dumps cannot write,
    such as 1e999, which a JSON reader takes as infinity)."""
    assert meta_dict["kvcap.config"].count(old) == 1
    meta_dict["kvcap.config"] = meta_dict["kvcap.config"].replace(old, new)
    return meta_dict


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

    # Files each reader used to accept and a later consumer refused (the runtime at prefill,
    # kvcap-convert), or read with an undefined conversion: one validator now refuses them.
    write("bad_theta_inf.safetensors", dataset_tensors(),
          with_number(meta("dataset", dataset_config()), '"theta": 10000.0', '"theta": 1e999'))
    geo = dict(MODEL, kv_heads=2)
    write("bad_artifact_head_h.safetensors", artifact_tensors(heads=2, sizes={(0, 1): (2, 3)}),
          meta("artifact", artifact_config(model=geo)))
    write("bad_artifact_head_rv.safetensors", artifact_tensors(heads=2, sizes={(1, 1): (1, 2)}),
          meta("artifact", artifact_config(model=geo)))
    write("bad_artifact_nan.safetensors", poison(artifact_tensors(), "l1.h0.b0.k_b2", 1),
          meta("artifact", artifact_config()))
    write("bad_calib_no_fit.safetensors", calib_tensors(), meta("calib", calib_config(drop_fit=True)))
    write("bad_calib_hidden.safetensors", calib_tensors(), meta("calib", calib_config(hidden=2.5)))
    write("bad_calib_hidden_huge.safetensors", calib_tensors(),
          meta("calib", calib_config(hidden=1e300)))
    write("bad_calib_ridge_inf.safetensors", calib_tensors(),
          with_number(meta("calib", calib_config()), '"ridge": 0.001', '"ridge": 1e999'))
    write("bad_calib_storage.safetensors", calib_tensors(), meta("calib", calib_config(storage="I32")))
    write("bad_calib_spans.safetensors", calib_tensors(), meta("calib", calib_config(spans=[[9.5, 1]])))
    write("bad_calib_gram_nan.safetensors", poison(calib_tensors(), "l0.h0.b0.v_gram", 5, "<d"),
          meta("calib", CALIB_CONFIG))


if __name__ == "__main__":
    main()
