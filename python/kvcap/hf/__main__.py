"""python -m kvcap.hf — run a Hugging Face model with libkvcap's cache, offline on local
checkpoints (a folder, a GGUF file, or a hub id already in the local cache).

    python -m kvcap.hf generate --model DIR --prompt "..." [--image PHOTO] --policy vision=streaming
    python -m kvcap.hf record   --model DIR --prompts FILE --image PHOTO ... --out DATASET_DIR
    python -m kvcap.hf eval     --model DIR --prompts FILE --policy text=streaming --tokens 64
    python -m kvcap.hf bench    --model DIR --prompt "..." --tokens 256 --policy text=streaming

generate prints the continuation and one line of numbers (tokens, bytes the cache holds
against a full cache, time). record writes the prompts' vision spans as dataset shards
kvcap-calibrate reads. eval runs each prompt through transformers' own cache and through
kvcap's, and prints per prompt and in all: greedy agreement, the teacher-forced NLL of the
full cache's continuation under kvcap's cache against full's, and bytes held. bench times
greedy generation through transformers' own cache and through kvcap's (full, and the policy
given), taking turns for --rounds rounds: median seconds and their ratio to transformers', the
growth of the process's peak resident memory during a run (0: the run fit in memory the
process already held), and the bytes each cache holds at the end.

Exit status: 0 done; 1 libkvcap refused something (a runtime config, an artifact, ...); 2 a
bad command line (a value that is not valid, a --model that cannot be loaded), said in one
line "kvcap.hf: ..." naming the argument.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, Dict, List, Optional, Tuple

import torch


class _Usage(Exception):
    """A bad command-line value: main prints "kvcap.hf: MESSAGE" (naming the argument) and
    exits with 2, as argparse does for the values it checks itself."""


def _policies(items: List[str]) -> Optional[Dict[str, str]]:
    if not items:
        return None
    out = {}
    for item in items:
        kind, sep, policy = item.partition("=")
        if not sep:
            raise _Usage(f"--policy '{item}': expected KIND=POLICY, e.g. vision=kvcapsule")
        out[kind] = policy
    return out


def _ids(text: str) -> List[int]:
    """--input-ids: comma-separated non-negative token ids."""
    ids = []
    for item in text.split(","):
        try:
            i = int(item.strip())
        except ValueError:
            i = -1
        if i < 0:
            raise _Usage(f"--input-ids '{text}': '{item}' is not a token id (expected "
                         "comma-separated non-negative integers, e.g. 1,2,3)")
        ids.append(i)
    return ids


def _check_args(a: argparse.Namespace) -> None:
    """The values argparse does not check, before anything is loaded."""
    if a.command in ("generate", "bench") and not (a.prompt or a.input_ids):
        raise _Usage(f"--prompt or --input-ids: {a.command} needs one of them")
    if a.tokens < 1:
        raise _Usage(f"--tokens {a.tokens}: expected at least 1 token to generate")
    if getattr(a, "rounds", 1) < 1:
        raise _Usage(f"--rounds {a.rounds}: expected at least 1 round")
    a.ids = _ids(a.input_ids) if a.input_ids else None
    for path in a.image:
        if not os.path.isfile(path):
            raise _Usage(f"--image {path}: no such file")
    _policies(a.policy)
    model = os.path.expanduser(a.model)
    if not os.path.exists(model) and (os.path.isabs(model) or model.endswith(".gguf") or
                                      model.startswith(".")):
        raise _Usage(f"--model {a.model}: no such file or folder")  # not a hub id either


def load(model: str, gguf_file: Optional[str], dtype: str) -> Tuple[Any, Any, bool]:
    """(model, tokenizer or processor, is_vlm) from a local folder, a GGUF file or a cached
    hub id, with attn_implementation="kvcap"."""
    import transformers
    from kvcap.hf import ATTENTION, VISION_MODEL_TYPES

    if model.endswith(".gguf") and gguf_file is None:
        model, gguf_file = os.path.dirname(os.path.abspath(model)), os.path.basename(model)
    kw: Dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    if os.path.isdir(model):
        kw["local_files_only"] = True
    torch_dtype = {"auto": "auto", "f32": torch.float32, "bf16": torch.bfloat16,
                   "f16": torch.float16}[dtype]
    try:
        config = transformers.AutoConfig.from_pretrained(model, **kw)
        vlm = config.model_type in VISION_MODEL_TYPES
        cls = (transformers.AutoModelForImageTextToText if vlm
               else transformers.AutoModelForCausalLM)
        m = cls.from_pretrained(model, dtype=torch_dtype, attn_implementation=ATTENTION,
                                **kw).eval()
    except (OSError, ValueError, KeyError) as e:  # transformers' ways of saying "cannot load"
        what = f"--model {model}" + (f" --gguf-file {gguf_file}" if gguf_file else "")
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise _Usage(f"{what}: cannot load it: {first}") from None
    try:
        proc = (transformers.AutoProcessor if vlm else transformers.AutoTokenizer
                ).from_pretrained(model, **kw)
    except (OSError, ValueError):
        proc = None
    return m, proc, vlm


def _vocab(model: Any) -> Optional[int]:
    config = model.config
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return getattr(text, "vocab_size", None)


def encode(proc: Any, vlm: bool, prompt: Optional[str], input_ids: Optional[List[int]],
           images: List[str], vocab: Optional[int] = None) -> Dict[str, Any]:
    """The model inputs of one prompt: token ids given as a list (each below `vocab`), or the
    prompt through the tokenizer (a chat turn with the images, through the processor, for a
    VLM)."""
    if input_ids:
        bad = [i for i in input_ids if vocab is not None and i >= vocab]
        if bad:
            raise _Usage(f"--input-ids: token id {bad[0]} is outside the model's vocabulary "
                         f"(0..{vocab - 1})")
        ids = torch.tensor([input_ids])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    if proc is None:
        raise _Usage("--prompt: the checkpoint has no tokenizer: give --input-ids")
    if not vlm:
        return dict(proc(prompt, return_tensors="pt"))
    from PIL import Image

    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": prompt}]
    text = proc.apply_chat_template([{"role": "user", "content": content}],
                                    add_generation_prompt=True)
    pics = [Image.open(p).convert("RGB") for p in images] or None
    return dict(proc(text=text, images=pics, return_tensors="pt"))


def _cache_kwargs(a: argparse.Namespace, proc: Any = None) -> Dict[str, Any]:
    """KvcapCache's arguments from the command line; with the processor, its tokenizer (a
    kvzip policy builds its reconstruction pass with it)."""
    kw: Dict[str, Any] = {"storage": a.storage}
    tok = getattr(proc, "tokenizer", proc)
    if tok is not None and hasattr(tok, "encode"):
        kw["tokenizer"] = tok
    if a.config:
        kw["config"] = a.config
    policies = _policies(a.policy)
    if policies:
        kw["policies"] = policies
    if a.artifact:
        kw["artifact"] = a.artifact
    if a.fallback:
        kw["fallback"] = a.fallback
    return kw


def _decode(proc: Any, ids: torch.Tensor) -> str:
    tok = getattr(proc, "tokenizer", proc)
    return tok.decode(ids, skip_special_tokens=True) if tok is not None else str(ids.tolist())


def cmd_generate(a: argparse.Namespace) -> int:
    import kvcap.hf

    model, proc, vlm = load(a.model, a.gguf_file, a.dtype)
    inputs = encode(proc, vlm, a.prompt, a.ids, a.image, _vocab(model))
    t0 = time.perf_counter()
    out, cache = kvcap.hf.generate(model, inputs, max_new_tokens=a.tokens, do_sample=False,
                                   **_cache_kwargs(a, proc))
    dt = time.perf_counter() - t0
    n = inputs["input_ids"].shape[1]
    print(_decode(proc, out[0, n:]))
    s = cache.stats()
    print(f"kvcap.hf: {out.shape[1] - n} tokens in {dt:.2f} s; the cache holds "
          f"{s['bytes_held'] / 1e6:.2f} MB, a full cache {s['bytes_full_equivalent'] / 1e6:.2f} MB",
          file=sys.stderr)
    return 0


def cmd_record(a: argparse.Namespace) -> int:
    import kvcap.hf

    prompts = _prompt_list(a)
    try:
        os.makedirs(a.out, exist_ok=True)
    except OSError as e:
        raise _Usage(f"--out {a.out}: {e.strerror or e}") from None
    model, proc, vlm = load(a.model, a.gguf_file, a.dtype)
    for i, p in enumerate(prompts):
        inputs = encode(proc, vlm, p, None, a.image)
        kvcap.hf.generate(model, inputs, max_new_tokens=a.tokens, do_sample=False,
                          record_dir=a.out, policies={"vision": "full"}, storage=a.storage)
        _progress(f"record {i + 1}/{len(prompts)}")
    _progress("", end=True)
    shards = sorted(f for f in os.listdir(a.out) if f.endswith(".safetensors"))
    print(f"kvcap.hf: {len(shards)} dataset shards in {a.out} (kvcap-calibrate --data {a.out})")
    return 0


def cmd_eval(a: argparse.Namespace) -> int:
    import kvcap.hf

    prompts = _prompt_list(a)
    model, proc, vlm = load(a.model, a.gguf_file, a.dtype)
    rows = []
    for i, p in enumerate(prompts):
        inputs = encode(proc, vlm, p, None, a.image)
        r = kvcap.hf.compare(model, inputs, tokens=a.tokens, **_cache_kwargs(a, proc))
        rows.append(r)
        _progress(f"eval {i + 1}/{len(prompts)}")
    _progress("", end=True)
    print(f"{'prompt':>6} {'greedy agree':>12} {'NLL full':>9} {'NLL kvcap':>9} {'dNLL':>8} "
          f"{'held MB':>8} {'full MB':>8}")
    for i, r in enumerate(rows):
        print(f"{i:>6} {r['greedy_agreement']:>12.3f} {r['nll_full']:>9.4f} {r['nll_kvcap']:>9.4f} "
              f"{r['nll_kvcap'] - r['nll_full']:>+8.4f} {r['bytes_held'] / 1e6:>8.2f} "
              f"{r['bytes_full_equivalent'] / 1e6:>8.2f}")
    k = len(rows)
    mean = {key: sum(r[key] for r in rows) / k for key in rows[0]}
    print(f"{'all':>6} {mean['greedy_agreement']:>12.3f} {mean['nll_full']:>9.4f} "
          f"{mean['nll_kvcap']:>9.4f} {mean['nll_kvcap'] - mean['nll_full']:>+8.4f} "
          f"{mean['bytes_held'] / 1e6:>8.2f} {mean['bytes_full_equivalent'] / 1e6:>8.2f}")
    return 0


def _rss_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> bool:
    """Resets the process's peak resident set (Linux: clear_refs 5); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cmd_bench(a: argparse.Namespace) -> int:
    import statistics

    from transformers import DynamicCache

    import kvcap.hf

    model, proc, vlm = load(a.model, a.gguf_file, a.dtype)
    inputs = encode(proc, vlm, a.prompt, a.ids, a.image, _vocab(model))
    n = inputs["input_ids"].shape[1]
    gen = dict(max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False)
    runs: List[Tuple[str, Dict[str, Any]]] = [("transformers", {}), ("kvcap full", {
        "policies": {"vision": "full", "text": "full", "generated": "full"}})]
    kw = _cache_kwargs(a)
    if len(kw) > 1:
        runs.append(("kvcap " + ",".join(a.policy or [a.config or "config"]), kw))
    times: Dict[str, List[float]] = {name: [] for name, _ in runs}
    peak: Dict[str, List[int]] = {name: [] for name, _ in runs}
    held: Dict[str, int] = {}
    seqs: Dict[str, List[int]] = {}
    for r in range(a.rounds):
        for name, ckw in runs:  # taking turns: machine noise spreads over all of them
            if name == "transformers":
                cache: Any = DynamicCache(config=model.config.get_text_config(decoder=True))
            else:
                cache = kvcap.hf.KvcapCache(model, input_ids=inputs["input_ids"],
                                            **{"storage": a.storage, **ckw})
            ok = _reset_peak()
            base = _rss_kb("VmRSS")
            t0 = time.perf_counter()
            out = model.generate(**inputs, cache=cache, **gen)
            times[name].append(time.perf_counter() - t0)
            if ok:
                peak[name].append(_rss_kb("VmHWM") - base)
            seqs[name] = out[0, n:].tolist()
            if name == "transformers":
                held[name] = sum(t.numel() * t.element_size() for layer in cache.layers
                                 for t in (layer.keys, layer.values) if t is not None)
            else:
                held[name] = int(cache.stats()["bytes_held"])
                cache.close()
            _progress(f"bench round {r + 1}/{a.rounds}: {name}")
    _progress("", end=True)
    base_t = statistics.median(times["transformers"])
    print(f"{a.tokens} greedy tokens after a {n}-token prompt, {a.rounds} rounds taking turns; "
          f"threads {torch.get_num_threads()}")
    print(f"{'cache':<36} {'median s':>9} {'tok/s':>8} {'vs transformers':>15} "
          f"{'RSS +MB':>9} {'cache MB':>9} {'same tokens':>11}")
    for name, _ in runs:
        t = statistics.median(times[name])
        pk = f"{statistics.median(peak[name]) / 1024:9.1f}" if peak[name] else f"{'-':>9}"
        same = "yes" if seqs[name] == seqs["transformers"] else "no"
        print(f"{name:<36} {t:>9.3f} {a.tokens / t:>8.1f} {t / base_t:>15.3f} {pk} "
              f"{held[name] / 1e6:>9.2f} {same:>11}")
    return 0


def _prompt_list(a: argparse.Namespace) -> List[str]:
    if a.prompts:
        if not os.path.isfile(a.prompts):  # not a FIFO or a device: read whole below
            raise _Usage(f"--prompts {a.prompts}: no such file")
        try:
            with open(a.prompts, encoding="utf-8") as f:
                prompts = [line.strip() for line in f if line.strip()]
        except (OSError, UnicodeError) as e:
            raise _Usage(f"--prompts {a.prompts}: {e}") from None
        if not prompts:
            raise _Usage(f"--prompts {a.prompts}: no prompts (one per line)")
        return prompts
    if a.prompt:
        return [a.prompt]
    raise _Usage("--prompt or --prompts: give --prompt TEXT or --prompts FILE")


def _progress(text: str, end: bool = False) -> None:
    if not sys.stderr.isatty():
        return
    sys.stderr.write("\r\033[K" + ("" if end else text))
    sys.stderr.flush()


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvcap.hf", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    sub = ap.add_subparsers(dest="command", required=True)
    for name, help_ in (("generate", "greedy generation through kvcap's cache"),
                        ("record", "record prompts' vision spans for kvcap-calibrate"),
                        ("eval", "kvcap's cache against transformers' own, per prompt"),
                        ("bench", "time and memory of generation, each cache taking turns")):
        p = sub.add_parser(name, help=help_)
        p.add_argument("--model", required=True,
                       help="local checkpoint folder, GGUF file, or hub id in the local cache")
        p.add_argument("--gguf-file", help="GGUF file inside --model's folder")
        p.add_argument("--prompt", help="the prompt text")
        p.add_argument("--prompts", help="a file of prompts, one per line")
        p.add_argument("--image", action="append", default=[],
                       help="an image for a vision-language model (repeatable)")
        p.add_argument("--tokens", type=int, default=64, help="tokens to generate (default 64)")
        p.add_argument("--dtype", choices=["auto", "f32", "bf16", "f16"], default="f32",
                       help="model weights' dtype (default f32)")
        p.add_argument("--storage", choices=["auto", "f32", "f16", "bf16"], default="auto",
                       help="the cache's storage dtype (default: the model's)")
        if name != "record":
            p.add_argument("--config", help="runtime YAML (configs/runtime.yaml's keys)")
            p.add_argument("--policy", action="append", default=[],
                           help="KIND=POLICY, e.g. vision=kvcapsule (repeatable)")
            p.add_argument("--artifact", help="KVCapsule artifact (kvcap-convert's output)")
            p.add_argument("--fallback", help="policy for vision spans without a bucket")
        if name in ("generate", "bench"):
            p.add_argument("--input-ids", help="token ids instead of --prompt, e.g. 1,2,3")
        if name == "bench":
            p.add_argument("--rounds", type=int, default=3, help="rounds of turns (default 3)")
        if name == "record":
            p.add_argument("--out", required=True, help="dataset folder to write (created)")
    a = ap.parse_args(argv)
    if a.command not in ("generate", "bench"):
        a.input_ids = None
    if a.command == "record":
        a.config = a.artifact = a.fallback = None
        a.policy = []
    import kvcap

    try:
        _check_args(a)
        return {"generate": cmd_generate, "record": cmd_record, "eval": cmd_eval,
                "bench": cmd_bench}[a.command](a)
    except _Usage as e:
        print(f"kvcap.hf: {e}", file=sys.stderr)
        return 2
    except kvcap.Error as e:
        print(f"kvcap.hf: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
