"""test_kvcap.py — the Python package over libkvcap: the version is the library's; `full`
attention through the cache equals attention computed here in float64 (NumPy), for strided and
float16 inputs and across prefill + generated tokens; statistics; and bad input — wrong dtype,
shape, device, closed objects, an artifact of another model — raises kvcap.Error naming the
problem and leaves the cache usable; kvcap.tools passes a tool's warnings on as Python
warnings."""

import math
import re
import warnings
from pathlib import Path

import numpy as np
import pytest

import kvcap

ROOT = Path(__file__).resolve().parents[2]

# f32 storage: the library's online softmax sums in f32 (a few ulps × sqrt(terms)); f16 storage
# is compared against attention over the f16-rounded K and V, so only the f32 sums differ.
ATTN_REL_TOL = 1e-5


def geometry(layers=2, q_heads=4, kv_heads=2, d=64):
    return kvcap.Geometry(layers=layers, q_heads=q_heads, kv_heads=kv_heads, head_dim=d,
                          rope="rope", pairing="half", theta=10000.0)


def reference(q, ks, vs):
    """Attention in float64: q [n_seqs][q_heads][d]; ks, vs per seq [kv_heads][n][d]."""
    n_seqs, q_heads, d = q.shape
    out = np.zeros(q.shape)
    lse = np.zeros(q.shape[:2])
    for s in range(n_seqs):
        k, v = ks[s].astype(np.float64), vs[s].astype(np.float64)
        g = q_heads // k.shape[0]
        for h in range(q_heads):
            sc = k[h // g] @ q[s, h].astype(np.float64) / math.sqrt(d)
            m = sc.max()
            w = np.exp(sc - m)
            out[s, h] = w @ v[h // g] / w.sum()
            lse[s, h] = m + math.log(w.sum())
    return out, lse


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def test_version_is_the_library_s():
    header = (ROOT / "include" / "kvcap.h").read_text()
    parts = [re.search(rf"#define KVCAP_VERSION_{p} (\d+)", header).group(1)
             for p in ("MAJOR", "MINOR", "PATCH")]
    assert kvcap.__version__ == ".".join(parts) == kvcap.version()


@pytest.mark.parametrize("storage", ["f32", "f16"])
def test_full_attention_matches_numpy(storage):
    rng = np.random.default_rng(1)
    g = geometry()
    n_seqs, n = 2, 37
    cache = kvcap.Cache(g, n_seqs=n_seqs, storage=storage, n_threads=2)
    ks, vs = {}, {}
    for s in range(n_seqs):
        for layer in range(g.layers):
            # NHD layout [tokens][heads][d] handed over as a strided [heads][tokens][d] view
            k = rng.standard_normal((n, g.kv_heads, g.head_dim)).astype(np.float32)
            v = rng.standard_normal((n, g.kv_heads, g.head_dim)).astype(np.float32)
            cache.add_span(s, layer, k.transpose(1, 0, 2), v.transpose(1, 0, 2), kind="text")
            if layer == 1:
                ks[s], vs[s] = k.transpose(1, 0, 2), v.transpose(1, 0, 2)
    # one generated token per sequence, float16 input
    for s in range(n_seqs):
        for layer in range(g.layers):
            k1 = rng.standard_normal((g.kv_heads, g.head_dim)).astype(np.float16)
            v1 = rng.standard_normal((g.kv_heads, g.head_dim)).astype(np.float16)
            cache.append(s, layer, k1, v1)
            if layer == 1:
                ks[s] = np.concatenate([ks[s], k1[:, None].astype(np.float32)], axis=1)
                vs[s] = np.concatenate([vs[s], v1[:, None].astype(np.float32)], axis=1)
    if storage == "f16":
        ks = {s: x.astype(np.float16).astype(np.float32) for s, x in ks.items()}
        vs = {s: x.astype(np.float16).astype(np.float32) for s, x in vs.items()}
    q = rng.standard_normal((n_seqs, g.q_heads, g.head_dim)).astype(np.float32)
    out, lse = cache.attend_lse(1, q)
    want, want_lse = reference(q, ks, vs)
    assert rel(out, want) <= ATTN_REL_TOL
    assert np.allclose(lse, want_lse, rtol=ATTN_REL_TOL, atol=ATTN_REL_TOL)
    st = cache.stats()
    assert st["tokens_by_kind"]["text"] == n_seqs * n
    assert st["tokens_by_kind"]["generated"] == n_seqs
    assert st["bytes_by_policy"]["full"] == st["bytes_held"] > 0
    cache.close()


def test_bad_input_raises_and_leaves_the_cache_usable():
    g = geometry(layers=1)
    cache = kvcap.Cache(g, storage="f32")
    k = np.ones((g.kv_heads, 8, g.head_dim), np.float32)
    with pytest.raises(kvcap.Error) as e:
        cache.add_span(0, 0, k.astype(np.float64), k)
    assert e.value.status_name == "INVALID_ARGUMENT" and "float64" in e.value.message
    with pytest.raises(kvcap.Error) as e:
        cache.add_span(0, 0, k[:1], k)
    assert "shape" in e.value.message and "kv_heads" in e.value.message
    with pytest.raises(kvcap.Error) as e:
        cache.add_span(0, 5, k, k)  # the library's own check
    assert e.value.status_name == "INVALID_ARGUMENT" and "layer" in e.value.message
    bad = k.copy()
    bad[1, 3, 7] = np.nan
    with pytest.raises(kvcap.Error) as e:
        cache.add_span(0, 0, bad, k)
    assert e.value.status_name == "NUMERIC" and "token 3" in e.value.message
    with pytest.raises(kvcap.Error) as e:
        cache.attend(0, np.zeros((1, g.q_heads, g.head_dim), np.float64))
    assert "float32" in e.value.message
    # still usable: a good span, then attention over it
    cache.add_span(0, 0, k, k)
    out = cache.attend(0, np.zeros((1, g.q_heads, g.head_dim), np.float32))
    assert np.allclose(out, 1.0)
    cache.close()
    with pytest.raises(kvcap.Error) as e:
        cache.attend(0, np.zeros((1, g.q_heads, g.head_dim), np.float32))
    assert e.value.status_name == "STATE"


def test_config_and_geometry_errors_name_the_field(tmp_path):
    with pytest.raises(kvcap.Error) as e:
        geometry(q_heads=3).validate()
    assert e.value.status_name == "GEOMETRY" or "q_heads" in e.value.message
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("policies: {vision: nonsense}\n")
    with pytest.raises(kvcap.Error) as e:
        kvcap.Cache(geometry(), config=cfg)
    assert e.value.status_name == "CONFIG" and "bad.yaml:1" in e.value.message
    with pytest.raises(kvcap.Error) as e:  # the YAML text itself: named by line and column
        kvcap.Cache(geometry(), config_yaml="fallback: full\npolicies: {vision: nonsense}\n")
    assert e.value.status_name == "CONFIG" and "params.config_yaml:2" in e.value.message
    with pytest.raises(kvcap.Error) as e:
        kvcap.Cache(geometry(), config=cfg, config_yaml="policies: {vision: full}\n")
    assert e.value.status_name == "INVALID_ARGUMENT" and "config_yaml" in e.value.message
    with pytest.raises(kvcap.Error) as e:
        kvcap.Cache(geometry(), storage="f8")
    assert "storage" in e.value.message


@pytest.mark.parametrize("given", ["path", "text"])
def test_streaming_policy_from_the_runtime_config(tmp_path, given):
    text = ("policies: {vision: full, text: streaming, generated: full}\n"
            "streaming: {sinks: 2, window: 4}\n")
    cfg = tmp_path / "runtime.yaml"
    cfg.write_text(text)
    g = geometry(layers=1)
    cache = (kvcap.Cache(g, storage="f32", config=cfg) if given == "path"
             else kvcap.Cache(g, storage="f32", config_yaml=text))
    rng = np.random.default_rng(3)
    k = rng.standard_normal((g.kv_heads, 20, g.head_dim)).astype(np.float32)
    v = rng.standard_normal((g.kv_heads, 20, g.head_dim)).astype(np.float32)
    cache.add_span(0, 0, k, v)
    q = rng.standard_normal((1, g.q_heads, g.head_dim)).astype(np.float32)
    out = cache.attend(0, q)
    keep = np.r_[0:2, 16:20]  # sinks + window
    want, _ = reference(q, {0: k[:, keep]}, {0: v[:, keep]})
    assert rel(out, want) <= ATTN_REL_TOL
    assert cache.stats()["bytes_by_policy"]["streaming"] > 0


def test_artifact_errors(tmp_path):
    with pytest.raises(kvcap.Error) as e:
        kvcap.Artifact(tmp_path / "missing.kvcap")
    assert e.value.status_name == "IO" and "missing.kvcap" in e.value.message
    junk = tmp_path / "junk.kvcap"
    junk.write_bytes(b"\x01\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(kvcap.Error) as e:
        kvcap.Artifact(junk)
    assert "junk.kvcap" in e.value.message


def test_torch_tensors_in_place_when_torch_is_present():
    torch = pytest.importorskip("torch")
    g = geometry(layers=1)
    cache = kvcap.Cache(g, storage="f32")
    k = torch.randn(g.kv_heads, 8, g.head_dim)
    cache.add_span(0, 0, k, k)
    q = torch.randn(1, g.q_heads, g.head_dim)
    out = cache.attend(0, q)
    want, _ = reference(q.numpy(), {0: k.numpy()}, {0: k.numpy()})
    assert rel(out, want) <= ATTN_REL_TOL
    # bfloat16 tensors are read in place too (NumPy has no bfloat16)
    cb = kvcap.Cache(g, storage="bf16")
    cb.add_span(0, 0, k.to(torch.bfloat16), k.to(torch.bfloat16))
    assert rel(cb.attend(0, q), want) <= 2e-2  # bf16 storage: 8 mantissa bits
    with pytest.raises(kvcap.Error, match="dtype torch.int32"):
        cache.add_span(0, 0, k.to(torch.int32), k)
    with pytest.raises(kvcap.Error, match="shape"):
        cache.add_span(0, 0, k[:, :, :-1], k[:, :, :-1])
    assert rel(cache.attend(0, q), want) <= ATTN_REL_TOL  # still usable


def test_convert_warns_of_a_value_basis_without_structure(tmp_path):
    """kvcap.tools.convert issues kvcap-convert's warnings as Python warnings: on the tiny test
    state the 2x2 grid's DCT basis keeps none of the values' variance at rank 2 of 4 (random
    directions keep half), the calibrated basis all of it."""
    import kvcap.tools
    try:
        kvcap.tools.find("kvcap-convert")
    except kvcap.Error as e:
        pytest.skip(e.message)
    state = ROOT / "tests/data/schema/good_calib.safetensors"
    with pytest.warns(UserWarning, match=r"keeps 0 % .* random directions 50 %: these spans"):
        kvcap.tools.convert(state, tmp_path / "dct.kvcap", value_basis="dct")
    assert (tmp_path / "dct.kvcap").is_file()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kvcap.tools.convert(state, tmp_path / "pca.kvcap")
