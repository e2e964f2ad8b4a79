"""test_hf.py — kvcap.hf, the transformers integration, against transformers itself and against
the C reference engine:
 - SmolLM2-135M-Instruct read by transformers from the project's GGUF: 64 greedy tokens with
   the full policy equal transformers' own cache token for token, logits within LOGIT_TOL;
   with a compressing policy (FlashCache on an image-like span) the tokens and the
   teacher-forced NLL equal the C engine's (kvcap-eval generate) on the same ids and config;
 - KVzip keeping its values in KVCapsule's value basis, with an artifact recorded through
   kvcap.hf, calibrated and converted here: the same tokens and NLL as the C engine on the same
   artifact, at the budget, and not plain KVzip's answer;
 - tiny random-weight Qwen2-VL and Idefics3 built here (no download): spans, grids and M-RoPE
   offsets detected from a synthetic image, full through kvcap equals transformers, and record
   -> kvcap-calibrate -> kvcap-convert -> generate with kvcapsule at retention 1 equals full;
 - LLaVA and LLaVA-NeXT span detection against transformers' own feature counts;
 - bad input (dtype, device, shape, spans, an artifact of another model) raises kvcap.Error
   naming the problem and leaves the cache usable.
Skipped (visibly) where torch/transformers or the model file are missing."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import kvcap  # noqa: E402
import kvcap.hf  # noqa: E402
import kvcap.tools  # noqa: E402
from kvcap.hf import Span  # noqa: E402

TOOLS = Path(os.environ.get("KVCAP_TOOLS", "")) if os.environ.get("KVCAP_TOOLS") else None
MODEL = Path(os.environ.get("KVCAP_MODEL") or
             Path.home() / ".cache/kvcap/models/SmolLM2-135M-Instruct.Q4_1.gguf")

# Full through kvcap vs transformers' SDPA, f32 weights and storage: the two attentions sum in
# different orders (libkvcap's online softmax in f32), a few ulps that 30 layers carry to the
# logits: measured 2.9e-5 over 64 tokens; the bound leaves 30x.
LOGIT_TOL = 1e-3
# The same policy through transformers and through the C engine: different matmul kernels, the
# same cache decisions; measured 9e-6 nats/token over 32 tokens.
NLL_TOL = 2e-4
# KVzip through transformers and through the C engine: the budget's cut falls among scores a
# few 1e-5 apart (relative), where the engines' float rounding of the pass's queries decides a
# few of 1440 places: measured |dNLL| 1.4e-3 nats/token over 24 tokens (tokens equal for 8).
KVZIP_NLL_TOL = 5e-3
# The same with the values in KVCapsule's basis: a flipped key at the cut also moves its tile's
# least-squares fit and the choice of exact values: measured 5.8e-3 over 24 tokens (tokens
# equal for 11), against 7.6e-2 between it and plain KVzip at the same budget.
KVZIP_BASIS_NLL_TOL = 1.5e-2
# Tiny random models at retention 1 (the KVCapsule maps reconstruct exactly up to float
# rounding through the PCA basis and key maps): relative to the largest logit; measured ~1e-5.
TINY_REL_TOL = 1e-3


def tool(name):
    if TOOLS is None or not (TOOLS / name).exists():
        pytest.skip(f"{name} not found (KVCAP_TOOLS names the build folder)")
    return str(TOOLS / name)


def c_engine(inputs, spans, config, generate, continuation, *extra):
    """kvcap-eval generate (the C reference engine) on the same ids: its JSON."""
    r = subprocess.run([tool("kvcap-eval"), "generate", "-m", str(MODEL),
                        "--ids", ",".join(map(str, inputs["input_ids"][0].tolist())),
                        "--spans", spans, "-c", str(config), *extra, "--generate", str(generate),
                        "--continuation", ",".join(map(str, continuation.tolist()))],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def greedy(model, inputs, n, **kw):
    out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                         output_logits=True, return_dict_in_generate=True, **kw)
    return out.sequences[0, inputs["input_ids"].shape[1]:], torch.stack(out.logits)


# ---- SmolLM2 from the GGUF ----------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm():
    if not MODEL.exists():
        pytest.skip(f"{MODEL} not found (scripts/fetch-model.sh fetches it)")
    pytest.importorskip("gguf")
    tok = transformers.AutoTokenizer.from_pretrained(MODEL.parent, gguf_file=MODEL.name)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        MODEL.parent, gguf_file=MODEL.name, dtype=torch.float32).eval()
    return model, tok


def license_prompt(tok, n):
    text = Path("/usr/share/common-licenses/Apache-2.0").read_text()[:4000]
    ids = tok(text, return_tensors="pt")["input_ids"][:, :n]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def test_full_generation_equals_transformers(smollm):
    model, tok = smollm
    inputs = dict(tok("The capital of France is Paris. The capital of Germany is",
                      return_tensors="pt"))
    model.set_attn_implementation("sdpa")
    want, want_logits = greedy(model, inputs, 64)
    model.set_attn_implementation(kvcap.hf.ATTENTION)
    cache = kvcap.hf.KvcapCache(model, policies={"text": "full", "generated": "full"})
    got, got_logits = greedy(model, inputs, 64, cache=cache)
    assert got.tolist() == want.tolist()
    assert float((got_logits - want_logits).abs().max()) <= LOGIT_TOL
    s = cache.stats()
    n = inputs["input_ids"].shape[1]
    assert s["tokens_by_kind"] == {"vision": 0, "text": n, "generated": 63}
    assert s["bytes_by_policy"]["full"] > 0


def against_the_c_engine(smollm, tmp_path, policies, sections, tokens, *c_args, **cache_kw):
    """One 120-token license prompt with an 8x8 "vision" span at tokens 16-79, through
    transformers with a KvcapCache of ``policies`` (greedy ``tokens``, then the teacher-forced
    NLL of full's continuation on a fresh cache) and through the C engine (kvcap-eval generate
    with ``c_args``) on the same ids and config. Returns full's tokens, kvcap.hf's tokens, its
    NLL and agreement, the C engine's JSON, the first cache and the prompt length."""
    model, tok = smollm
    model.set_attn_implementation(kvcap.hf.ATTENTION)
    inputs = license_prompt(tok, 120)
    n = inputs["input_ids"].shape[1]
    spans = [Span("text", 0, 16, (0, 0), 0), Span("vision", 16, 64, (8, 8), 16),
             Span("text", 80, n - 80, (0, 0), 80)]
    kw = dict(policies=policies, sections=sections, spans=spans, storage="f32", **cache_kw)
    full, _ = greedy(model, inputs, tokens)
    cache = kvcap.hf.KvcapCache(model, **kw)
    got, _ = greedy(model, inputs, tokens, cache=cache)
    nll, agree = kvcap.hf.continuation_nll(model, inputs, full, kvcap.hf.KvcapCache(model, **kw))
    config = tmp_path / "runtime.yaml"
    config.write_text(kvcap.hf.runtime_yaml(policies, sections))
    c = c_engine(inputs, f"text:16,vision:8x8,text:{n - 80}", config, tokens, full, *c_args)
    return full, got, nll, agree, c, cache, n


def test_compressing_policy_matches_the_c_engine(smollm, tmp_path):
    policies = {"vision": "flashcache", "text": "full", "generated": "full"}
    full, got, nll, agree, c, cache, n = against_the_c_engine(smollm, tmp_path, policies, None,
                                                              32)
    assert got.tolist() == c["generated"]
    assert abs(nll - c["continuation_nll"]) <= NLL_TOL
    assert agree == pytest.approx(c["continuation_agreement"])
    # FlashCache really evicted: the span holds 40 % of its rows, and the answer moved
    s = cache.stats()
    assert s["bytes_by_policy"]["flashcache"] < 0.5 * 64 / n * s["bytes_full_equivalent"] * 2
    assert got.tolist() != full.tolist()


def test_kvzip_matches_the_c_engine(smollm, tmp_path):
    """KVzip through transformers (the cache runs the reconstruction pass at the first decode
    step) and through the C engine (kvcap-eval generate --replay) on the same ids: the same
    tokens and NLL, so both hand libkvcap the same queries and normalisers."""
    model, tok = smollm
    policies = {"vision": "kvzip", "text": "full", "generated": "full"}
    prefix = kvcap.hf.reconstruction_prefix(tok)
    inputs = license_prompt(tok, 120)
    full, got, nll, agree, c, cache, n = against_the_c_engine(
        smollm, tmp_path, policies, {"kvzip": {"retention": 0.25}}, 24,
        "--replay", ",".join(map(str, prefix)), input_ids=inputs["input_ids"], tokenizer=tok)
    assert got[:8].tolist() == c["generated"][:8]
    assert abs(nll - c["continuation_nll"]) <= KVZIP_NLL_TOL
    assert abs(agree - c["continuation_agreement"]) <= 0.1
    s = cache.stats()  # a quarter of the span's rows over all layers and heads
    assert s["bytes_by_policy"]["kvzip"] == pytest.approx(
        0.25 * 64 / n * s["bytes_by_kind"]["text"] * n / (n - 64), rel=0.02)
    # without the tokenizer the pass cannot be built: said at construction
    with pytest.raises(kvcap.Error, match="tokenizer"):
        kvcap.hf.KvcapCache(model, policies=policies, spans=cache.spans,
                            input_ids=inputs["input_ids"])


def test_kvzip_value_basis_matches_the_c_engine(smollm, tmp_path):
    """KVzip keeping the span's values in KVCapsule's value basis (kvzip: {values: basis}) with
    an artifact made here from SmolLM2's own K/V: record through kvcap.hf on other windows of
    the license, kvcap-calibrate (an 8x8 bucket of 4x4 tiles), kvcap-convert at rank 4 of 16.
    The same artifact and config through transformers and through the C engine give the same
    tokens and NLL; the cache holds the budget, and the basis really replaced the value rows
    (the answer moves against plain KVzip at the same budget)."""
    model, tok = smollm
    model.set_attn_implementation(kvcap.hf.ATTENTION)
    text = tok(Path("/usr/share/common-licenses/Apache-2.0").read_text(),
               return_tensors="pt")["input_ids"]
    record_dir = tmp_path / "record"
    spans = [Span("text", 0, 16, (0, 0), 0), Span("vision", 16, 64, (8, 8), 16),
             Span("text", 80, 40, (0, 0), 80)]
    for w in range(1, 7):  # windows after the prompt's (tokens 0-119)
        ids = text[:, 120 * w:120 * (w + 1)]
        cache = kvcap.hf.KvcapCache(model, policies={"vision": "full"}, spans=spans,
                                    storage="f32", record_dir=record_dir)
        with torch.no_grad():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), cache=cache,
                  use_cache=True)
        cache.record_flush()
        cache.close()
    artifact = calibrate(tmp_path, model, record_dir, 8, 8, tile=(4, 4), ratio=0.25)
    policies = {"vision": "kvzip", "text": "full", "generated": "full"}
    prefix = kvcap.hf.reconstruction_prefix(tok)
    inputs = license_prompt(tok, 120)
    sections = {"kvzip": {"retention": 0.25, "values": "basis", "exact_values": 2}}
    full, got, nll, agree, c, cache, n = against_the_c_engine(
        smollm, tmp_path, policies, sections, 24, "--replay",
        ",".join(map(str, prefix)), "-a", str(artifact),
        input_ids=inputs["input_ids"], tokenizer=tok, artifact=artifact)
    assert got[:8].tolist() == c["generated"][:8]
    assert abs(nll - c["continuation_nll"]) <= KVZIP_BASIS_NLL_TOL
    assert abs(agree - c["continuation_agreement"]) <= 0.1
    s = cache.stats()  # a quarter of the span's bytes: keys, the value state and exact values
    span_bytes = 64 / n * s["bytes_by_kind"]["text"] * n / (n - 64)
    assert s["bytes_by_policy"]["kvzip"] == pytest.approx(0.25 * span_bytes, rel=0.02)
    # plain KVzip at the same budget holds another cache: its NLL is elsewhere
    rows = kvcap.hf.KvcapCache(model, policies=policies, sections={"kvzip": {"retention": 0.25}},
                               spans=cache.spans, storage="f32", input_ids=inputs["input_ids"],
                               tokenizer=tok)
    nll_rows, _ = kvcap.hf.continuation_nll(model, inputs, full, rows)
    assert abs(nll - nll_rows) > 2 * KVZIP_BASIS_NLL_TOL


def test_expected_attention_matches_the_c_engine(smollm, tmp_path):
    """Expected Attention through transformers (the cache takes every prompt token's query from
    the prefill) and through the C engine (kvcap-eval generate --prompt-queries)."""
    policies = {"vision": "expected_attention", "text": "full", "generated": "full"}
    full, got, nll, agree, c, cache, n = against_the_c_engine(
        smollm, tmp_path, policies, {"expected_attention": {"retention": 0.25}}, 24,
        "--prompt-queries")
    assert got.tolist() == c["generated"]
    assert abs(nll - c["continuation_nll"]) <= NLL_TOL
    assert agree == pytest.approx(c["continuation_agreement"])
    s = cache.stats()
    assert s["bytes_by_policy"]["expected_attention"] == 2 * 30 * 3 * 16 * 64 * 4
    assert got.tolist() != full.tolist()  # it really evicted


# ---- Tiny vision-language models ----------------------------------------------------------------

def tiny_qwen2_vl():
    torch.manual_seed(0)
    cfg = transformers.Qwen2VLConfig(
        text_config=dict(vocab_size=256, hidden_size=128, intermediate_size=256,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=64, max_position_embeddings=512, initializer_range=0.2,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                          "mrope_section": [8, 12, 12]},
                         bos_token_id=1, eos_token_id=2),
        vision_config=dict(depth=1, embed_dim=32, hidden_size=128, num_heads=2, patch_size=4,
                           temporal_patch_size=2, spatial_merge_size=2, in_channels=3),
        image_token_id=250, video_token_id=251, vision_start_token_id=252,
        vision_end_token_id=253, vocab_size=256, bos_token_id=1, eos_token_id=2)
    model = transformers.Qwen2VLForConditionalGeneration(cfg).eval()

    def prompt(seed):
        """Text, an 8x8-patch image (a 4x4 grid after the 2x2 merge), text."""
        g = torch.Generator().manual_seed(seed)
        ids = torch.tensor([[1, 3, 4, 252] + [250] * 16 + [253, 5, 6, 7, 8]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "pixel_values": torch.randn(64, 3 * 2 * 4 * 4, generator=g),
                "image_grid_thw": torch.tensor([[1, 8, 8]]),
                "mm_token_type_ids": (ids == 250).int()}

    # M-RoPE: the image starts at position 4 (one offset for all sections); the text after it
    # at 4 + max(4, 4) = 8, not at its index 20
    spans = [Span("text", 0, 4, (0, 0), 0), Span("vision", 4, 16, (4, 4), 4),
             Span("text", 20, 5, (0, 0), 8)]
    return model, prompt, spans


def tiny_idefics3():
    torch.manual_seed(0)
    cfg = transformers.Idefics3Config(
        text_config=dict(model_type="llama", vocab_size=256, hidden_size=128,
                         intermediate_size=256, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2, pad_token_id=0),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, image_size=64, patch_size=8),
        scale_factor=2, image_token_id=250, vocab_size=256)
    model = transformers.Idefics3ForConditionalGeneration(cfg).eval()

    def prompt(seed):
        """Text, a 64x64 image (8x8 patches, 4x4 tokens after the 2x2 pixel shuffle), text."""
        g = torch.Generator().manual_seed(seed)
        ids = torch.tensor([[1, 3, 4] + [250] * 16 + [5, 6, 7, 8]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                "pixel_values": torch.randn(1, 1, 3, 64, 64, generator=g)}

    spans = [Span("text", 0, 3, (0, 0), 0), Span("vision", 3, 16, (4, 4), 3),
             Span("text", 19, 4, (0, 0), 19)]
    return model, prompt, spans


def record(model, prompt, record_dir, n, tokens):
    """n prompts (seeds 0..n-1) through kvcap.hf in record mode; returns the shards written."""
    for seed in range(n):
        kvcap.hf.generate(model, prompt(seed), record_dir=record_dir,
                          policies={"vision": "full"}, max_new_tokens=tokens,
                          min_new_tokens=tokens, do_sample=False)
    return sorted(record_dir.glob("*.safetensors"))


def calibrate(tmp, model, record_dir, rows, cols, tile=None, ratio=1.0):
    """kvcap-calibrate on the recorded shards (one rows x cols bucket: dense, or tiled with
    ``tile`` = (rows, cols)) at retention ``ratio``, then kvcap-convert (through kvcap.tools)."""
    g = kvcap.hf.geometry_from_config(model.config)
    rope = f"{{type: {g.rope}, pairing: half, theta: {g.theta}" + (
        f", sections: [{', '.join(map(str, g.sections))}]}}" if g.sections else "}")
    bucket = (f"structure: tiled, tile: [{tile[0]}, {tile[1]}]" if tile else "structure: dense")
    config = tmp / "calib.yaml"
    config.write_text(
        f"model:\n  name: tiny\n  layers: {g.layers}\n  q_heads: {g.q_heads}\n"
        f"  kv_heads: {g.kv_heads}\n  head_dim: {g.head_dim}\n  rope: {rope}\n"
        f"buckets:\n  - {{rows: {rows}, cols: {cols}, {bucket}}}\n"
        f"schedule:\n  keys: {{kind: uniform, ratio: {ratio}}}\n"
        f"  values: {{kind: uniform, ratio: {ratio}}}\n"
        "keys: {method: closed_form, activation: linear, hidden: 0, ridge: 1.0e-6}\n"
        "validation: {fraction: 0.2, seed: 7}\nstorage: f32\n")
    tool("kvcap-calibrate")
    state = kvcap.tools.calibrate(record_dir, tmp / "state.kvcs", config=config, device="cpu")
    artifact = kvcap.tools.convert(state, tmp / "tiny.kvcap", keys=f"uniform:{ratio}",
                                   values=f"uniform:{ratio}", fallback="full")
    report = kvcap.tools.inspect(artifact)
    layout = f"{rows}x{cols} tiled {tile[0]}x{tile[1]}" if tile else f"{rows}x{cols} dense"
    assert "kind       artifact" in report and layout in report
    return artifact


@pytest.mark.parametrize("make", [tiny_qwen2_vl, tiny_idefics3], ids=["qwen2_vl", "idefics3"])
def test_tiny_vlm_end_to_end(make, tmp_path):
    model, prompt, want_spans = make()
    p = prompt(99)
    assert kvcap.hf.detect_spans(model.config, p["input_ids"],
                                 image_grid_thw=p.get("image_grid_thw")) == [want_spans]
    want, want_logits = greedy(model, p, 8)
    scale = float(want_logits.abs().max())

    # full through kvcap equals transformers
    got, cache = kvcap.hf.generate(model, p, policies={"vision": "full"}, max_new_tokens=8,
                                   min_new_tokens=8, do_sample=False, output_logits=True,
                                   return_dict_in_generate=True)
    assert got.sequences[0, p["input_ids"].shape[1]:].tolist() == want.tolist()
    assert float((torch.stack(got.logits) - want_logits).abs().max()) <= TINY_REL_TOL * scale
    assert cache.stats()["tokens_by_kind"]["vision"] == 16

    # record -> kvcap-calibrate -> kvcap-convert -> kvcapsule at retention 1
    record_dir = tmp_path / "record"
    assert len(record(model, prompt, record_dir, 10, 4)) == 10
    artifact = calibrate(tmp_path, model, record_dir, 4, 4)
    got, cache = kvcap.hf.generate(model, p, artifact=artifact, policies={"vision": "kvcapsule"},
                                   fallback="full", max_new_tokens=8, min_new_tokens=8,
                                   do_sample=False, output_logits=True,
                                   return_dict_in_generate=True)
    assert got.sequences[0, p["input_ids"].shape[1]:].tolist() == want.tolist()
    assert float((torch.stack(got.logits) - want_logits).abs().max()) <= TINY_REL_TOL * scale
    assert cache.stats()["bytes_by_policy"]["kvcapsule"] > 0

    # a compressing policy through the same path changes the answer (the cache is used)
    got, _ = kvcap.hf.generate(model, p, policies={"vision": "streaming"},
                               sections={"streaming": {"sinks": 2, "window": 2}},
                               max_new_tokens=8, min_new_tokens=8, do_sample=False,
                               output_logits=True, return_dict_in_generate=True)
    assert float((torch.stack(got.logits) - want_logits).abs().max()) > TINY_REL_TOL * scale


# ---- LLaVA span detection -------------------------------------------------------------------------

def test_llava_spans():
    cfg = transformers.LlavaConfig(image_token_id=32000)  # CLIP ViT-L/14 at 336: 24x24
    ids = [1, 2] + [32000] * 576 + [3, 4, 5]
    assert kvcap.hf.detect_spans(cfg, [ids]) == [[
        Span("text", 0, 2, (0, 0), 0), Span("vision", 2, 576, (24, 24), 2),
        Span("text", 578, 3, (0, 0), 578)]]
    with pytest.raises(kvcap.Error, match="square"):
        kvcap.hf.detect_spans(cfg, [[1] + [32000] * 575])


def test_llava_next_spans():
    from transformers.models.llava_next.modeling_llava_next import (get_anyres_image_grid_shape,
                                                                     unpad_image)
    cfg = transformers.LlavaNextConfig(image_token_id=32000)
    side = cfg.vision_config.image_size // cfg.vision_config.patch_size
    size = (500, 300)  # height, width
    hp, wp = get_anyres_image_grid_shape(size, cfg.image_grid_pinpoints,
                                         cfg.vision_config.image_size)
    feat = unpad_image(torch.zeros(1, hp * side, wp * side), torch.tensor(size))
    rows, cols = feat.shape[1], feat.shape[2] + 1  # a newline token ends every row
    ids = [1] + [32000] * (side * side + rows * cols) + [2]
    spans = kvcap.hf.detect_spans(cfg, [ids], image_sizes=[size])[0]
    assert [s.kind for s in spans] == ["text", "vision", "vision", "text"]
    assert spans[1].grid == (side, side) and spans[2].grid == (rows, cols)
    with pytest.raises(kvcap.Error, match="image_sizes"):
        kvcap.hf.detect_spans(cfg, [ids[:-5]], image_sizes=[size])


# ---- Bad input --------------------------------------------------------------------------------------

def test_bad_input_leaves_the_cache_usable(tmp_path):
    model, prompt, spans = tiny_idefics3()
    p = prompt(1)
    model.set_attn_implementation(kvcap.hf.ATTENTION)
    want, _ = greedy(model, p, 6)
    cache = kvcap.hf.KvcapCache(model, input_ids=p["input_ids"], policies={"vision": "full"})
    good = torch.zeros(1, 1, 4, 64)
    for bad, pattern in ((good.double(), "dtype torch.float64"),
                         (torch.zeros(1, 1, 4, 64, device="meta"), "meta"),
                         (torch.zeros(1, 2, 4, 64), r"shape \(1, 2, 4, 64\)")):
        with pytest.raises(kvcap.Error, match=pattern) as e:
            cache.update(bad, bad, 0)
        assert "layer 0" in e.value.message
    assert cache.get_seq_length() == 0
    got, _ = greedy(model, p, 6, cache=cache)  # still usable: the whole generation
    assert got.tolist() == want.tolist()

    # spans that do not cover the prompt, or a wrong batch
    with pytest.raises(kvcap.Error, match="cover 22 tokens"):
        kvcap.hf.generate(model, p, cache=kvcap.hf.KvcapCache(
            model, spans=[Span("text", 0, 22)]), max_new_tokens=2)
    # an artifact of another model (the tiny Qwen2-VL's M-RoPE geometry)
    qwen, qprompt, _ = tiny_qwen2_vl()
    record_dir = tmp_path / "record"
    record(qwen, qprompt, record_dir, 6, 2)
    artifact = calibrate(tmp_path, qwen, record_dir, 4, 4)
    with pytest.raises(kvcap.Error) as e:
        kvcap.hf.KvcapCache(model, artifact=artifact)
    assert e.value.status_name == "GEOMETRY" and "model.rope.type" in e.value.message
    assert str(artifact) in e.value.message
    # policies that are not
    with pytest.raises(kvcap.Error, match="'fastest' is not one of"):
        kvcap.hf.KvcapCache(model, policies={"vision": "fastest"})


def test_readme_example():
    """The README's kvcap.hf example, taken from the README itself, runs as written."""
    if not MODEL.exists():
        pytest.skip(f"{MODEL} not found (scripts/fetch-model.sh fetches it)")
    root = Path(__file__).resolve().parents[2]
    text = (root / "README.md").read_text()
    block = text.split("<!-- hf-example -->\n```python\n", 1)[1].split("```\n<!-- /hf-example -->")[0]
    block = block.replace('Path.home() / ".cache/kvcap/models/SmolLM2-135M-Instruct.Q4_1.gguf"',
                          f"Path({str(MODEL)!r})")
    import sys

    r = subprocess.run([sys.executable, "-c", block], capture_output=True, text=True,
                       timeout=600, cwd=root / "python")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Paris" in r.stdout and "bytes held" in r.stdout


def test_batch_and_bfloat16():
    """Two prompts of one length in one batch, and a bfloat16 model (the cache stores bf16,
    its K/V read in place): each row equals transformers' own generation."""
    model, prompt, _ = tiny_idefics3()
    a, b = prompt(3), prompt(4)
    both = {"input_ids": torch.cat([a["input_ids"], b["input_ids"].flip(1)]),
            "pixel_values": torch.cat([a["pixel_values"], b["pixel_values"]])}
    both["attention_mask"] = torch.ones_like(both["input_ids"])
    # bf16: transformers attends in bf16, libkvcap in f32 over the bf16 rows, and the model's
    # bf16 layers round both; measured 1.2e-2 of the largest logit (a few bf16 ulps)
    for dtype, tol in ((torch.float32, TINY_REL_TOL), (torch.bfloat16, 0.05)):
        model = model.to(dtype)
        inputs = dict(both, pixel_values=both["pixel_values"].to(dtype))
        model.set_attn_implementation("sdpa")
        want = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
        got, cache = kvcap.hf.generate(model, inputs, policies={"vision": "full"},
                                       max_new_tokens=6, min_new_tokens=6, do_sample=False,
                                       output_logits=True, return_dict_in_generate=True)
        assert cache.batch_size == 2
        scale = float(torch.stack(want.logits).abs().max())
        diff = float((torch.stack(got.logits).float() - torch.stack(want.logits).float()).abs().max())
        assert diff <= tol * scale, (dtype, diff, scale)
        if dtype == torch.float32:
            assert got.sequences.tolist() == want.sequences.tolist()
        assert cache.kv is not None and cache.stats()["tokens_by_kind"]["vision"] == 32


# ---- The runtime config as the library reads it; the command line's errors ----------------------

ROOT = Path(__file__).resolve().parents[2]


def tiny_llama_config():
    return transformers.LlamaConfig(vocab_size=64, hidden_size=128, intermediate_size=128,
                                    num_hidden_layers=1, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=64,
                                    max_position_embeddings=256)


@pytest.fixture(scope="module")
def tiny_llama_dir(tmp_path_factory):
    """A one-layer random Llama saved as a checkpoint folder (no tokenizer): what --model
    loads in a second."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    transformers.LlamaForCausalLM(tiny_llama_config()).save_pretrained(folder)
    return folder


# Command lines run by kvcap.hf's main() in one child process, each with its stderr and exit
# status: a timeout bounds a hang (a FIFO), an address-space limit a read without end
# (/dev/zero), so that a regression fails the test instead of the machine.
CLI = """
import contextlib, io, json, resource, sys, traceback
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
from kvcap.hf.__main__ import main
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            status = main(argv)
        except SystemExit as e:
            status = e.code
        except BaseException:
            traceback.print_exc()
            status = "raised"
    results.append([status, err.getvalue()])
print("\\n" + json.dumps(results))
"""


def cli(*command_lines):
    """[(exit status, stderr)] of each command line (a list of arguments)."""
    argvs = [[str(x) for x in argv] for argv in command_lines]
    package = Path(kvcap.__file__).resolve().parents[1]  # the kvcap this test imported
    r = subprocess.run([sys.executable, "-c", CLI, json.dumps(argvs)], capture_output=True,
                       text=True, timeout=60 + 15 * len(argvs), cwd=package,
                       env={**os.environ, "HF_HUB_OFFLINE": "1",
                            "HF_HUB_DISABLE_PROGRESS_BARS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def last_line(err):
    """What the command line said of an error: its one "kvcap.hf:" line, the last (before it,
    transformers may have logged while loading)."""
    err = err.strip()
    assert "Traceback" not in err, err[-3000:]
    ours = [line for line in err.splitlines() if line.startswith("kvcap.hf:")]
    assert len(ours) == 1 and err.endswith(ours[0]), err[-3000:]
    return ours[0]


def test_runtime_config_policies_are_the_library_s(tmp_path):
    """Whether a config uses kvzip or expected_attention is asked of the library
    (kvcap_cache_uses_policy), not searched for in the YAML text: a commented-out kvzip line
    is not kvzip."""
    cfg = tiny_llama_config()
    commented = tmp_path / "commented.yaml"
    commented.write_text("policies:\n  vision: full\n#  text: kvzip\n  text: full\n"
                         "# generated: expected_attention\n")
    cache = kvcap.hf.KvcapCache(cfg, config=commented)  # no model, tokenizer: not needed
    assert not cache._kvzip and not cache._all_queries
    used = tmp_path / "kvzip.yaml"
    used.write_text("policies: {vision: full, text: kvzip}  # with the reconstruction pass\n")
    with pytest.raises(kvcap.Error, match="policy kvzip: the reconstruction pass needs"):
        kvcap.hf.KvcapCache(cfg, config=used)
    ea = tmp_path / "ea.yaml"
    ea.write_text("policies:\n  vision: expected_attention\n")
    cache = kvcap.hf.KvcapCache(cfg, config=ea)
    assert cache._all_queries and not cache._kvzip
    assert kvcap.hf.KvcapCache(cfg, policies={"vision": "expected_attention"})._all_queries
    with pytest.raises(kvcap.Error, match="policy kvzip"):
        kvcap.hf.KvcapCache(cfg, policies={"text": "kvzip"})


def test_cli_config_that_is_not_a_file_fails_fast(tiny_llama_dir, tmp_path):
    """--config naming a FIFO or /dev/zero: libkvcap refuses what is not a regular file at once
    (Python no longer reads the file first: a FIFO hung, /dev/zero exhausted memory); one line,
    status 1 (a libkvcap error). The same command line with a policy runs."""
    fifo = tmp_path / "runtime.fifo"
    os.mkfifo(fifo)
    run = ("generate", "--model", tiny_llama_dir, "--input-ids", "1,2,3", "--tokens", "2")
    ok, *bad = cli((*run, "--policy", "text=full"), (*run, "--config", fifo),
                   (*run, "--config", "/dev/zero"))
    assert ok[0] == 0, ok[1][-3000:]
    for (status, err), path in zip(bad, (fifo, "/dev/zero")):
        assert status == 1, err[-3000:]
        assert last_line(err).startswith(f"kvcap.hf: IO: {path}: not a regular file")


def test_cli_bad_arguments_are_one_line(tiny_llama_dir, tmp_path):
    """A bad --model, --input-ids, --rounds or --tokens: one line "kvcap.hf: ..." naming the
    argument and status 2 (a bad command line), never a traceback."""
    model = ("--model", tiny_llama_dir)
    cases = {
        "--model": ("generate", "--model", tmp_path / "missing", "--input-ids", "1,2"),
        "--model ": ("generate", "--model", "no-such-org/no-such-model", "--input-ids", "1,2"),
        "--input-ids": ("generate", *model, "--input-ids", "1,x,3"),
        "--input-ids ": ("generate", *model, "--input-ids", "1,2,64"),  # vocabulary of 64
        "--rounds": ("bench", *model, "--input-ids", "1,2", "--rounds", "0"),
        "--tokens": ("generate", *model, "--input-ids", "1,2", "--tokens", "-3"),
        "--prompt": ("generate", *model),
        "--prompts": ("eval", *model, "--prompts", tmp_path / "missing.txt"),
    }
    for name, (status, err) in zip(cases, cli(*cases.values())):
        assert status == 2, (name, status, err[-3000:])
        assert last_line(err).startswith(f"kvcap.hf: {name.strip()}"), (name, err)
