"""kvcap — KV-cache compression for vision-language models, from Python.

Bindings over libkvcap's public C API (include/kvcap.h): artifacts, caches (with the runtime
YAML config), record mode and statistics. Arrays go in and out without copies where their
layout allows: NumPy arrays (and anything exposing ``__array_interface__``) and torch CPU
tensors (float32, float16, bfloat16) are handed to the library as strided views. Every failure
raises :class:`Error` with the library's status and message; a failed call leaves the cache
usable.

    import numpy as np, kvcap
    g = kvcap.Geometry(layers=2, q_heads=4, kv_heads=2, head_dim=64, rope="rope", theta=1e4)
    cache = kvcap.Cache(g, storage="f32")
    k = np.random.randn(2, 16, 64).astype(np.float32)     # [kv_heads][tokens][head_dim]
    for layer in range(2):
        cache.add_span(0, layer, k, k, kind="text")
    out = cache.attend(0, np.random.randn(1, 4, 64).astype(np.float32))
"""

from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Tuple

import numpy as np

from kvcap import _capi
from kvcap._capi import lib

__all__ = [
    "Error",
    "Geometry",
    "Artifact",
    "Cache",
    "version",
    "cuda_device_count",
    "__version__",
]


def version() -> str:
    """The library's version, "MAJOR.MINOR.PATCH" (kvcap_version)."""
    return lib.kvcap_version().decode()


__version__ = version()


class Error(Exception):
    """A libkvcap call failed: ``status`` is the enum kvcap_status value, ``status_name`` its
    name ("INVALID_ARGUMENT", ...) and ``message`` what the library said (kvcap_last_error)."""

    def __init__(self, status: int, message: str):
        self.status = int(status)
        self.status_name = (
            _capi.STATUS_NAMES[status] if 0 <= status < len(_capi.STATUS_NAMES) else str(status)
        )
        self.message = message
        super().__init__(f"{self.status_name}: {message}")


def _check(status: int) -> None:
    if status != _capi.OK:
        raise Error(status, (lib.kvcap_last_error() or b"").decode(errors="replace"))


def _argument(message: str) -> Error:
    """An error found here, before the library is called, as the library would report it."""
    return Error(1, message)  # KVCAP_ERR_INVALID_ARGUMENT


def cuda_device_count() -> int:
    """CUDA devices this build of libkvcap can use (0 in a build without CUDA)."""
    return int(lib.kvcap_cuda_device_count())


_DTYPES = {"f32": _capi.DTYPE_F32, "f16": _capi.DTYPE_F16, "bf16": _capi.DTYPE_BF16}
_NUMPY_DTYPES = {np.dtype(np.float32): _capi.DTYPE_F32, np.dtype(np.float16): _capi.DTYPE_F16}
_ROPE = {"none": _capi.ROPE_NONE, "rope": _capi.ROPE_ROPE, "mrope": _capi.ROPE_MROPE}
_PAIRING = {"half": _capi.PAIRING_HALF, "neox": _capi.PAIRING_HALF,
            "adjacent": _capi.PAIRING_ADJACENT, "normal": _capi.PAIRING_ADJACENT}
_KINDS = {"vision": _capi.SPAN_VISION, "text": _capi.SPAN_TEXT}


@dataclass
class Geometry:
    """The attention geometry of a model (struct kvcap_model_geometry). ``rope`` is "none",
    "rope" or "mrope"; ``pairing`` "half" (NeoX, HF's rotate_half) or "adjacent"; ``rope_dim``
    0 means head_dim; ``sections`` (M-RoPE) are in frequency pairs."""

    layers: int
    q_heads: int
    kv_heads: int
    head_dim: int
    rope: str = "rope"
    pairing: str = "half"
    theta: float = 10000.0
    rope_dim: int = 0
    sections: Sequence[int] = field(default_factory=tuple)
    name: str = ""

    def to_c(self) -> _capi.ModelGeometry:
        g = _capi.ModelGeometry()
        g.name = self.name.encode()[: _capi.MAX_NAME - 1]
        g.n_layers, g.n_q_heads, g.n_kv_heads = self.layers, self.q_heads, self.kv_heads
        g.head_dim = self.head_dim
        if self.rope not in _ROPE:
            raise _argument(f"geometry.rope: '{self.rope}' is not one of none, rope, mrope")
        if self.pairing not in _PAIRING:
            raise _argument(f"geometry.pairing: '{self.pairing}' is not one of half, adjacent")
        if len(self.sections) > _capi.MAX_ROPE_SECTIONS:
            raise _argument(f"geometry.sections: {len(self.sections)} sections, at most "
                            f"{_capi.MAX_ROPE_SECTIONS}")
        g.rope_type, g.rope_pairing = _ROPE[self.rope], _PAIRING[self.pairing]
        g.rope_theta, g.rope_dim = float(self.theta), self.rope_dim
        g.n_rope_sections = len(self.sections)
        for i, s in enumerate(self.sections):
            g.rope_sections[i] = s
        return g

    @staticmethod
    def from_c(g: _capi.ModelGeometry) -> "Geometry":
        rope = {v: k for k, v in _ROPE.items()}[g.rope_type]
        pairing = "adjacent" if g.rope_pairing == _capi.PAIRING_ADJACENT else "half"
        return Geometry(g.n_layers, g.n_q_heads, g.n_kv_heads, g.head_dim, rope, pairing,
                        g.rope_theta, g.rope_dim,
                        tuple(g.rope_sections[i] for i in range(g.n_rope_sections)),
                        g.name.decode(errors="replace"))

    def validate(self) -> None:
        """Raises :class:`Error` naming the first field that is not valid."""
        g = self.to_c()
        _check(lib.kvcap_geometry_validate(ctypes.byref(g)))


class _Owned:
    """A libkvcap handle this object owns: freed by close(), a `with` block's end, or garbage
    collection; a closed handle is an Error (STATE) naming `_what`."""

    _handle: Optional[int] = None
    _what = "object"

    def _free(self, handle: int) -> None:  # pragma: no cover - each subclass frees its kind
        raise NotImplementedError

    def _ptr(self) -> int:
        if not self._handle:
            raise Error(11, f"{self._what} is closed")  # KVCAP_ERR_STATE
        return self._handle

    def close(self) -> None:
        if self._handle:
            self._free(self._handle)
            self._handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


class Artifact(_Owned):
    """A deployable compressor artifact (kvcap-convert's output), opened and validated."""

    def __init__(self, path: "os.PathLike[str] | str"):
        handle = ctypes.c_void_p()
        _check(lib.kvcap_artifact_open(os.fsencode(path), ctypes.byref(handle)))
        self._handle = handle.value
        self.path = os.fspath(path)
        self._what = f"{self.path}: the artifact"

    def _free(self, handle: int) -> None:
        lib.kvcap_artifact_free(handle)

    @property
    def geometry(self) -> Geometry:
        return Geometry.from_c(lib.kvcap_artifact_geometry(self._ptr()).contents)


def _is_torch(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr")


_TORCH_DTYPES = {"torch.float32": _capi.DTYPE_F32, "torch.float16": _capi.DTYPE_F16,
                 "torch.bfloat16": _capi.DTYPE_BF16}


def _host_tensor(x: Any, what: str) -> None:
    """A torch tensor this host-memory cache can read, or an Error naming `what`."""
    if x.device.type != "cpu":
        raise _argument(f"{what}: a tensor on {x.device}; this cache keeps host memory (pass a "
                        "CPU tensor)")


def _as_array(x: Any, what: str) -> np.ndarray:
    """NumPy view of an array-like without a copy; torch CPU tensors through the array
    interface. A tensor on another device, or a bfloat16 one (NumPy has no bfloat16), is an
    error naming `what`."""
    if isinstance(x, np.ndarray):
        return x
    if _is_torch(x):
        _host_tensor(x, what)
        if str(x.dtype) == "torch.bfloat16":
            raise _argument(f"{what}: a bfloat16 tensor; this call takes float32")
        return x.detach().numpy()
    try:
        return np.asarray(x)
    except Exception as e:  # pragma: no cover - depends on the object
        raise _argument(f"{what}: not an array ({type(x).__name__}): {e}") from None


def _tensor_view(base: int, dtype: int, head_stride: int, token_stride: int) -> _capi.TensorView:
    """A contiguous-base struct kvcap_tensor_view (no page table); strides in elements."""
    v = _capi.TensorView()
    v.base = base
    v.pages = None
    v.page_size = 0
    v.dtype = dtype
    v.head_stride, v.token_stride = head_stride, token_stride
    return v


def _view(x: Any, what: str, heads: int, tokens: int, d: int) -> Tuple[_capi.TensorView, Any]:
    """A struct kvcap_tensor_view over a [heads][tokens][d] array or torch tensor (float32,
    float16, or bfloat16 for tensors; any head and token strides, contiguous channels), read in
    place. Returns the view and the object the caller keeps alive during the call."""
    if _is_torch(x):
        _host_tensor(x, what)
        if str(x.dtype) not in _TORCH_DTYPES:
            raise _argument(f"{what}: dtype {x.dtype}, expected float32, float16 or bfloat16")
        if x.dim() != 3 or tuple(x.shape) != (heads, tokens, d):
            raise _argument(f"{what}: shape {tuple(x.shape)}, expected ({heads}, {tokens}, {d}) "
                            "[kv_heads][tokens][head_dim]")
        if x.stride(2) != 1:
            x = x.contiguous()  # channels must be contiguous: one copy, only then
        return _tensor_view(x.data_ptr(), _TORCH_DTYPES[str(x.dtype)], x.stride(0),
                            x.stride(1)), x
    a = _as_array(x, what)
    if a.ndim != 3 or a.shape != (heads, tokens, d):
        raise _argument(f"{what}: shape {tuple(a.shape)}, expected ({heads}, {tokens}, {d}) "
                        "[kv_heads][tokens][head_dim]")
    if a.dtype not in _NUMPY_DTYPES:
        raise _argument(f"{what}: dtype {a.dtype}, expected float32 or float16")
    es = a.dtype.itemsize
    if a.strides[2] != es or a.strides[0] % es or a.strides[1] % es:
        a = np.ascontiguousarray(a)  # channels must be contiguous: one copy, only then
    return _tensor_view(a.ctypes.data, _NUMPY_DTYPES[a.dtype], a.strides[0] // es,
                        a.strides[1] // es), a


def _f32(x: Any, what: str, shape: Tuple[int, ...]) -> np.ndarray:
    a = _as_array(x, what)
    if tuple(a.shape) != shape:
        raise _argument(f"{what}: shape {tuple(a.shape)}, expected {shape}")
    if a.dtype != np.float32:
        raise _argument(f"{what}: dtype {a.dtype}, expected float32")
    return np.ascontiguousarray(a)


class Cache(_Owned):
    """A batch's KV cache in libkvcap (struct kvcap_cache): spans added at prefill go to the
    policy the runtime config gives their kind; decode attention runs on what is stored.

    ``config`` is a runtime YAML path (configs/runtime.yaml documents every key), or
    ``config_yaml`` the YAML text itself (give one); ``storage``
    "f16" (default), "bf16" or "f32"; ``artifact`` is borrowed and must stay open while the
    cache lives (the cache keeps a reference); ``record_dir`` turns on record mode."""

    def __init__(self, geometry: Geometry, *, n_seqs: int = 1, storage: str = "f16",
                 artifact: Optional[Artifact] = None, config: "os.PathLike[str] | str | None" = None,
                 record_dir: "os.PathLike[str] | str | None" = None, n_threads: int = 0,
                 reserve_tokens: int = 0, config_yaml: Optional[str] = None):
        if storage not in _DTYPES:
            raise _argument(f"storage: '{storage}' is not one of f32, f16, bf16")
        p = _capi.CacheParams()
        lib.kvcap_cache_default_params(ctypes.byref(p))
        p.model = geometry.to_c()
        p.n_seqs = n_seqs
        p.storage = _DTYPES[storage]
        p.artifact = artifact._ptr() if artifact is not None else None
        p.config_path = os.fsencode(config) if config is not None else None  # read at create
        p.config_yaml = config_yaml.encode() if config_yaml is not None else None  # likewise
        p.record_dir = os.fsencode(record_dir) if record_dir is not None else None  # copied
        p.n_threads = n_threads
        p.reserve_tokens = reserve_tokens
        handle = ctypes.c_void_p()
        _check(lib.kvcap_cache_create(ctypes.byref(p), ctypes.byref(handle)))
        self._handle = handle.value
        self._what = "the cache"
        self._artifact = artifact
        self.geometry = geometry
        self.n_seqs = n_seqs

    def add_span(self, seq: int, layer: int, k: Any, v: Any, *, kind: str = "text",
                 grid: Tuple[int, int] = (0, 0), p0: int = 0) -> None:
        """One prefill span of `seq` at `layer`: k and v are [kv_heads][tokens][head_dim]
        (float32 or float16, or torch CPU tensors also in bfloat16; any head and token strides),
        read in place. ``kind`` "vision"
        (with its ``grid`` (rows, cols)) or "text"; ``p0`` the position of its first token."""
        if kind not in _KINDS:
            raise _argument(f"span.kind: '{kind}' is not one of vision, text")
        g = self.geometry
        n = k.shape[1] if len(getattr(k, "shape", ())) == 3 else -1
        kv, ka = _view(k, "k", g.kv_heads, n, g.head_dim)
        vv, va = _view(v, "v", g.kv_heads, n, g.head_dim)
        rows, cols = grid if kind == "vision" else (0, 0)
        span = _capi.SpanDesc(_KINDS[kind], n, rows, cols, p0)
        _check(lib.kvcap_cache_add_span(self._ptr(), seq, layer, ctypes.byref(span),
                                        ctypes.byref(kv), ctypes.byref(vv)))

    def add_post_queries(self, seq: int, layer: int, q: Any, lse: Any = None) -> None:
        """The post-vision prompt queries (vlcache), or the queries of KVzip's
        context-reconstruction pass (kvzip): q [q_heads][n][head_dim] float32; ``lse``
        [q_heads][n] (optional) each query's log-sum-exp over keys the cache does not hold (the
        pass's own tokens up to it; -inf for none)."""
        a = _as_array(q, "q")
        n = a.shape[1] if a.ndim == 3 else -1
        a = _f32(a, "q", (self.geometry.q_heads, n, self.geometry.head_dim))
        if lse is None:
            _check(lib.kvcap_cache_add_post_queries(self._ptr(), seq, layer, a.ctypes.data, n))
            return
        b = _f32(_as_array(lse, "lse"), "lse", (self.geometry.q_heads, n))
        _check(lib.kvcap_cache_add_post_queries_lse(self._ptr(), seq, layer, a.ctypes.data,
                                                    b.ctypes.data, n))

    def end_prefill(self, seq: int) -> None:
        _check(lib.kvcap_cache_end_prefill(self._ptr(), seq))

    def append(self, seq: int, layer: int, k: Any, v: Any) -> None:
        """One generated token: k and v [kv_heads][head_dim] (or [kv_heads][1][head_dim])."""
        g = self.geometry
        ka = k if _is_torch(k) or isinstance(k, np.ndarray) else _as_array(k, "k")
        va = v if _is_torch(v) or isinstance(v, np.ndarray) else _as_array(v, "v")
        if len(ka.shape) == 2:
            ka = ka[:, None, :]
        if len(va.shape) == 2:
            va = va[:, None, :]
        kv, ka = _view(ka, "k", g.kv_heads, 1, g.head_dim)
        vv, va = _view(va, "v", g.kv_heads, 1, g.head_dim)
        _check(lib.kvcap_cache_append(self._ptr(), seq, layer, ctypes.byref(kv),
                                      ctypes.byref(vv)))

    def attend(self, layer: int, q: Any, out: Optional[np.ndarray] = None) -> np.ndarray:
        """Decode attention at `layer`: q [n_seqs][q_heads][head_dim] float32 (rotated at its
        position); returns out of the same shape (written into `out` when given)."""
        return self.attend_lse(layer, q, out)[0]

    def attend_lse(self, layer: int, q: Any, out: Optional[np.ndarray] = None
                   ) -> Tuple[np.ndarray, np.ndarray]:
        """attend, and the log-sum-exp of each query head's scores [n_seqs][q_heads]."""
        g = self.geometry
        shape = (self.n_seqs, g.q_heads, g.head_dim)
        qa = _f32(q, "q", shape)
        if out is None:
            out = np.empty(shape, np.float32)
        elif out.shape != shape or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise _argument(f"out: expected a C-contiguous float32 array of shape {shape}")
        lse = np.empty(shape[:2], np.float32)
        _check(lib.kvcap_cache_attend_lse(self._ptr(), layer, qa.ctypes.data, out.ctypes.data,
                                          lse.ctypes.data))
        return out, lse

    def stats(self) -> dict:
        """kvcap_cache_stats as a dict; per-policy and per-kind bytes keyed by name."""
        s = _capi.CacheStats()
        _check(lib.kvcap_cache_stats(self._ptr(), ctypes.byref(s)))
        d = {name: getattr(s, name) for name, _ in _capi.CacheStats._fields_
             if name not in ("bytes_by_policy", "bytes_by_kind", "tokens_by_kind")}
        d["bytes_by_policy"] = dict(zip(_capi.POLICIES, list(s.bytes_by_policy)))
        kinds = ("vision", "text", "generated")
        d["bytes_by_kind"] = dict(zip(kinds, list(s.bytes_by_kind)))
        d["tokens_by_kind"] = dict(zip(kinds, list(s.tokens_by_kind)))
        return d

    def record_flush(self) -> None:
        """Record mode: writes the spans of every sequence whose prefill has ended."""
        _check(lib.kvcap_cache_record_flush(self._ptr()))

    def _free(self, handle: int) -> None:
        lib.kvcap_cache_free(handle)
