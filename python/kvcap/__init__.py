"""kvcap — KV-cache compression for vision-language models, from Python.

Bindings over libkvcap's public C API (include/kvcap.h): artifacts, caches (with the runtime
YAML config), record mode and statistics. Arrays go in and out without copies where their
layout allows: NumPy arrays (and anything exposing ``__array_interface__``) and torch CPU
tensors (float32, float16, bfloat16) are handed to the library as strided views, and copied
once where the library cannot read their layout (see :meth:`Cache.add_span`). Integers that go
to a C int are checked here (a C int's range; bools and floats refused) instead of being
truncated by ctypes. Every failure raises :class:`Error` with the library's status and
message; a failed call leaves the cache usable.

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
import operator
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


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _c_int(value: Any, what: str) -> int:
    """`value` for a C int argument or field, or an Error (INVALID_ARGUMENT) naming `what` and
    the range: Python and NumPy integers (anything with ``__index__``) are taken; bools (True
    as a sequence number is a bug, not 1) and floats are refused rather than converted, and so
    is anything outside a C int's range, which ctypes would truncate silently (2**32 would
    become 0). The library's own checks stay the authority on the finer bounds."""
    if isinstance(value, (bool, np.bool_)) or str(getattr(value, "dtype", "")) in (
            "bool", "torch.bool"):
        raise _argument(f"{what}: {_short(value)} is a bool, expected an integer")
    try:
        i = operator.index(value)
    except TypeError:
        raise _argument(f"{what}: {_short(value)} ({type(value).__name__}) is not an integer"
                        ) from None
    if not _capi.INT_MIN <= i <= _capi.INT_MAX:
        raise _argument(f"{what}: {i} is outside the range of a C int "
                        f"[{_capi.INT_MIN}, {_capi.INT_MAX}]")
    return i


def _c_str(value: Any, what: str, path: bool = True) -> bytes:
    """A path (or, path=False, a text) for a C string, or an Error naming `what`: a NUL would
    end the C string early, so the library would read another name than the one given."""
    try:
        b = os.fsencode(value) if path else value.encode()
    except (TypeError, AttributeError, UnicodeError) as e:
        raise _argument(f"{what}: {_short(value)} is not a "
                        f"{'path' if path else 'str'} ({e})") from None
    if b"\0" in b:
        raise _argument(f"{what}: contains a NUL character")
    return b


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
        """The C struct; an Error (INVALID_ARGUMENT) naming the field that does not fit it
        (kvcap_geometry_validate checks the values)."""
        g = _capi.ModelGeometry()
        if not isinstance(self.name, str):
            raise _argument(f"geometry.name: {_short(self.name)} is not a str")
        g.name = self.name.encode()[: _capi.MAX_NAME - 1]
        g.n_layers = _c_int(self.layers, "geometry.layers")
        g.n_q_heads = _c_int(self.q_heads, "geometry.q_heads")
        g.n_kv_heads = _c_int(self.kv_heads, "geometry.kv_heads")
        g.head_dim = _c_int(self.head_dim, "geometry.head_dim")
        g.rope_dim = _c_int(self.rope_dim, "geometry.rope_dim")
        if not isinstance(self.rope, str) or self.rope not in _ROPE:
            raise _argument(f"geometry.rope: {_short(self.rope)} is not one of none, rope, mrope")
        if not isinstance(self.pairing, str) or self.pairing not in _PAIRING:
            raise _argument(f"geometry.pairing: {_short(self.pairing)} is not one of half, "
                            "adjacent")
        if isinstance(self.theta, (bool, np.bool_)):
            raise _argument(f"geometry.theta: {self.theta} is a bool, expected a number")
        try:
            g.rope_theta = float(self.theta)
            sections = tuple(self.sections)
        except (TypeError, ValueError) as e:
            raise _argument(f"geometry: theta {_short(self.theta)} or sections "
                            f"{_short(self.sections)}: {e}") from None
        if len(sections) > _capi.MAX_ROPE_SECTIONS:
            raise _argument(f"geometry.sections: {len(sections)} sections, at most "
                            f"{_capi.MAX_ROPE_SECTIONS}")
        g.rope_type, g.rope_pairing = _ROPE[self.rope], _PAIRING[self.pairing]
        g.n_rope_sections = len(sections)
        for i, s in enumerate(sections):
            g.rope_sections[i] = _c_int(s, f"geometry.sections[{i}]")
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
    """A deployable compressor artifact (kvcap-convert's output), opened and validated. Every
    cache made with it holds the library's artifact, so closing this object (or leaving its
    `with` block) while caches use it is safe: the maps go with the last of them."""

    def __init__(self, path: "os.PathLike[str] | str"):
        handle = ctypes.c_void_p()
        _check(lib.kvcap_artifact_open(_c_str(path, "path"), ctypes.byref(handle)))
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


def _strides(heads: int, tokens: int, d: int, hs: int, ts: int, cs: int
             ) -> Optional[Tuple[int, int]]:
    """The head and token strides (elements) the library can read a [heads][tokens][d] view
    with in place, or None when it cannot and the view must be copied: channels contiguous,
    and what kvcap_view_check (runtime/view.c) takes: no negative stride, no zero stride on an
    axis of more than one element (a broadcast), not both strides under a row. The stride of an
    axis of one element is never used, so it is passed as 0 whatever NumPy or torch says."""
    hs = 0 if heads == 1 else hs
    ts = 0 if tokens == 1 else ts
    if (cs != 1 and d > 1) or hs < 0 or ts < 0 or (tokens > 1 and ts == 0) or \
            (heads > 1 and hs == 0) or (heads > 1 and hs < d and ts < d):
        return None
    return hs, ts


def _view(x: Any, what: str, heads: int, tokens: int, d: int) -> Tuple[_capi.TensorView, Any]:
    """A struct kvcap_tensor_view over a [heads][tokens][d] array or torch CPU tensor (float32
    or float16; bfloat16 for tensors). Read in place when the channels are contiguous and the
    head and token strides are non-negative without broadcasting or overlapping rows (any
    transposition of heads and tokens, slices with positive steps); otherwise (negative steps,
    np.broadcast_to or expand() with zero strides, strided channels, unaligned data) copied
    once into a contiguous array, since the library refuses those strides. Returns the view and
    the object the caller keeps alive during the call."""
    if _is_torch(x):
        _host_tensor(x, what)
        if str(x.dtype) not in _TORCH_DTYPES:
            raise _argument(f"{what}: dtype {x.dtype}, expected float32, float16 or bfloat16")
        if x.dim() != 3 or tuple(x.shape) != (heads, tokens, d):
            raise _argument(f"{what}: shape {tuple(x.shape)}, expected ({heads}, {tokens}, {d}) "
                            "[kv_heads][tokens][head_dim]")
        st = _strides(heads, tokens, d, *x.stride())
        if st is None or x.data_ptr() % x.element_size():
            import torch  # loaded already: x is one of its tensors

            x = x.clone(memory_format=torch.contiguous_format)  # one copy, only then
            st = _strides(heads, tokens, d, *x.stride()) or (max(tokens, 1) * d, d)  # empty
        return _tensor_view(x.data_ptr(), _TORCH_DTYPES[str(x.dtype)], *st), x
    a = _as_array(x, what)
    if a.ndim != 3 or a.shape != (heads, tokens, d):
        raise _argument(f"{what}: shape {tuple(a.shape)}, expected ({heads}, {tokens}, {d}) "
                        "[kv_heads][tokens][head_dim]")
    if a.dtype not in _NUMPY_DTYPES:
        raise _argument(f"{what}: dtype {a.dtype}, expected float32 or float16")
    es = a.dtype.itemsize
    st = None
    if a.flags.aligned and not any(s % es for s in a.strides):
        st = _strides(heads, tokens, d, *(s // es for s in a.strides))
    if st is None:
        a = a.copy(order="C")  # one copy, only then
        st = _strides(heads, tokens, d, *(s // es for s in a.strides)) or \
            (max(tokens, 1) * d, d)  # an empty array: the library names its size
    return _tensor_view(a.ctypes.data, _NUMPY_DTYPES[a.dtype], *st), a


def _tokens_of(x: Any, what: str) -> Tuple[Any, int]:
    """`x` as a torch tensor or NumPy array, and its tokens (axis 1 of [heads][tokens][d]; -1
    when it has not three axes: the shape check then names it)."""
    a = x if _is_torch(x) else _as_array(x, what)
    return a, (int(a.shape[1]) if len(a.shape) == 3 else -1)


def _f32(x: Any, what: str, shape: Tuple[int, ...]) -> np.ndarray:
    """A C-contiguous, aligned float32 array of `shape` (copied only when `x` is not one)."""
    a = _as_array(x, what)
    if tuple(a.shape) != shape:
        raise _argument(f"{what}: shape {tuple(a.shape)}, expected {shape}")
    if a.dtype != np.float32:
        raise _argument(f"{what}: dtype {a.dtype}, expected float32")
    return np.require(a, requirements=["C", "A"])


def _out(x: Any, what: str, shape: Tuple[int, ...]) -> np.ndarray:
    """An array the library may write `shape` float32 values into, or an Error naming `what`:
    a writeable (not bytes, not a read-only memmap), C-contiguous, aligned float32 NumPy array
    of that shape; anything else (a torch tensor too) is refused, never written through."""
    want = f"expected a writeable, C-contiguous float32 numpy.ndarray of shape {shape}"
    if not isinstance(x, np.ndarray):
        raise _argument(f"{what}: a {type(x).__module__}.{type(x).__name__}; {want}")
    problem = (f"shape {tuple(x.shape)}" if tuple(x.shape) != shape else
               f"dtype {x.dtype}" if x.dtype != np.float32 else
               "read-only" if not x.flags.writeable else
               "not C-contiguous" if not x.flags.c_contiguous else
               "not aligned" if not x.flags.aligned else None)
    if problem:
        raise _argument(f"{what}: {problem}; {want}")
    return x


class Cache(_Owned):
    """A batch's KV cache in libkvcap (struct kvcap_cache): spans added at prefill go to the
    policy the runtime config gives their kind; decode attention runs on what is stored.

    ``config`` is a runtime YAML path (configs/runtime.yaml documents every key), or
    ``config_yaml`` the YAML text itself (give one); ``storage``
    "f16" (default), "bf16" or "f32"; ``artifact`` an open :class:`Artifact`, which the cache
    holds in the library: closing the Artifact afterwards is safe; ``record_dir`` turns on
    record mode. ``n_seqs``, ``n_threads`` and ``reserve_tokens`` are C ints (see
    kvcap_cache_params in kvcap.h)."""

    def __init__(self, geometry: Geometry, *, n_seqs: int = 1, storage: str = "f16",
                 artifact: Optional[Artifact] = None, config: "os.PathLike[str] | str | None" = None,
                 record_dir: "os.PathLike[str] | str | None" = None, n_threads: int = 0,
                 reserve_tokens: int = 0, config_yaml: Optional[str] = None):
        if not isinstance(storage, str) or storage not in _DTYPES:
            raise _argument(f"storage: {_short(storage)} is not one of f32, f16, bf16")
        if not isinstance(geometry, Geometry):
            raise _argument(f"geometry: a {type(geometry).__name__}, expected a kvcap.Geometry")
        if artifact is not None and not isinstance(artifact, Artifact):
            raise _argument(f"artifact: a {type(artifact).__name__}, expected a kvcap.Artifact")
        p = _capi.CacheParams()
        lib.kvcap_cache_default_params(ctypes.byref(p))
        p.model = geometry.to_c()
        p.n_seqs = n_seqs = _c_int(n_seqs, "n_seqs")
        p.storage = _DTYPES[storage]
        # a closed Artifact is an Error (STATE) naming its file; an open one the cache holds
        p.artifact = artifact._ptr() if artifact is not None else None
        # config, config_yaml and record_dir are read or copied at create
        p.config_path = _c_str(config, "config") if config is not None else None
        p.config_yaml = _c_str(config_yaml, "config_yaml", path=False) \
            if config_yaml is not None else None
        p.record_dir = _c_str(record_dir, "record_dir") if record_dir is not None else None
        p.n_threads = _c_int(n_threads, "n_threads")
        p.reserve_tokens = _c_int(reserve_tokens, "reserve_tokens")
        handle = ctypes.c_void_p()
        _check(lib.kvcap_cache_create(ctypes.byref(p), ctypes.byref(handle)))
        self._handle = handle.value
        self._what = "the cache"
        self.geometry = geometry
        self.n_seqs = n_seqs

    def add_span(self, seq: int, layer: int, k: Any, v: Any, *, kind: str = "text",
                 grid: Tuple[int, int] = (0, 0), p0: int = 0) -> None:
        """One prefill span of `seq` at `layer`: k and v are [kv_heads][tokens][head_dim]
        NumPy arrays (float32 or float16) or torch CPU tensors (also bfloat16). Read in place
        when their channels are contiguous and their head and token strides are neither
        negative nor zero nor overlapping rows: contiguous, heads and tokens transposed (NHD),
        slices with positive steps. Anything else (negative steps like ``k[:, ::-1]``,
        ``np.broadcast_to`` or ``expand()`` views, strided channels, unaligned data) is copied
        once, since the library refuses those strides. ``kind`` "vision" (with its ``grid``
        (rows, cols)) or "text"; ``p0`` the position of its first token."""
        if not isinstance(kind, str) or kind not in _KINDS:
            raise _argument(f"span.kind: {_short(kind)} is not one of vision, text")
        seq, layer = _c_int(seq, "seq"), _c_int(layer, "layer")
        p0 = _c_int(p0, "p0")
        rows, cols = 0, 0
        if kind == "vision":
            if not isinstance(grid, (tuple, list)) or len(grid) != 2:
                raise _argument(f"grid: {_short(grid)}, expected (rows, cols)")
            rows, cols = _c_int(grid[0], "grid rows"), _c_int(grid[1], "grid cols")
        g = self.geometry
        k, n = _tokens_of(k, "k")
        n = _c_int(n, "k tokens")
        kv, ka = _view(k, "k", g.kv_heads, n, g.head_dim)
        vv, va = _view(v, "v", g.kv_heads, n, g.head_dim)
        span = _capi.SpanDesc(_KINDS[kind], n, rows, cols, p0)
        _check(lib.kvcap_cache_add_span(self._ptr(), seq, layer, ctypes.byref(span),
                                        ctypes.byref(kv), ctypes.byref(vv)))

    def add_post_queries(self, seq: int, layer: int, q: Any, lse: Any = None) -> None:
        """The post-vision prompt queries (vlcache), or the queries of KVzip's
        context-reconstruction pass (kvzip): q [q_heads][n][head_dim] float32; ``lse``
        [q_heads][n] (optional) each query's log-sum-exp over keys the cache does not hold (the
        pass's own tokens up to it; -inf for none)."""
        seq, layer = _c_int(seq, "seq"), _c_int(layer, "layer")
        a = _as_array(q, "q")
        n = _c_int(a.shape[1] if a.ndim == 3 else -1, "q tokens")
        a = _f32(a, "q", (self.geometry.q_heads, n, self.geometry.head_dim))
        if lse is None:
            _check(lib.kvcap_cache_add_post_queries(self._ptr(), seq, layer, a.ctypes.data, n))
            return
        b = _f32(_as_array(lse, "lse"), "lse", (self.geometry.q_heads, n))
        _check(lib.kvcap_cache_add_post_queries_lse(self._ptr(), seq, layer, a.ctypes.data,
                                                    b.ctypes.data, n))

    def end_prefill(self, seq: int) -> None:
        _check(lib.kvcap_cache_end_prefill(self._ptr(), _c_int(seq, "seq")))

    def append(self, seq: int, layer: int, k: Any, v: Any) -> None:
        """One generated token: k and v [kv_heads][head_dim] (or [kv_heads][1][head_dim]),
        read in place or copied as :meth:`add_span` says."""
        seq, layer = _c_int(seq, "seq"), _c_int(layer, "layer")
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
        position); returns out of the same shape, written into `out` when given: a writeable,
        C-contiguous float32 NumPy array of that shape (anything else is an Error)."""
        return self.attend_lse(layer, q, out)[0]

    def attend_lse(self, layer: int, q: Any, out: Optional[np.ndarray] = None
                   ) -> Tuple[np.ndarray, np.ndarray]:
        """attend, and the log-sum-exp of each query head's scores [n_seqs][q_heads]."""
        layer = _c_int(layer, "layer")
        g = self.geometry
        shape = (self.n_seqs, g.q_heads, g.head_dim)
        qa = _f32(q, "q", shape)
        if out is None:
            out = np.empty(shape, np.float32)
        else:
            out = _out(out, "out", shape)
            if np.may_share_memory(out, qa):
                qa = qa.copy()  # the library reads q while it writes out
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

    def uses_policy(self, policy: str) -> bool:
        """Whether the cache's runtime config gives `policy` ("kvzip", ...) to some span kind,
        or to the vision spans kvcapsule has no bucket for (kvcap_cache_uses_policy)."""
        if not isinstance(policy, str) or policy not in _capi.POLICIES:
            raise _argument(f"policy: {_short(policy)} is not one of "
                            f"{', '.join(_capi.POLICIES)}")
        return bool(lib.kvcap_cache_uses_policy(self._ptr(), _capi.POLICIES.index(policy)))

    def record_flush(self) -> None:
        """Record mode: writes the spans of every sequence whose prefill has ended."""
        _check(lib.kvcap_cache_record_flush(self._ptr()))

    def _free(self, handle: int) -> None:
        lib.kvcap_cache_free(handle)
