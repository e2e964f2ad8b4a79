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


# ---- Artifacts held by their caches -------------------------------------------------------------

def tiny_artifact(tmp_path):
    """A 2x2-bucket artifact of tests/data/schema/good_calib.safetensors (2 layers, 2 query
    heads over 1 KV head of 64 channels), converted here; skips without kvcap-convert."""
    import kvcap.tools
    try:
        kvcap.tools.find("kvcap-convert")
    except kvcap.Error as e:
        pytest.skip(e.message)
    return kvcap.tools.convert(ROOT / "tests/data/schema/good_calib.safetensors",
                               tmp_path / "tiny.kvcap")


KVCAPSULE = "policies: {vision: kvcapsule, text: full, generated: full}\n"


def test_cache_keeps_working_after_its_artifact_is_closed(tmp_path):
    """Closing an Artifact (or leaving its `with` block) while a cache uses it: the cache holds
    the library's artifact and attends as one whose Artifact stayed open; closing twice is
    fine; a closed Artifact given to a new cache is an error naming its file."""
    path = tiny_artifact(tmp_path)
    g = geometry(layers=2, q_heads=2, kv_heads=1)
    rng = np.random.default_rng(11)
    k = rng.standard_normal((2, 1, 4, 64)).astype(np.float32)  # per layer [kv][2x2][d]
    v = rng.standard_normal((2, 1, 4, 64)).astype(np.float32)
    q = rng.standard_normal((1, 2, 64)).astype(np.float32)

    def run(cache):
        for layer in range(2):
            cache.add_span(0, layer, k[layer], v[layer], kind="vision", grid=(2, 2))
        out = cache.attend(1, q)
        assert cache.stats()["bytes_by_policy"]["kvcapsule"] > 0
        return out

    kept = kvcap.Artifact(path)
    want = run(kvcap.Cache(g, storage="f32", artifact=kept, config_yaml=KVCAPSULE))
    with kvcap.Artifact(path) as art:
        cache = kvcap.Cache(g, storage="f32", artifact=art, config_yaml=KVCAPSULE)
    art.close()  # a second close is a no-op
    del art
    junk = [np.full(4096, 7.0) for _ in range(64)]  # reuse what a freed artifact held
    assert np.array_equal(run(cache), want)
    del junk
    closed = kvcap.Artifact(path)
    closed.close()
    with pytest.raises(kvcap.Error) as e:
        kvcap.Cache(g, storage="f32", artifact=closed, config_yaml=KVCAPSULE)
    assert e.value.status_name == "STATE" and str(path) in e.value.message
    kept.close()


# ---- attend's out --------------------------------------------------------------------------------

def test_attend_refuses_an_out_it_may_not_write(tmp_path):
    """out must be a writeable, C-contiguous float32 NumPy array of the right shape: an
    immutable bytes object seen through np.frombuffer, a read-only memmap, a torch tensor, a
    list, a strided or mistyped array are refused naming `out`, and nothing is written."""
    g = geometry(layers=1)
    cache = kvcap.Cache(g, storage="f32", n_threads=1)
    rng = np.random.default_rng(5)
    k = rng.standard_normal((g.kv_heads, 8, g.head_dim)).astype(np.float32)
    cache.add_span(0, 0, k, k)
    q = rng.standard_normal((1, g.q_heads, g.head_dim)).astype(np.float32)
    want = cache.attend(0, q)
    shape = want.shape
    frozen = bytes(want.nbytes)
    mm = tmp_path / "out.f32"
    mm.write_bytes(bytes(want.nbytes))
    bad = {
        "read-only": np.frombuffer(frozen, np.float32).reshape(shape),
        "read-only ": np.memmap(mm, np.float32, mode="r", shape=shape),
        "numpy.ndarray": want.tolist(),
        "shape": np.empty((1, g.q_heads, g.head_dim + 1), np.float32),
        "dtype float64": np.empty(shape, np.float64),
        "not C-contiguous": np.empty(shape[::-1], np.float32).T,
    }
    torch = None
    try:
        import torch
    except ImportError:
        pass
    if torch is not None:
        bad["torch.Tensor"] = torch.empty(shape)
    for why, out in bad.items():
        for call in (cache.attend, cache.attend_lse):
            with pytest.raises(kvcap.Error) as e:
                call(0, q, out=out)
            assert e.value.status_name == "INVALID_ARGUMENT", why
            assert e.value.message.startswith("out: ") and why.strip() in e.value.message, why
    assert frozen == bytes(want.nbytes)
    assert mm.read_bytes() == bytes(want.nbytes)
    out = np.zeros(shape, np.float32)
    assert cache.attend(0, q, out=out) is out and np.array_equal(out, want)
    got, lse = cache.attend_lse(0, q, out=out)
    assert got is out and np.array_equal(out, want) and lse.shape == shape[:2]
    # q and out the same memory: q is read before out is written
    same = q.copy()
    assert np.array_equal(cache.attend(0, same, out=same), want)


# ---- Integers beyond a C int --------------------------------------------------------------------

def test_integers_beyond_a_c_int_are_refused_by_name():
    """Every integer that goes to a C int is checked in the binding: 2**32 is not taken as 0
    (ctypes truncates), -2**32 not as 0, nor 2**31 as -2**31; bools and floats are refused,
    NumPy integers taken. The error names the argument and the range; the cache stays usable."""
    g = geometry(layers=1)
    cache = kvcap.Cache(g, storage="f32", n_threads=1)
    rng = np.random.default_rng(6)
    k = rng.standard_normal((g.kv_heads, 4, g.head_dim)).astype(np.float32)
    k1 = k[:, 0]
    q = rng.standard_normal((1, g.q_heads, g.head_dim)).astype(np.float32)
    pq = rng.standard_normal((g.q_heads, 2, g.head_dim)).astype(np.float32)
    cache.add_span(0, 0, k, k)
    want = cache.attend(0, q)

    def geo(kw):
        return lambda big: kvcap.Cache(kvcap.Geometry(**{**dict(
            layers=1, q_heads=4, kv_heads=2, head_dim=64), **kw(big)}), n_threads=1)

    calls = {
        "seq": lambda big: cache.add_span(big, 0, k, k),
        "layer": lambda big: cache.add_span(0, big, k, k),
        "p0": lambda big: cache.add_span(0, 0, k, k, p0=big),
        "grid rows": lambda big: cache.add_span(0, 0, k, k, kind="vision", grid=(big, 2)),
        "grid cols": lambda big: cache.add_span(0, 0, k, k, kind="vision", grid=(2, big)),
        "seq ": lambda big: cache.end_prefill(big),
        " seq": lambda big: cache.append(big, 0, k1, k1),
        " layer": lambda big: cache.append(0, big, k1, k1),
        "layer ": lambda big: cache.attend(big, q),
        "  layer": lambda big: cache.add_post_queries(0, big, pq),
        "  seq": lambda big: cache.add_post_queries(big, 0, pq),
        "n_seqs": lambda big: kvcap.Cache(g, n_seqs=big),
        "n_threads": lambda big: kvcap.Cache(g, n_threads=big),
        "reserve_tokens": lambda big: kvcap.Cache(g, reserve_tokens=big, n_threads=1),
        "geometry.layers": geo(lambda big: dict(layers=big)),
        "geometry.q_heads": geo(lambda big: dict(q_heads=big)),
        "geometry.kv_heads": geo(lambda big: dict(kv_heads=big)),
        "geometry.head_dim": geo(lambda big: dict(head_dim=big)),
        "geometry.rope_dim": geo(lambda big: dict(rope_dim=big)),
        "geometry.sections[1]": geo(lambda big: dict(rope="mrope", sections=(8, big, 12))),
    }
    # each would be truncated by ctypes to a value the library takes (0, 1, 2, 64, ...)
    offsets = {"grid rows": 2, "grid cols": 2, "n_seqs": 1, "n_threads": 1, "reserve_tokens": 64,
               "geometry.layers": 1, "geometry.q_heads": 4, "geometry.kv_heads": 2,
               "geometry.head_dim": 64, "geometry.sections[1]": 12}
    for name, call in calls.items():
        small = offsets.get(name, 0)
        for big in (2**32 + small, -2**32 + small, 2**64 + small, np.uint64(2**32 + small)):
            with pytest.raises(kvcap.Error) as e:
                call(big)
            assert e.value.status_name == "INVALID_ARGUMENT", (name, big)
            assert e.value.message.startswith(name.strip() + ": "), (name, e.value.message)
            assert f"C int [{-2**31}, {2**31 - 1}]" in e.value.message
        for odd, says in ((True, "bool"), (np.bool_(False), "bool"), (float(small), "float"),
                          ("0", "str")):
            with pytest.raises(kvcap.Error, match=says) as e:
                call(odd)
            assert e.value.message.startswith(name.strip() + ": ")
    with pytest.raises(kvcap.Error, match=r"^INVALID_ARGUMENT: seq: 2147483648 is outside"):
        cache.add_span(2**31, 0, k, k)
    # NumPy integers are integers; the library still checks the finer bounds
    cache.end_prefill(np.int64(0))
    with pytest.raises(kvcap.Error, match="seq"):
        cache.end_prefill(np.int32(3))
    assert np.array_equal(cache.attend(np.uint8(0), q), want)  # still usable, nothing added
    assert cache.stats()["tokens_by_kind"]["text"] == 4
    kvcap.Cache(geometry(), n_seqs=np.int16(2), n_threads=np.int64(1)).close()


# ---- Layouts: read in place or copied, the same values either way -------------------------------

def test_negative_and_broadcast_views_are_copied_others_read_in_place():
    """Views the library refuses (negative strides, zero strides of a broadcast) are copied once
    by the binding and give what their contiguous copy gives; transposed and stepped views are
    read in place (the view kept for the call is the caller's own array)."""
    g = geometry(layers=1)
    h, n, d = g.kv_heads, 12, g.head_dim
    rng = np.random.default_rng(8)
    base = rng.standard_normal((h, n, d)).astype(np.float32)
    one = rng.standard_normal((1, n, d)).astype(np.float32)
    nhd = rng.standard_normal((n, h, d)).astype(np.float32)
    big = rng.standard_normal((2 * h, 3 * n, d)).astype(np.float32)
    q = rng.standard_normal((1, g.q_heads, d)).astype(np.float32)
    views = {  # name: (view, read in place)
        "negative tokens": (base[:, ::-1], False),
        "negative heads": (base[::-1], False),
        "broadcast heads": (np.broadcast_to(one, (h, n, d)), False),
        "broadcast tokens": (np.broadcast_to(base[:, :1], (h, n, d)), False),
        "strided channels": (np.repeat(base, 2, axis=2)[:, :, ::2], False),
        "sliced": (big[1:h + 1, 2:n + 2], True),
        "transposed": (nhd.transpose(1, 0, 2), True),
        "stepped": (big[::2, ::3], True),
    }
    for name, (x, in_place) in views.items():
        a = kvcap.Cache(g, storage="f32", n_threads=1)
        b = kvcap.Cache(g, storage="f32", n_threads=1)
        a.add_span(0, 0, x, x)
        c = np.ascontiguousarray(x)
        b.add_span(0, 0, c, c)
        assert np.array_equal(a.attend(0, q), b.attend(0, q)), name
        _, kept = kvcap._view(x, "k", h, n, d)
        assert (kept is x) == in_place, name
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(one)
    for name, x in (("expand heads", t.expand(h, n, d)),
                    ("expand tokens", t[:, :1].expand(h, n, d))):
        a = kvcap.Cache(g, storage="f32", n_threads=1)
        b = kvcap.Cache(g, storage="f32", n_threads=1)
        a.add_span(0, 0, x, x)
        b.add_span(0, 0, x.contiguous(), x.contiguous())
        assert np.array_equal(a.attend(0, q), b.attend(0, q)), name
        a.append(0, 0, x[:, 0], x[:, 0])  # [kv_heads][d] with a zero head stride
        b.append(0, 0, x[:, 0].contiguous(), x[:, 0].contiguous())
        assert np.array_equal(a.attend(0, q), b.attend(0, q)), name


# ---- Property tests: a seeded loop over geometries, dtypes and layouts --------------------------

HEAD_DIMS = (64, 80, 96, 128, 256)


def _numpy_layout(rng, x, name):
    """`x` [h][n][d] (a NumPy array) as the named layout holding the same values."""
    h, n, d = x.shape
    if name == "contiguous":
        return x.copy()
    if name == "transposed":  # NHD storage: [tokens][heads][d] seen as [heads][tokens][d]
        return np.ascontiguousarray(x.transpose(1, 0, 2)).transpose(1, 0, 2)
    if name == "negative tokens":
        return np.ascontiguousarray(x[:, ::-1])[:, ::-1]
    if name == "negative heads":
        return np.ascontiguousarray(x[::-1])[::-1]
    if name == "broadcast heads":  # the caller made every head equal
        return np.broadcast_to(x[:1], x.shape)
    if name == "stepped":
        sh, st = rng.integers(1, 4, size=2)
        big = np.zeros((h * sh + 1, n * st + 2, d), x.dtype)
        big[1::sh][:h, 2::st][:, :n] = x
        return big[1::sh][:h, 2::st][:, :n]
    if name == "strided channels":
        big = np.zeros((h, n, 2 * d), x.dtype)
        big[..., 1::2] = x
        return big[..., 1::2]
    if name == "unaligned":
        raw = np.zeros(x.nbytes + 1, np.uint8)
        a = raw[1:].view(x.dtype).reshape(x.shape)
        a[...] = x
        assert not a.flags.aligned
        return a
    raise AssertionError(name)


def _torch_layout(torch, x, name):
    """`x` [h][n][d] (a torch tensor) as the named layout holding the same values."""
    h, n, d = x.shape
    if name == "contiguous":
        return x.clone()
    if name == "transposed":
        return x.transpose(0, 1).contiguous().transpose(0, 1)
    if name == "broadcast heads":
        return x[:1].expand(h, n, d)
    if name == "stepped":
        big = torch.zeros(2 * h, 3 * n, d, dtype=x.dtype)
        big[::2, ::3] = x
        return big[::2, ::3]
    if name == "strided channels":
        big = torch.zeros(h, n, 2 * d, dtype=x.dtype)
        big[..., ::2] = x
        return big[..., ::2]
    raise AssertionError(name)


NUMPY_LAYOUTS = ("contiguous", "transposed", "negative tokens", "negative heads",
                 "broadcast heads", "stepped", "strided channels", "unaligned")
TORCH_LAYOUTS = ("contiguous", "transposed", "broadcast heads", "stepped", "strided channels")


def test_property_layouts_give_what_contiguous_gives():
    """Random geometries, dtypes, layouts and storages (seeded): spans and a generated token
    added through any layout attend exactly as the same values passed contiguous."""
    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(2024)
    kinds = [("numpy", np.float32), ("numpy", np.float16)]
    if torch is not None:
        kinds += [("torch", torch.float32), ("torch", torch.float16), ("torch", torch.bfloat16)]
    for it in range(400):
        kv = int(rng.integers(1, 5))
        grp = int(rng.integers(1, 5))
        d = int(rng.choice(HEAD_DIMS))
        g = kvcap.Geometry(layers=1, q_heads=kv * grp, kv_heads=kv, head_dim=d)
        lib_kind, dt = kinds[it % len(kinds)]
        layouts = NUMPY_LAYOUTS if lib_kind == "numpy" else TORCH_LAYOUTS
        layout = layouts[int(rng.integers(len(layouts)))]
        storage = str(rng.choice(["f32", "f16", "bf16"]))
        n_seqs = int(rng.integers(1, 3))
        caches = [kvcap.Cache(g, n_seqs=n_seqs, storage=storage, n_threads=1) for _ in range(2)]
        for s in range(n_seqs):
            n = int(rng.integers(1, 40))
            kind = "vision" if rng.random() < 0.3 and n > 1 else "text"
            grid = (1, n) if kind == "vision" else (0, 0)
            for step in range(2):  # the span, then one generated token
                m = n if step == 0 else 1
                data = [rng.standard_normal((kv, m, d)).astype(np.float32) for _ in range(2)]
                if layout == "broadcast heads":
                    data = [np.repeat(x[:1], kv, axis=0) for x in data]
                if lib_kind == "numpy":
                    ref = [x.astype(dt) for x in data]
                    lay = [_numpy_layout(rng, x, layout) for x in ref]
                else:
                    ref = [torch.from_numpy(x).to(dt) for x in data]
                    lay = [_torch_layout(torch, x, layout) for x in ref]
                for c, (k, v) in zip(caches, (ref, lay)):
                    if step == 0:
                        c.add_span(s, 0, k, v, kind=kind, grid=grid, p0=int(rng.integers(0, 9)))
                    else:
                        c.append(s, 0, k[:, 0], v[:, 0])
        q = rng.standard_normal((n_seqs, g.q_heads, d)).astype(np.float32)
        (o1, l1), (o2, l2) = (c.attend_lse(0, q) for c in caches)
        where = (it, lib_kind, dt, layout, storage, kv, grp, d)
        assert np.array_equal(o1, o2) and np.array_equal(l1, l2), where
        assert np.all(np.isfinite(o1)), where
        for c in caches:
            c.close()


def test_property_bad_input_is_an_error_never_a_crash():
    """Random bad shapes, dtypes, objects and ranges through every call (seeded): each raises
    kvcap.Error, and the cache then attends as before, holding what it held."""
    try:
        import torch
    except ImportError:
        torch = None
    rng = np.random.default_rng(7)
    for it in range(40):
        kv, grp = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        d = int(rng.choice(HEAD_DIMS))
        g = kvcap.Geometry(layers=2, q_heads=kv * grp, kv_heads=kv, head_dim=d)
        n_seqs = int(rng.integers(1, 3))
        cache = kvcap.Cache(g, n_seqs=n_seqs, storage="f32", n_threads=1)
        n = int(rng.integers(2, 20))
        good = rng.standard_normal((kv, n, d)).astype(np.float32)
        for s in range(n_seqs):
            for layer in range(2):
                cache.add_span(s, layer, good, good)
        q = rng.standard_normal((n_seqs, g.q_heads, d)).astype(np.float32)
        want = cache.attend(1, q)
        held = cache.stats()["bytes_held"]
        nan = good.copy()
        nan[0, n // 2, d // 3] = np.nan
        shapes = [(kv + 1, n, d), (kv, n, d + 1), (kv, n, d - 16), (kv, n), (1, kv, n, d),
                  (kv, 0, d), (), (kv * n * d,)]
        arrays = [np.zeros(sh, np.float32) for sh in shapes]
        arrays += [good.astype(t) for t in (np.float64, np.int32, np.bool_, np.complex64,
                                            np.uint8, ">f4", object)]
        arrays += [None, "abc", 3.5, [[1.0, 2.0]], {}, b"\0" * 64, nan]
        if torch is not None:
            tg = torch.from_numpy(good)
            arrays += [tg.double(), tg.int(), tg[:, :, :-1], tg.unsqueeze(0),
                       torch.zeros(kv, n, d, device="meta")]
        calls = []

        def fits(x, shape):  # a random shape that happens to be a good one
            return getattr(x, "dtype", None) == np.float32 and len(x.shape) == len(shape) and \
                all(a == b or b < 0 for a, b in zip(x.shape, shape)) and x.size > 0

        for x in arrays:
            calls += [lambda x=x: cache.add_span(0, 0, x, good),
                      lambda x=x: cache.add_span(0, 0, good, x),
                      lambda x=x: cache.append(0, 0, x, good[:, 0])]
            if not fits(x, q.shape):
                calls += [lambda x=x: cache.attend(0, x),
                          lambda x=x: cache.attend(0, q, out=x if x is not None else q[0])]
            if not fits(x, (g.q_heads, -1, d)):
                calls.append(lambda x=x: cache.add_post_queries(0, 0, x))
        wide = [2**31, 2**32, -2**63, 2**80, True, 1.0, "0", None, np.nan, np.int64(-2**40)]
        for i in [-1, n_seqs] + wide:  # seq
            calls += [lambda i=i: cache.add_span(i, 0, good, good),
                      lambda i=i: cache.append(i, 0, good[:, 0], good[:, 0]),
                      lambda i=i: cache.end_prefill(i),
                      lambda i=i: cache.add_post_queries(i, 0, q[0][:, None])]
        for i in [-1, 2] + wide:  # layer
            calls += [lambda i=i: cache.add_span(0, i, good, good),
                      lambda i=i: cache.append(0, i, good[:, 0], good[:, 0]),
                      lambda i=i: cache.attend(i, q),
                      lambda i=i: cache.add_post_queries(0, i, q[0][:, None])]
        for i in [-1] + wide:  # p0
            calls.append(lambda i=i: cache.add_span(0, 0, good, good, p0=i))
        for grid in [(0, 0), (1, n + 1), (n, 2), (-1, -n), "ab", (1,), None, (1.0, n)]:
            calls.append(lambda grid=grid: cache.add_span(0, 0, good, good, kind="vision",
                                                          grid=grid))
        calls += [lambda: cache.add_span(0, 0, good, good, kind="image"),
                  lambda: cache.add_span(0, 0, good, good, kind=["text"]),
                  lambda: cache.uses_policy("fastest")]
        order = rng.permutation(len(calls))
        for j in order:
            with pytest.raises(kvcap.Error):
                calls[j]()
                print("no error: iteration", it, "line", calls[j].__code__.co_firstlineno,
                      "arguments", calls[j].__defaults__)
        assert np.array_equal(cache.attend(1, q), want), it
        assert cache.stats()["bytes_held"] == held, it
        cache.close()
