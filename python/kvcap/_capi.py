"""_capi.py — libkvcap's public C API (include/kvcap.h) through ctypes: the library located and
loaded once, the structs mirrored field for field, and every function's signature declared.
Nothing here computes anything: the kernels, formats and caches are the C library's."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

MAX_NAME = 64
MAX_ROPE_SECTIONS = 4
# The range of a C int, which ctypes would otherwise truncate to silently (2**32 becomes 0).
INT_MAX = 2 ** (8 * ctypes.sizeof(ctypes.c_int) - 1) - 1
INT_MIN = -INT_MAX - 1

# enum kvcap_status
OK = 0
STATUS_NAMES = (
    "OK",
    "INVALID_ARGUMENT",
    "OUT_OF_MEMORY",
    "IO",
    "FORMAT",
    "VERSION",
    "CONFIG",
    "GEOMETRY",
    "UNSUPPORTED",
    "NUMERIC",
    "DEVICE",
    "STATE",
    "NOT_FOUND",
    "INTERNAL",
)

# enum kvcap_dtype
DTYPE_F32, DTYPE_F16, DTYPE_BF16, DTYPE_F64, DTYPE_I32, DTYPE_U8 = range(6)
# enum kvcap_rope_type / kvcap_rope_pairing
ROPE_NONE, ROPE_ROPE, ROPE_MROPE = range(3)
PAIRING_HALF, PAIRING_ADJACENT = range(2)
# enum kvcap_policy
POLICIES = ("full", "kvcapsule", "flashcache", "vlcache", "freekv", "streaming", "kvzip",
            "random", "expected_attention")
# enum kvcap_span_kind
SPAN_VISION, SPAN_TEXT, SPAN_GENERATED = range(3)
# enum kvcap_memory
MEMORY_HOST, MEMORY_CUDA = range(2)


class ModelGeometry(ctypes.Structure):
    _fields_ = [
        ("name", ctypes.c_char * MAX_NAME),
        ("n_layers", ctypes.c_int),
        ("n_q_heads", ctypes.c_int),
        ("n_kv_heads", ctypes.c_int),
        ("head_dim", ctypes.c_int),
        ("rope_type", ctypes.c_int),
        ("rope_pairing", ctypes.c_int),
        ("rope_dim", ctypes.c_int),
        ("rope_theta", ctypes.c_double),
        ("n_rope_sections", ctypes.c_int),
        ("rope_sections", ctypes.c_int * MAX_ROPE_SECTIONS),
    ]


TASK_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, ctypes.c_int)
PARALLEL_FOR_FN = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int, TASK_FN, ctypes.c_void_p)


class CacheParams(ctypes.Structure):
    _fields_ = [
        ("model", ModelGeometry),
        ("n_seqs", ctypes.c_int),
        ("storage", ctypes.c_int),
        ("artifact", ctypes.c_void_p),
        ("config_path", ctypes.c_char_p),
        ("record_dir", ctypes.c_char_p),
        ("n_threads", ctypes.c_int),
        ("parallel_for", ctypes.c_void_p),
        ("parallel_user", ctypes.c_void_p),
        ("memory", ctypes.c_int),
        ("cuda_device", ctypes.c_int),
        ("reserve_tokens", ctypes.c_int),
        ("config_yaml", ctypes.c_char_p),
    ]


class TensorView(ctypes.Structure):
    _fields_ = [
        ("base", ctypes.c_void_p),
        ("pages", ctypes.c_void_p),
        ("page_size", ctypes.c_int),
        ("dtype", ctypes.c_int),
        ("head_stride", ctypes.c_int64),
        ("token_stride", ctypes.c_int64),
    ]


class SpanDesc(ctypes.Structure):
    _fields_ = [
        ("kind", ctypes.c_int),
        ("n_tokens", ctypes.c_int),
        ("rows", ctypes.c_int),
        ("cols", ctypes.c_int),
        ("p0", ctypes.c_int),
    ]


class CacheStats(ctypes.Structure):
    _fields_ = [
        ("bytes_held", ctypes.c_uint64),
        ("bytes_by_policy", ctypes.c_uint64 * len(POLICIES)),
        ("bytes_by_kind", ctypes.c_uint64 * 3),
        ("bytes_full_equivalent", ctypes.c_uint64),
        ("tokens_by_kind", ctypes.c_int64 * 3),
        ("bytes_read_last_attend", ctypes.c_uint64),
        ("map_bytes_read_last_attend", ctypes.c_uint64),
        ("spans_fallback", ctypes.c_int64),
        ("compress_seconds", ctypes.c_double),
        ("freekv_head_steps", ctypes.c_int64),
        ("freekv_corrections", ctypes.c_int64),
        ("freekv_pages_recalled", ctypes.c_int64),
        ("freekv_bytes_recalled", ctypes.c_uint64),
        ("freekv_reselections", ctypes.c_int64),
        ("freekv_hidden", ctypes.c_int64),
        ("freekv_waited", ctypes.c_int64),
    ]


def _candidates() -> list[Path]:
    """Where libkvcap may be: $KVCAP_LIBRARY, then next to this package (the wheel's copy)."""
    found = []
    env = os.environ.get("KVCAP_LIBRARY")
    if env:
        found.append(Path(env))
    here = Path(__file__).resolve().parent
    found += sorted(here.glob("libkvcap.so*")) + sorted(here.glob("libkvcap*.dylib"))
    return found


def _load() -> ctypes.CDLL:
    tried = _candidates()
    for path in tried:
        if path.is_file():
            return ctypes.CDLL(str(path))
    where = ", ".join(str(p) for p in tried) or "(none)"
    raise ImportError(
        "kvcap: libkvcap was not found (tried "
        + where
        + "); install the package with `pip install ./python`, or set KVCAP_LIBRARY to a "
        "built libkvcap.so"
    )


lib = _load()

_S = ctypes.c_int  # enum kvcap_status
_P = ctypes.c_void_p
_SIGNATURES = {
    "kvcap_version": (ctypes.c_char_p, []),
    "kvcap_version_number": (ctypes.c_uint, []),
    "kvcap_status_str": (ctypes.c_char_p, [ctypes.c_int]),
    "kvcap_last_error": (ctypes.c_char_p, []),
    "kvcap_dtype_size": (ctypes.c_size_t, [ctypes.c_int]),
    "kvcap_dtype_name": (ctypes.c_char_p, [ctypes.c_int]),
    "kvcap_geometry_validate": (_S, [ctypes.POINTER(ModelGeometry)]),
    "kvcap_artifact_open": (_S, [ctypes.c_char_p, ctypes.POINTER(_P)]),
    "kvcap_artifact_free": (None, [_P]),
    "kvcap_artifact_geometry": (ctypes.POINTER(ModelGeometry), [_P]),
    "kvcap_cache_default_params": (None, [ctypes.POINTER(CacheParams)]),
    "kvcap_cache_create": (_S, [ctypes.POINTER(CacheParams), ctypes.POINTER(_P)]),
    "kvcap_cache_free": (None, [_P]),
    "kvcap_cache_add_span": (
        _S,
        [_P, ctypes.c_int, ctypes.c_int, ctypes.POINTER(SpanDesc), ctypes.POINTER(TensorView),
         ctypes.POINTER(TensorView)],
    ),
    "kvcap_cache_add_post_queries": (_S, [_P, ctypes.c_int, ctypes.c_int, _P, ctypes.c_int]),
    "kvcap_cache_add_post_queries_lse": (
        _S, [_P, ctypes.c_int, ctypes.c_int, _P, _P, ctypes.c_int]),
    "kvcap_cache_end_prefill": (_S, [_P, ctypes.c_int]),
    "kvcap_cache_append": (
        _S, [_P, ctypes.c_int, ctypes.c_int, ctypes.POINTER(TensorView), ctypes.POINTER(TensorView)]
    ),
    "kvcap_cache_attend": (_S, [_P, ctypes.c_int, _P, _P]),
    "kvcap_cache_attend_lse": (_S, [_P, ctypes.c_int, _P, _P, _P]),
    "kvcap_cache_stats": (_S, [_P, ctypes.POINTER(CacheStats)]),
    "kvcap_cache_uses_policy": (ctypes.c_int, [_P, ctypes.c_int]),
    "kvcap_cache_record_flush": (_S, [_P]),
    "kvcap_cuda_device_count": (ctypes.c_int, []),
}
for _name, (_res, _args) in _SIGNATURES.items():
    _fn = getattr(lib, _name)
    _fn.restype = _res
    _fn.argtypes = _args

if sys.byteorder != "little":  # the file formats and the views assume it
    raise ImportError("kvcap: a little-endian machine is required")
