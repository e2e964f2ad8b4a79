"""kvcap.hf — Hugging Face transformers integration: ``model.generate`` unchanged, with every
decode-step attention computed by libkvcap on its compressed cache.

Importing this module registers the attention implementation ``"kvcap"`` with transformers
(prefill attention stays the model's own, through PyTorch's SDPA; decode attention is
``kvcap_cache_attend_lse`` over what the cache holds). :class:`KvcapCache` is a transformers
``Cache`` whose layers keep their K/V in one libkvcap cache: the prompt's spans go to the
policies of the runtime config, generated tokens are appended.

    import kvcap.hf
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="kvcap")
    inputs = tokenizer(prompt, return_tensors="pt")
    cache = kvcap.hf.KvcapCache(model, policies={"text": "streaming"})
    out = model.generate(**inputs, cache=cache, max_new_tokens=64, do_sample=False)
    print(cache.stats()["bytes_held"])

Spans: for the vision-language families transformers ships (Qwen2-VL / Qwen2.5-VL, Idefics3 /
SmolVLM, LLaVA / LLaVA-NeXT) :func:`detect_spans` finds the image spans and their grids in
the processor's output, and :func:`generate` does it for you; a text-only prompt is one text
span unless ``spans`` says otherwise. Tensors stay on the CPU (libkvcap's Python package keeps
its caches in host memory) in float32, float16 or bfloat16; batches are unpadded.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

import kvcap
from kvcap import Artifact, Error, Geometry
from kvcap._capi import POLICIES, STATUS_NAMES

__all__ = ["ATTENTION", "Span", "KvcapCache", "detect_spans", "geometry_from_config",
           "generate", "continuation_nll", "compare", "runtime_yaml", "reconstruction_prefix"]

#: The attn_implementation name this module registers.
ATTENTION = "kvcap"


def _error(status: str, message: str) -> Error:
    """An error found here, reported as libkvcap would: status by its name."""
    return Error(STATUS_NAMES.index(status), message)


def _argument(message: str) -> Error:
    return _error("INVALID_ARGUMENT", message)


def _state(message: str) -> Error:
    return _error("STATE", message)


# ---- Geometry -----------------------------------------------------------------------------------

def geometry_from_config(config: Any) -> Geometry:
    """The attention geometry of a transformers model config (its text model's, for a VLM):
    layers, heads, head_dim and RoPE (theta, and M-RoPE sections for Qwen2-VL). RoPE
    scalings other than none and M-RoPE (linear, dynamic, YaRN, Llama 3) are refused: kvcap
    would rotate keys with other frequencies than the model."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    q_heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or q_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // q_heads
    params = dict(getattr(text, "rope_parameters", None) or {})
    legacy = getattr(text, "rope_scaling", None) or {}
    theta = params.get("rope_theta", getattr(text, "rope_theta", 10000.0))
    rope_type = params.get("rope_type", legacy.get("rope_type", legacy.get("type", "default")))
    sections = params.get("mrope_section") or legacy.get("mrope_section")
    partial = params.get("partial_rotary_factor", getattr(text, "partial_rotary_factor", 1.0))
    if rope_type not in ("default", "mrope"):
        raise _argument(f"config.rope_parameters.rope_type: '{rope_type}' is not supported "
                        "(kvcap rotates with the plain RoPE frequencies: default or M-RoPE)")
    rope_dim = int(head_dim * partial) if partial and partial != 1.0 else 0
    name = getattr(config, "_name_or_path", "") or getattr(config, "model_type", "")
    return Geometry(layers=text.num_hidden_layers, q_heads=q_heads, kv_heads=kv_heads,
                    head_dim=head_dim, rope="mrope" if sections else "rope", pairing="half",
                    theta=float(theta), rope_dim=rope_dim,
                    sections=tuple(int(s) for s in sections) if sections else (),
                    name=os.path.basename(str(name))[:60])


# ---- Spans --------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Span:
    """A run of prompt tokens stored under one policy: ``kind`` "vision" (with its ``grid``,
    rows x cols == length) or "text"; ``start`` its first token's index in the prompt, ``p0``
    that token's RoPE position (for M-RoPE, the span's one offset for every section)."""

    kind: str
    start: int
    length: int
    grid: Tuple[int, int] = (0, 0)
    p0: int = 0


def _runs(ids: Sequence[int], token: int) -> List[Tuple[int, int]]:
    """(start, length) of every run of `token` in ids."""
    runs, i = [], 0
    while i < len(ids):
        if ids[i] == token:
            j = i
            while j < len(ids) and ids[j] == token:
                j += 1
            runs.append((i, j - i))
            i = j
        else:
            i += 1
    return runs


def _square(n: int, what: str) -> Tuple[int, int]:
    side = math.isqrt(n)
    if side * side != n:
        raise _argument(f"{what}: a run of {n} image tokens is not a square grid")
    return side, side


def _llava_next_grid(config: Any, image_size: Sequence[int], n: int) -> Tuple[int, int]:
    """The high-resolution part of a LLaVA-NeXT image: (rows, cols + 1), the unpadded grid of
    its tiles' features with the newline token that ends each row (the processor's count)."""
    from transformers.models.llava_next.modeling_llava_next import get_anyres_image_grid_shape

    vision = config.vision_config
    side = vision.image_size // vision.patch_size
    hp, wp = get_anyres_image_grid_shape(tuple(int(x) for x in image_size),
                                         config.image_grid_pinpoints, vision.image_size)
    h, w = int(image_size[0]), int(image_size[1])
    cur_h, cur_w = hp * side, wp * side
    if w / h > cur_w / cur_h:  # the image is wider: padding above and below
        new_h = int(round(h * (cur_w / w), 7))
        cur_h -= 2 * ((cur_h - new_h) // 2)
    else:
        new_w = int(round(w * (cur_h / h), 7))
        cur_w -= 2 * ((cur_w - new_w) // 2)
    if cur_h * (cur_w + 1) != n:
        raise _argument(f"image_sizes: an image of {h}x{w} gives {cur_h}x{cur_w + 1} "
                        f"high-resolution tokens, the prompt has {n}")
    return cur_h, cur_w + 1


def _vision_grids(config: Any, ids: Sequence[int], image_grid_thw: Any,
                  image_sizes: Any, first_image: int) -> Tuple[List[Tuple[int, int, int]], int]:
    """(start, rows, cols) of each vision span of one prompt, the positions' extra shift per
    span handled by the caller; returns the spans and how many images they used."""
    mt = config.model_type
    token = getattr(config, "image_token_id", None)
    if token is None:
        token = getattr(config, "image_token_index", None)
    if token is None:
        raise _argument(f"config.image_token_id: missing in a {mt} config")
    spans, image = [], first_image
    video = getattr(config, "video_token_id", None)
    if video is not None and video in ids:
        raise _argument("input_ids: video tokens; kvcap.hf detects image spans only")
    for start, n in _runs(ids, token):
        if mt in ("qwen2_vl", "qwen2_5_vl"):
            if image_grid_thw is None or image >= len(image_grid_thw):
                raise _argument(f"image_grid_thw: no grid for image {image} of the prompt")
            t, h, w = (int(x) for x in image_grid_thw[image])
            m = config.vision_config.spatial_merge_size
            rows, cols = h // m, w // m
            if t * rows * cols != n or t != 1:
                raise _argument(f"image_grid_thw[{image}] = ({t}, {h}, {w}) with merge {m} is "
                                f"{t} x {rows} x {cols} tokens, the prompt has {n}")
            spans.append((start, rows, cols))
        elif mt == "llava_next":
            side = config.vision_config.image_size // config.vision_config.patch_size
            if image_sizes is None or image >= len(image_sizes):
                raise _argument(f"image_sizes: no size for image {image} of the prompt")
            spans.append((start, side, side))
            rows, cols = _llava_next_grid(config, image_sizes[image], n - side * side)
            spans.append((start + side * side, rows, cols))
        else:  # idefics3, smolvlm, llava: each run is a square grid (a tile, or the image)
            rows, cols = _square(n, f"input_ids (image {image})")
            spans.append((start, rows, cols))
        image += 1
    return spans, image


#: Model types whose image spans detect_spans finds.
VISION_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "idefics3", "smolvlm", "llava", "llava_next")


def detect_spans(config: Any, input_ids: Any, *, image_grid_thw: Any = None,
                 image_sizes: Any = None) -> List[List[Span]]:
    """The spans of each prompt of a batch (input_ids [batch][tokens]) for the model's config:
    image spans with their grids for the families in VISION_MODEL_TYPES (Qwen2-VL takes
    ``image_grid_thw``, LLaVA-NeXT ``image_sizes``, as their processors return them), and text
    spans between them; a text-only model's prompt is one text span. RoPE positions follow the
    model: token indices, or Qwen2-VL's M-RoPE, where an image advances the text position by
    max(rows, cols)."""
    ids = input_ids.tolist() if hasattr(input_ids, "tolist") else [list(r) for r in input_ids]
    if ids and not isinstance(ids[0], list):
        ids = [ids]
    mrope = config.model_type in ("qwen2_vl", "qwen2_5_vl")
    vision = config.model_type in VISION_MODEL_TYPES
    out, image = [], 0
    for row in ids:
        grids, image = _vision_grids(config, row, image_grid_thw, image_sizes, image) \
            if vision else ([], image)
        spans, at, pos = [], 0, 0
        for start, rows, cols in grids:
            if start > at:
                spans.append(Span("text", at, start - at, (0, 0), pos))
                pos += start - at
            spans.append(Span("vision", start, rows * cols, (rows, cols), pos))
            pos += max(rows, cols) if mrope else rows * cols
            at = start + rows * cols
        if at < len(row):
            spans.append(Span("text", at, len(row) - at, (0, 0), pos))
        out.append(spans)
    return out


def _post_vision_start(spans: Sequence[Span]) -> int:
    """Where the prompt's tokens after its last vision span start; -1 when no text follows one."""
    last = max((i for i, s in enumerate(spans) if s.kind == "vision"), default=-1)
    if last < 0 or last == len(spans) - 1:
        return -1
    return spans[last].start + spans[last].length


# ---- The runtime config -------------------------------------------------------------------------


def runtime_yaml(policies: Mapping[str, str], sections: Optional[Mapping[str, Mapping[str, Any]]]
                 = None, fallback: Optional[str] = None) -> str:
    """A runtime YAML (configs/runtime.yaml's keys) choosing ``policies`` per span kind
    ("vision", "text", "generated"), with optional per-policy ``sections``
    ({"streaming": {"window": 256}}) and ``fallback``."""
    lines = ["policies:"]
    for kind, policy in policies.items():
        if kind not in ("vision", "text", "generated"):
            raise _argument(f"policies: '{kind}' is not a span kind (vision, text, generated)")
        if policy not in POLICIES:
            raise _argument(f"policies.{kind}: '{policy}' is not one of {', '.join(POLICIES)}")
        lines.append(f"  {kind}: {policy}")
    if fallback is not None:
        lines.append(f"fallback: {fallback}")
    for name, values in (sections or {}).items():
        lines.append(f"{name}:")
        lines += [f"  {k}: {v}" for k, v in values.items()]
    return "\n".join(lines) + "\n"


# ---- The cache ----------------------------------------------------------------------------------

_STORAGE = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}


class _Layer(CacheLayerMixin):
    """One decoder layer's view of the shared libkvcap cache: it counts the tokens seen (for
    the masks and positions transformers derives from the cache) and routes update()."""

    is_compileable = False
    is_croppable = False
    supports_early_init = False

    def __init__(self, owner: "KvcapCache", index: int):
        super().__init__()
        self.owner, self.index, self.seen = owner, index, 0

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> Tuple[torch.Tensor, torch.Tensor]:
        return self.owner._update(self, key_states, value_states)

    def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    @property
    def batch_size(self) -> int:
        return self.owner._batch

    def reset(self) -> None:
        raise _state("a KvcapCache cannot be reset: make a new one for a new prompt")

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise _state("a KvcapCache does not reorder its sequences (no beam search)")


class KvcapCache(Cache):
    """A transformers Cache that keeps every layer's K/V in one libkvcap cache.

    ``model`` is the transformers model (or its config). The runtime config comes from
    ``config`` (a YAML path, configs/runtime.yaml's keys) or from ``policies`` (span kind →
    policy, given to libkvcap as YAML text with ``sections`` and ``fallback``); without either
    libkvcap's defaults apply. ``artifact`` (a path or :class:`kvcap.Artifact`) holds the
    KVCapsule compressors; its geometry must match the model's (a :class:`kvcap.Artifact` must
    stay open until the prompt, when the libkvcap cache that then holds it is made; a path is
    opened here). ``spans`` gives each prompt's spans ([batch][spans] or one list for every
    prompt; default: one text span, or what :func:`detect_spans` finds when ``input_ids`` is
    given). ``storage`` is "f32", "f16",
    "bf16" or "auto" (the model's dtype). ``record_dir`` turns on libkvcap's record mode: the
    prompt's spans are written there as dataset shards kvcap-calibrate reads.

    A ``kvzip`` policy needs KVzip's context-reconstruction pass: give ``input_ids`` and
    ``tokenizer`` (for the instruction to repeat the context), and at the first decode step
    the cache runs the model over the prompt, that instruction and the prompt again, and hands
    the pass's queries to libkvcap (text prompts).
    """

    def __init__(self, model: Any, *, config: "os.PathLike[str] | str | None" = None,
                 policies: Optional[Mapping[str, str]] = None,
                 sections: Optional[Mapping[str, Mapping[str, Any]]] = None,
                 fallback: Optional[str] = None,
                 artifact: "Artifact | os.PathLike[str] | str | None" = None,
                 spans: Optional[Sequence[Any]] = None, input_ids: Any = None,
                 image_grid_thw: Any = None, image_sizes: Any = None,
                 storage: str = "auto", record_dir: "os.PathLike[str] | str | None" = None,
                 n_threads: int = 0, tokenizer: Any = None):
        mconfig = getattr(model, "config", model)
        self.model_config = mconfig
        self.geometry = geometry_from_config(mconfig)
        if config is not None and policies is not None:
            raise _argument("config and policies: give one of them")
        self.config_path = os.fspath(config) if config is not None else None
        self.config_yaml = (runtime_yaml(policies, sections, fallback) if policies is not None
                            else None)
        self._model = model if isinstance(model, torch.nn.Module) else None
        self._input_ids = input_ids
        self._prefix: Optional[List[int]] = None
        self._reconstructed = False
        if artifact is not None and not isinstance(artifact, Artifact):
            artifact = Artifact(artifact)
        self.artifact = artifact
        kvcap._c_int(n_threads, "n_threads")  # now, not at the prompt
        # the library's reading of the config: kvzip needs the reconstruction pass, and
        # expected_attention every prompt token's query (its statistics)
        self._kvzip, self._all_queries = self._probe("kvzip", "expected_attention")
        if self._kvzip:
            if self._model is None or input_ids is None or tokenizer is None:
                raise _argument("policy kvzip: the reconstruction pass needs the model, "
                                "input_ids and tokenizer")
            self._prefix = reconstruction_prefix(tokenizer)
        if spans is None and input_ids is not None:
            spans = detect_spans(mconfig, input_ids, image_grid_thw=image_grid_thw,
                                 image_sizes=image_sizes)
        self.spans = spans
        self.storage = storage
        self.record_dir = record_dir
        self.n_threads = n_threads
        self.kv: Optional[kvcap.Cache] = None
        self._batch = -1
        self._prompt = 0
        self._prompt_spans: List[List[Span]] = []  # per sequence, fixed by the prompt
        self._post_from: List[int] = []  # per sequence: where its post-vision queries start, or -1
        super().__init__(layers=[_Layer(self, i) for i in range(self.geometry.layers)])

    # -- set-up ------------------------------------------------------------------------------

    def _probe(self, *policies: str) -> Tuple[bool, ...]:
        """The library's own checks of the geometry, the runtime config and the artifact (its
        geometry against the model's), now rather than at the prompt: a one-sequence cache is
        made and freed. An artifact's error names its file. Returns, for each of `policies`,
        whether the config gives it to some span kind (or to the fallback), as the library
        read the config (kvcap_cache_uses_policy): the YAML is read by the library only."""
        try:
            probe = kvcap.Cache(self.geometry, n_seqs=1, storage="f32", artifact=self.artifact,
                                config=self.config_path, config_yaml=self.config_yaml,
                                n_threads=1)
        except Error as e:
            if self.artifact is not None and e.status_name == "GEOMETRY":
                raise Error(e.status, f"{self.artifact.path}: {e.message}") from None
            raise
        with probe:
            return tuple(probe.uses_policy(p) for p in policies)

    def _spans_of(self, seq: int, n: int, batch: int) -> List[Span]:
        spans = self.spans
        if spans is None:
            return [Span("text", 0, n)]
        if spans and isinstance(spans[0], Span):
            chosen = list(spans)  # one list for every prompt
        else:
            if seq >= len(spans):
                raise _argument(f"spans: {len(spans)} lists for a batch of {batch}")
            chosen = list(spans[seq])
        at = 0
        for i, s in enumerate(chosen):
            if s.start != at or s.length < 1:
                raise _argument(f"spans[{seq}][{i}]: starts at {s.start} with {s.length} tokens; "
                                f"spans must cover the prompt in order from token 0 (expected "
                                f"{at})")
            at += s.length
        if at != n:
            raise _argument(f"spans[{seq}]: cover {at} tokens, the prompt has {n}")
        return chosen

    def _open(self, key_states: torch.Tensor) -> None:
        storage = self.storage
        if storage == "auto":
            storage = _STORAGE.get(key_states.dtype, "f32")
        self.kv = kvcap.Cache(self.geometry, n_seqs=key_states.shape[0], storage=storage,
                              artifact=self.artifact, config=self.config_path,
                              config_yaml=self.config_yaml,
                              record_dir=self.record_dir, n_threads=self.n_threads)
        self._batch = key_states.shape[0]

    # -- the transformers side ---------------------------------------------------------------

    def _check(self, t: torch.Tensor, what: str, layer: int) -> None:
        if t.device.type != "cpu":
            raise _argument(f"layer {layer} {what}: a tensor on {t.device}; kvcap.hf keeps its "
                            "cache in host memory (run the model on the CPU)")
        if t.dtype not in _STORAGE:
            raise _argument(f"layer {layer} {what}: dtype {t.dtype}, expected float32, float16 "
                            "or bfloat16")
        g = self.geometry
        if t.dim() != 4 or t.shape[1] != g.kv_heads or t.shape[3] != g.head_dim:
            raise _argument(f"layer {layer} {what}: shape {tuple(t.shape)}, expected [batch, "
                            f"{g.kv_heads}, tokens, {g.head_dim}]")

    def _update(self, layer: _Layer, k: torch.Tensor, v: torch.Tensor
                ) -> Tuple[torch.Tensor, torch.Tensor]:
        li = layer.index
        self._check(k, "key_states", li)
        self._check(v, "value_states", li)
        if k.shape != v.shape:
            raise _argument(f"layer {li}: key_states {tuple(k.shape)} and value_states "
                            f"{tuple(v.shape)} differ")
        n = k.shape[2]
        if layer.seen == 0:  # the prompt: spans to the cache, attention left to the model
            if self.kv is not None and (k.shape[0] != self.batch_size or n != self._prompt):
                raise _argument(f"layer {li}: a prompt of {tuple(k.shape)}, layer 0's was "
                                f"[{self.batch_size}, ., {self._prompt}, .]")
            if self.kv is None:  # the first layer of the prompt fixes its spans
                spans = [self._spans_of(b, n, k.shape[0]) for b in range(k.shape[0])]
                self._open(k)
                self._prompt, self._prompt_spans = n, spans
                self._post_from = [0 if self._all_queries else _post_vision_start(sp)
                                   for sp in spans]
            for b in range(k.shape[0]):
                for s in self._prompt_spans[b]:
                    ks, vs = k[b, :, s.start:s.start + s.length], v[b, :, s.start:s.start + s.length]
                    self.kv.add_span(b, li, ks, vs, kind=s.kind, grid=s.grid, p0=s.p0)
            layer.seen = n
            k._kvcap_prompt = (self, li)  # the attention function hands the prompt's queries
            return k, v
        if n != 1:
            raise _state(f"layer {li}: {n} new tokens after the prompt; kvcap.hf appends one "
                         "generated token per step (no chunked prefill or assisted decoding)")
        if self._kvzip and not self._reconstructed:  # before the first append ends the prefill
            self._reconstruct()
        if k.shape[0] != self.batch_size:
            raise _argument(f"layer {li}: batch {k.shape[0]}, the prompt's was {self.batch_size}")
        for b in range(k.shape[0]):
            self.kv.append(b, li, k[b], v[b])
        layer.seen += 1
        k = k.detach()
        k._kvcap = (self, li)  # the attention function finds its cache and layer here
        return k, v

    def _attend(self, layer: int, query: torch.Tensor, scaling: Optional[float]) -> torch.Tensor:
        g = self.geometry
        if query.shape[1] != g.q_heads or query.shape[2] != 1 or query.shape[3] != g.head_dim:
            raise _argument(f"layer {layer} query: shape {tuple(query.shape)}, expected "
                            f"[batch, {g.q_heads}, 1, {g.head_dim}]")
        q = query[:, :, 0, :].to(torch.float32)
        if scaling is not None and not math.isclose(scaling * math.sqrt(g.head_dim), 1.0,
                                                    rel_tol=1e-6):
            q = q * (scaling * math.sqrt(g.head_dim))  # libkvcap scales by 1/sqrt(head_dim)
        q = q.contiguous()
        out, _ = self.kv.attend_lse(layer, q.numpy())
        return torch.from_numpy(out).to(query.dtype).unsqueeze(1)  # [batch, 1, heads, d]

    def _post_queries(self, layer: int, query: torch.Tensor) -> None:
        """The prompt's queries after its last vision span (VL-Cache's post-vision queries,
        and what record mode stores with the span), or all of them for expected_attention."""
        if self.kv is None or query.shape[2] != self._prompt:
            return
        for b, start in enumerate(self._post_from):
            if start < 0:
                continue
            q = query[b, :, start:, :].to(torch.float32).contiguous()
            self.kv.add_post_queries(b, layer, q.numpy())

    def _reconstruct(self) -> None:
        """KVzip's context-reconstruction pass on the model with its own attention: the prompt,
        the repeat instruction and the prompt again; each layer's queries of the pass, with
        their log-sum-exp over the pass's own keys, go to libkvcap."""
        self._reconstructed = True
        ids = torch.as_tensor(self._input_ids)
        if ids.dim() != 2 or ids.shape[0] != self.batch_size or ids.shape[1] != self._prompt:
            raise _argument(f"input_ids: shape {tuple(ids.shape)}, the prompt was "
                            f"[{self.batch_size}, {self._prompt}]")
        if getattr(self.model_config, "vision_config", None) is not None and \
                any(s.kind == "vision" for sp in self._prompt_spans for s in sp):
            raise _argument("policy kvzip: kvcap.hf runs the reconstruction pass on prompts "
                            "without images (the pass would need the image again)")
        prefix = torch.tensor([self._prefix] * ids.shape[0], dtype=ids.dtype)
        full = torch.cat([ids, prefix, ids], dim=1)
        r = prefix.shape[1] + ids.shape[1]
        global _CAPTURE
        _CAPTURE = {"tokens": r, "q": {}, "lse": {}}
        try:
            with torch.no_grad():
                self._model(input_ids=full, use_cache=False)
            got = _CAPTURE
        finally:
            _CAPTURE = None
        for li in range(self.geometry.layers):
            if li not in got["q"]:
                raise _state(f"layer {li}: the reconstruction pass did not reach its attention "
                             f"(attn_implementation must be '{ATTENTION}')")
            q, lse = got["q"][li], got["lse"][li]
            for b in range(q.shape[0]):
                self.kv.add_post_queries(b, li, q[b].contiguous().numpy(),
                                         lse[b].contiguous().numpy())

    # -- results -----------------------------------------------------------------------------

    @property
    def batch_size(self) -> int:
        """The batch the prompt came with (-1 before it)."""
        return self._batch

    def stats(self) -> Dict[str, Any]:
        """The libkvcap cache's statistics (kvcap_cache_stats): bytes held, bytes a full cache
        would hold, tokens and bytes per span kind and policy."""
        if self.kv is None:
            raise _state("the cache holds nothing yet (no prompt went through it)")
        return self.kv.stats()

    def record_flush(self) -> None:
        """Record mode: writes the spans of every prompt (their prefill has ended)."""
        if self.kv is not None:
            for b in range(self.batch_size):
                self.kv.end_prefill(b)
            self.kv.record_flush()

    def close(self) -> None:
        if self.kv is not None:
            self.kv.close()
            self.kv = None

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass


# ---- KVzip's reconstruction pass ----------------------------------------------------------------

#: While a KvcapCache runs its reconstruction pass: the pass's length and, per layer, its queries
#: [batch, q_heads, R, d] and their log-sum-exp over the pass's keys [batch, q_heads, R].
_CAPTURE: Optional[Dict[str, Any]] = None

_REPEAT = "\n\nRepeat the previous context exactly."


def reconstruction_prefix(tokenizer: Any) -> List[int]:
    """The token ids between the prompt and its repetition in KVzip's reconstruction pass, as
    kvpress builds them: the instruction to repeat the context, then the chat template's turn
    to the assistant ("\\n" without a chat template)."""
    suffix = "\n"
    if getattr(tokenizer, "chat_template", None):
        dummy = "dummy context"
        sep = "\n" + "#" * len(dummy)
        text = tokenizer.apply_chat_template([{"role": "user", "content": dummy + sep}],
                                             add_generation_prompt=True, tokenize=False)
        suffix = text.split(sep)[1]
    return (tokenizer.encode(_REPEAT, add_special_tokens=False) +
            tokenizer.encode(suffix, add_special_tokens=False))


def _capture(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
             scaling: Optional[float]) -> None:
    r = _CAPTURE["tokens"]
    if query.shape[2] < r:
        return
    layer = int(getattr(module, "layer_idx", len(_CAPTURE["q"])))
    d = query.shape[-1]
    q = query[:, :, -r:, :].to(torch.float32)
    if scaling is not None and not math.isclose(scaling * math.sqrt(d), 1.0, rel_tol=1e-6):
        q = q * (scaling * math.sqrt(d))  # libkvcap scales by 1/sqrt(head_dim)
    k = key[:, :, -r:, :].to(torch.float32)
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    s = q @ k.transpose(-1, -2) / math.sqrt(d)
    s = s.masked_fill(torch.triu(torch.ones(r, r, dtype=torch.bool), 1), float("-inf"))
    _CAPTURE["q"][layer] = q
    _CAPTURE["lse"][layer] = torch.logsumexp(s, dim=-1)


# ---- The attention implementation ---------------------------------------------------------------

def kvcap_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                    value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                    scaling: Optional[float] = None, dropout: float = 0.0, **kwargs: Any
                    ) -> Tuple[torch.Tensor, None]:
    """transformers' attention interface: a decode step whose key came from a KvcapCache is
    attended by libkvcap; everything else (the prompt, a model run without a KvcapCache) by
    PyTorch's SDPA, as attn_implementation="sdpa" would."""
    tag = getattr(key, "_kvcap", None)
    if _CAPTURE is not None and tag is None:
        _capture(module, query, key, scaling)
    if tag is None:
        prompt = getattr(key, "_kvcap_prompt", None)
        if prompt is not None:
            prompt[0]._post_queries(prompt[1], query)
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    cache, layer = tag
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dtype == torch.bool \
            and not bool(attention_mask.all()):
        raise _argument("attention_mask: padded or masked tokens; kvcap.hf decodes unpadded "
                        "batches only")
    return cache._attend(layer, query, scaling), None


def _register() -> None:
    AttentionInterface.register(ATTENTION, kvcap_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


_register()


# ---- One call -----------------------------------------------------------------------------------

def generate(model: Any, inputs: Mapping[str, Any], *, cache: Optional[KvcapCache] = None,
             **kwargs: Any) -> Tuple[torch.Tensor, KvcapCache]:
    """``model.generate(**inputs)`` through a KvcapCache whose spans are detected from the
    inputs (input_ids, and image_grid_thw or image_sizes where the model has them). Keyword
    arguments KvcapCache takes (config, policies, sections, fallback, artifact, storage,
    record_dir, n_threads) make the cache; the others go to generate. Returns the generated
    ids and the cache (whose stats() tell the bytes held)."""
    cache_kwargs = {k: kwargs.pop(k) for k in _CACHE_KWARGS if k in kwargs}
    if getattr(model.config, "_attn_implementation", None) != ATTENTION:
        model.set_attn_implementation(ATTENTION)
    if cache is None:
        cache = KvcapCache(model, input_ids=inputs["input_ids"],
                           image_grid_thw=inputs.get("image_grid_thw"),
                           image_sizes=inputs.get("image_sizes"), **cache_kwargs)
    elif cache_kwargs:
        raise _argument(f"{', '.join(cache_kwargs)}: given with a ready cache")
    out = model.generate(**inputs, cache=cache, **kwargs)
    if cache.record_dir is not None:
        cache.record_flush()
    return out, cache


_CACHE_KWARGS = ("config", "policies", "sections", "fallback", "artifact", "storage", "record_dir",
                 "n_threads", "tokenizer")


@torch.no_grad()
def continuation_nll(model: Any, inputs: Mapping[str, Any], continuation: torch.Tensor,
                     cache: Optional[Cache] = None) -> Tuple[float, float]:
    """Teacher forcing: the prompt, then the tokens of ``continuation`` (1-D) one step at a
    time through ``cache`` (a KvcapCache, or None for transformers' own). Returns the mean
    negative log-likelihood of the continuation in nats per token and the share of its tokens
    that were the argmax (next-token agreement)."""
    if inputs["input_ids"].shape[0] != 1:
        raise _argument("inputs: continuation_nll takes one prompt (batch 1)")
    out = model(**inputs, cache=cache, use_cache=True)
    cache = out.cache if hasattr(out, "cache") and out.cache is not None else \
        getattr(out, "past_key_values", cache)
    n = inputs["input_ids"].shape[1]
    nll, agree = 0.0, 0
    logits = out.logits[0, -1]
    for i, t in enumerate(continuation.tolist()):
        lp = torch.log_softmax(logits.float(), dim=-1)
        nll -= float(lp[t])
        agree += int(int(lp.argmax()) == t)
        if i + 1 == len(continuation):
            break
        ids = torch.tensor([[t]])
        out = model(input_ids=ids, attention_mask=torch.ones(1, n + i + 1, dtype=torch.long),
                    cache=cache, use_cache=True)
        logits = out.logits[0, -1]
    k = max(len(continuation), 1)
    return nll / k, agree / k


def compare(model: Any, inputs: Mapping[str, Any], *, tokens: int = 64, **kwargs: Any
            ) -> Dict[str, float]:
    """One prompt through transformers' own cache and through a KvcapCache (kwargs make it, as
    in :func:`generate`): greedy agreement of ``tokens`` generated tokens (position by
    position), the teacher-forced NLL of full's continuation under each cache, and the bytes
    kvcap's cache holds against a full one."""
    bad = [k for k in kwargs if k not in _CACHE_KWARGS]
    if bad:
        raise _argument(f"{', '.join(bad)}: not a KvcapCache argument")
    if getattr(model.config, "_attn_implementation", None) != ATTENTION:
        model.set_attn_implementation(ATTENTION)
    n = inputs["input_ids"].shape[1]
    gen = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    full = model.generate(**inputs, **gen)[0, n:]
    got, cache = generate(model, inputs, **kwargs, **gen)
    got = got[0, n:]
    m = min(len(full), len(got))
    agreement = float((full[:m] == got[:m]).float().mean()) if m else 1.0
    nll_full, _ = continuation_nll(model, inputs, full)
    tf_cache = KvcapCache(model, input_ids=inputs["input_ids"],
                          image_grid_thw=inputs.get("image_grid_thw"),
                          image_sizes=inputs.get("image_sizes"), **kwargs)
    nll_kvcap, next_agree = continuation_nll(model, inputs, full, tf_cache)
    s = cache.stats()
    return {"greedy_agreement": agreement, "nll_full": nll_full, "nll_kvcap": nll_kvcap,
            "next_token_agreement": next_agree, "bytes_held": float(s["bytes_held"]),
            "bytes_full_equivalent": float(s["bytes_full_equivalent"])}
