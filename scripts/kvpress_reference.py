#!/usr/bin/env python3
"""kvpress_reference.py — NVIDIA's kvpress as an outside reference beside kvcap's evaluation:
the same model (SmolLM2-135M-Instruct from the project's GGUF, run by transformers), the same
prompts (the "prompt_ids" a kvcap-eval text-track run writes into its metrics.json), only the
span compressed (the head and tail tokens always kept), at the same retentions. Metrics as
kvcap-eval computes them, per press and retention, averaged over the prompts: the
teacher-forced NLL of the held-out continuation in nats/token and its difference from the full
cache's (dNLL), the KL divergence of the next-token distribution from full's, next-token
agreement with full's argmax, and the realised share of the span kept.

Presses: ScorerPress subclasses get the span restriction by a wrapper that gives every token
outside the span the highest score (kept) and sets the compression ratio so that head + tail +
retention x span tokens remain, the same number per KV head (kvpress's ScorerPress rule).
KVzip shares its budget across layers and heads (its own rule); the tokens outside the span get
its sink treatment (never evicted). Run by scripts/kvpress-reference.sh, which makes the venv
(kvpress 0.5.5 needs transformers < 5.3). On the image track the span enters as the same
embeddings kvcap-eval used (its span_embeddings.safetensors, inputs_embeds here), in the
prefill and in KVzip's reconstruction pass alike.

kvpress.json says which run it was measured on, from what this script did, not copied from
the metrics: the track, the SHA-256 of the prompts it fed transformers (prompts_sha256, defined
as kvcap-eval's in report/report.h), the retentions it ran and the full cache's NLL it measured;
kvcap-report shows its rows only when all four are the run's.

KVzip's press, as shipped, starts its replay (and the keys its softmax runs over, beyond 4
sinks) after as many tokens as the chat template puts before a user's text: 24 for SmolLM2,
whose prompts here are not in chat form, so the first 8 tokens of the span are neither replayed
nor scored and go first. `kvzip` is that press as an outside user runs it; `kvzip_whole_prompt`
is the same press replaying the whole prompt, as the paper does, the row to check kvcap's
kvzip against.
"""
import argparse
import hashlib
import importlib.metadata
import json
import os
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--metrics", required=True,
                    help="a kvcap-eval run's metrics.json: prompts, layout and (image track) the "
                         "span's embeddings beside it")
    ap.add_argument("--model", default=os.environ.get("KVCAP_MODEL") or os.path.expanduser(
        "~/.cache/kvcap/models/SmolLM2-135M-Instruct.Q4_1.gguf"), help="the GGUF model")
    ap.add_argument("--retentions", default="0.2,0.4", help="span shares kept (default 0.2,0.4)")
    ap.add_argument("--presses", default="kvzip,kvzip_whole_prompt,expected_attention,snapkv,"
                    "observed_attention,streaming_llm,random",
                    help="comma-separated (default: all seven)")
    ap.add_argument("--prompts", type=int, default=0, help="at most this many prompts (0: all)")
    ap.add_argument("--out", required=True, help="JSON file to write (rows per press x retention)")
    return ap.parse_args()


def load_model(gguf_path, workdir):
    """transformers reads the GGUF (dequantised to f32); saved once as a plain checkpoint so
    that presses which load the tokenizer by the model's name (KVzip) find it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    plain = os.path.join(workdir, "checkpoint")
    if not os.path.isdir(plain):
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        model.save_pretrained(plain)
        tok.save_pretrained(plain)
    return AutoModelForCausalLM.from_pretrained(plain, dtype=torch.float32,
                                                attn_implementation="sdpa").eval()


def prompts_sha256(fed):
    """metrics.json's prompts_sha256 (report/report.h) of what this script feeds the model: for
    each (ids, span_embd) in prompt order, the ids (prompt then continuation) as int32
    little-endian, then, on the image track, the span's embeddings as float32 little-endian."""
    h = hashlib.sha256()
    for ids, span_embd in fed:
        h.update(struct.pack(f"<{len(ids)}i", *ids))
        if span_embd is not None:
            rows = span_embd.detach().to("cpu", torch.float32).contiguous().numpy()
            h.update(rows.astype("<f4", copy=False).tobytes())
    return h.hexdigest()


def embedded(model, ids, at, rows):
    """The input embeddings of ids ([1][n]) with rows ([k][hidden]) in place of positions
    at .. at + k: an image span's embeddings where its placeholder ids stand."""
    x = model.get_input_embeddings()(ids).clone()
    x[0, at:at + rows.shape[0]] = rows
    return x


@torch.no_grad()
def continuation_logprobs(model, prompt, cont, press=None, eager=False, span_embd=None, head=0):
    """Log-probabilities of the continuation's positions: the prompt prefilled (compressed by
    `press` inside its context), then the continuation teacher-forced in one forward over the
    compressed cache at its true positions. Returns [len(cont)][vocab] and the cache length."""
    from transformers import DynamicCache

    if eager:
        model.set_attn_implementation("eager")
    cache = DynamicCache(config=model.config)
    ids = torch.tensor([prompt])
    kw = {"input_ids": ids}
    if span_embd is not None:  # the image track: the span's rows are the image's embeddings
        kw = {"inputs_embeds": embedded(model, ids, head, span_embd)}
    try:
        if press is None:
            out = model(past_key_values=cache, use_cache=True, **kw)
        else:
            with press(model):
                out = model(past_key_values=cache, use_cache=True, **kw)
    finally:
        if eager:
            model.set_attn_implementation("sdpa")
    first = torch.log_softmax(out.logits[0, -1].float(), dim=-1)
    n = len(prompt)
    c = torch.tensor([cont[:-1]])
    pos = torch.arange(n, n + c.shape[1]).unsqueeze(0)
    rest = model(input_ids=c, past_key_values=cache, position_ids=pos, use_cache=True)
    lp = torch.cat([first[None], torch.log_softmax(rest.logits[0].float(), dim=-1)])
    return lp, cache


def span_kept(cache, model, head, span, tail, n_forced):
    """The realised share of the span kept, over all layers and KV heads: the rows the cache
    holds (KVzip: less the rows it masks), less the continuation's n_forced rows and the head
    and tail, over the span's rows."""
    kvh, L = model.config.num_key_value_heads, len(model.model.layers)
    held = sum(layer.keys.shape[2] for layer in cache.layers) * kvh
    for layer in model.model.layers:
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            held -= len(masked[0])
    return (held - (n_forced + head + tail) * kvh * L) / (span * kvh * L)


def make_press(name, retention, head, span, n, prompt_ids=None, span_embd=None):
    """A kvpress press compressing only the span of an n-token prompt to `retention`.
    span_embd (image track): the span's input embeddings; KVzip's replay needs prompt_ids."""
    from kvpress import (ExpectedAttentionPress, KVzipPress, ObservedAttentionPress,
                         RandomPress, ScorerPress, SnapKVPress, StreamingLLMPress)

    ratio = (1.0 - retention) * span / n  # of the whole prompt: head and tail stay

    if name in ("kvzip", "kvzip_whole_prompt"):
        @dataclass
        class SpanKVzip(KVzipPress):
            head_tokens: int = 0
            span_tokens: int = 0
            whole_prompt: bool = False  # replay from the first token
            prompt_ids: list = None     # image track: the prompt (the span's ids are placeholders)
            span_embd: torch.Tensor = None

            # The press learns the prompt's ids from the prefill's input_ids; an image-track
            # prefill passes embeddings instead, so the ids are supplied.
            @property
            def _context_ids(self):
                seen = getattr(self, "_ids_seen", None)
                if seen is None and self.prompt_ids is not None:
                    return torch.tensor([self.prompt_ids])
                return seen

            @_context_ids.setter
            def _context_ids(self, ids):
                self._ids_seen = ids

            def prepare(self, model, tokenizer, prev_postfix_size=8):
                if self.whole_prompt:
                    self.prefix_length = 0
                return super().prepare(model, tokenizer, prev_postfix_size)

            def _perform_kvzip_compression(self, model, tokenizer):
                if self.span_embd is None:
                    return super()._perform_kvzip_compression(model, tokenizer)
                # Each replay chunk repeats prompt positions [start_idx, end_idx) at its end;
                # the span's positions among them take the span's embeddings.
                inner = model.model.forward

                def replay_embedded(*args, input_ids=None, **kw):
                    at = input_ids.shape[1] - (self.end_idx - self.start_idx) - self.start_idx
                    lo = max(self.head_tokens, self.start_idx)
                    hi = max(lo, min(self.head_tokens + self.span_tokens, self.end_idx))
                    rows = self.span_embd[lo - self.head_tokens:hi - self.head_tokens]
                    return inner(*args, inputs_embeds=embedded(model, input_ids, at + lo, rows),
                                 **kw)

                model.model.forward = replay_embedded
                try:
                    return super()._perform_kvzip_compression(model, tokenizer)
                finally:
                    model.model.forward = inner

            def compress_post(self, model):
                if self.compression_ratio > 0:
                    top = self.score_val.amax() + 1.0
                    self.score_val[..., : self.head_tokens] = top
                    self.score_val[..., self.head_tokens + self.span_tokens:] = top
                return super().compress_post(model)

        return SpanKVzip(compression_ratio=ratio, head_tokens=head, span_tokens=span,
                         whole_prompt=name == "kvzip_whole_prompt",
                         prompt_ids=prompt_ids if span_embd is not None else None,
                         span_embd=span_embd), False

    inner = {"expected_attention": ExpectedAttentionPress, "snapkv": SnapKVPress,
             "observed_attention": ObservedAttentionPress, "streaming_llm": StreamingLLMPress,
             "random": RandomPress}[name]
    kw = {"seed": 0} if name == "random" else {}

    @dataclass
    class SpanOnly(ScorerPress):
        inner: ScorerPress = field(default=None)

        def score(self, module, hidden_states, keys, values, attentions, kwargs):
            s = self.inner.score(module, hidden_states, keys, values, attentions, kwargs).clone()
            top = torch.finfo(s.dtype).max
            s[..., :head] = top
            s[..., head + span:] = top
            return s

    return SpanOnly(compression_ratio=ratio, inner=inner(**kw)), name == "observed_attention"


def main():
    a = parse_args()
    with open(a.metrics) as f:
        m = json.load(f)
    track = m.get("track", {})
    if "prompt_ids" not in m:
        sys.exit(f"{a.metrics}: no prompt_ids (rerun kvcap-eval run)")
    embds = None
    if track.get("kind") == "image":
        if "span_embeddings" not in track:
            sys.exit(f"{a.metrics}: an image-track run without span_embeddings (rerun "
                     "kvcap-eval run --track image)")
        from safetensors.torch import load_file
        path = os.path.join(os.path.dirname(os.path.abspath(a.metrics)), track["span_embeddings"])
        embds = load_file(path)["span_embeddings"]
    setup = m["setup"]
    head, span, tail = setup["head_tokens"], setup["span_tokens"], setup["tail_tokens"]
    n = head + span + tail
    prompts = m["prompt_ids"][: a.prompts or None]
    retentions = [float(x) for x in a.retentions.split(",")]
    presses = [p for p in a.presses.split(",") if p]
    import transformers

    work = os.environ.get("KVCAP_KVPRESS_WORK") or tempfile.mkdtemp(prefix="kvpress-ref-")
    model = load_model(a.model, work)
    full, full_nll = [], []  # per prompt: the full cache's log-probabilities and NLL
    fed = []  # per prompt: the ids and span embeddings given to the model (prompts_sha256)
    def embd_of(i):
        return None if embds is None else embds[i]

    for i, p in enumerate(prompts):
        ids = p["ids"]
        prompt, cont, span_embd = ids[:n], ids[n:], embd_of(i)
        lp, _ = continuation_logprobs(model, prompt, cont, span_embd=span_embd, head=head)
        fed.append((prompt + cont, span_embd))
        full.append(lp)
        full_nll.append(-lp.gather(1, torch.tensor(cont)[:, None]).mean().item())
    fed_sha256 = prompts_sha256(fed)
    rows = []
    total = len(presses) * len(retentions) * len(prompts)
    done, t0 = 0, time.time()
    for name in presses:
        for r in retentions:
            nll = dnll = kl = agree = kept = 0.0
            per_dnll, per_kl = [], []  # per prompt: the report's paired intervals
            for i, (p, lp_full, nll_full) in enumerate(zip(prompts, full, full_nll)):
                ids = p["ids"]
                cont = torch.tensor(ids[n:])
                press, eager = make_press(name, r, head, span, n, ids[:n], embd_of(i))
                lp, cache = continuation_logprobs(model, ids[:n], ids[n:], press, eager,
                                                  span_embd=embd_of(i), head=head)
                tok_nll = -lp.gather(1, cont[:, None]).mean().item()
                step_kl = (lp_full.exp() * (lp_full - lp)).sum(-1).mean().item()
                nll += tok_nll
                dnll += tok_nll - nll_full
                kl += step_kl
                per_dnll.append(tok_nll - nll_full)
                per_kl.append(step_kl)
                agree += (lp.argmax(-1) == lp_full.argmax(-1)).float().mean().item()
                kept += span_kept(cache, model, head, span, tail, len(ids) - n - 1)
                for layer in model.model.layers:  # KVzip's masks must not leak to the next run
                    layer.self_attn.masked_key_indices = None
                done += 1
                if sys.stderr.isatty():
                    sys.stderr.write(f"\r\033[Kkvpress: {done}/{total} ({time.time() - t0:.0f} s)")
            k = len(prompts)
            rows.append({"press": name, "retention": r, "nll": nll / k, "dnll": dnll / k,
                         "kl": kl / k, "next_token_agreement": agree / k,
                         "realised_retention": kept / k,
                         "per_prompt": {"dnll": per_dnll, "kl": per_kl}})
    if sys.stderr.isatty():
        sys.stderr.write("\r\033[K")
    out = {"source": "kvpress", "kvpress_version": importlib.metadata.version("kvpress"),
           "transformers_version": transformers.__version__,
           "metrics": os.path.abspath(a.metrics), "prompts": len(prompts),
           "layout": {"head": head, "span": span, "tail": tail,
                      "continuation": len(prompts[0]["ids"]) - n},
           # what binds this file to the run (kvcap-report checks each): measured here
           "track": "image" if embds is not None else "text", "prompts_sha256": fed_sha256,
           "retentions": retentions, "full_nll": sum(full_nll) / len(prompts), "rows": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    kv_full = next((r["nll"] for r in m["runs"] if r["label"] == "full"), float("nan"))
    print(f"kvpress {out['kvpress_version']} on transformers {out['transformers_version']}, "
          f"beside kvcap-eval's run {a.metrics}: {len(prompts)} prompts of {head} + {span} + "
          f"{tail} tokens, {out['layout']['continuation']} teacher-forced")
    print(f"full NLL: transformers {out['full_nll']:.4f}, kvcap's engine {kv_full:.4f} "
          f"(storage {setup.get('storage', '?')}; the same prompts give the same text)")
    if len(prompts) == setup["prompts"] and m.get("prompts_sha256") not in (None, fed_sha256):
        print(f"kvpress-reference: the prompts fed here hash to {fed_sha256}, the run's to "
              f"{m['prompts_sha256']}: kvcap-report will not show these rows", file=sys.stderr)
    table = [("kvpress " + r["press"], r["retention"], r["realised_retention"], r["dnll"],
              r["kl"], r["next_token_agreement"]) for r in rows]
    if len(prompts) == setup["prompts"]:  # kvcap's rows cover the same prompts only then
        table += [("kvcap " + r["label"], r["retention"], r["realised_retention"],
                   r["nll_delta"], r["kl"], r["next_token_agreement"])
                  for r in m["runs"] if r["label"] != "full"
                  and any(abs(r["retention"] - x) < 1e-9 for x in retentions)]
    print(f"{'method':<30} {'kept':>5} {'real':>6} {'dNLL':>8} {'KL':>8} {'agree':>7}")
    # by KL: on the image track every compressed cache's dNLL is below full's (the projected
    # photo is noise to the language model), so its sign does not rank fidelity there
    for name, r, real, d, kl, ag in sorted(table, key=lambda t: (t[1], t[4])):
        print(f"{name:<30} {r:>5.2f} {real:>6.3f} {d:>+8.4f} {kl:>8.4f} {100 * ag:>6.1f}%")


if __name__ == "__main__":
    main()
