#!/usr/bin/env python3
"""make_reference.py — records llama.cpp's behaviour on SmolLM2-135M-Instruct as the oracle for
kvcap's evaluation code: tests/data/smollm2_reference.json.

For every prompt below it stores the text and the token ids llama.cpp gives it
(llm.tokenize(text, add_bos=False, special=True), and with special=False as "ids_plain");
tests/test_tokenizer.c checks that kvtok_encode gives the same ids and that decoding them gives
the text back. For the first four (short) prompts it also evaluates the ids and stores, at the
first and the last position, the 32 largest logits (token id and value) and the mean and
standard deviation of the whole logits row, plus the greedy continuation of 8 tokens (argmax of
the last logits, evaluated one token at a time): the reference for the model engine.
The same is stored under "f32" for llama.cpp running the F32 requantisation of the file
(llama_model_quantize with LLAMA_FTYPE_ALL_F32: the same dequantised weights, multiplied in
fp32): llama.cpp's Q4_1 path quantises activations to 8 bits inside its matrix products, so only
the F32 file allows a tight comparison with an engine that computes in fp32.
"tokenizer_cases" holds extra tokenizer-only inputs (whitespace runs, contractions, special
tokens next to text) where pre-tokenizer details show.

Command line (from the repository root; the GGUF is the Q4_1 file of
HuggingFaceTB/SmolLM2-135M-Instruct, sha256 recorded in the output):

    python3 engine/reference/make_reference.py \\
        ~/.cache/kvcap/models/SmolLM2-135M-Instruct.Q4_1.gguf tests/data/smollm2_reference.json

Made with llama-cpp-python 0.3.36 (pip, built from source on CPU: libllama 0.5.0-dev,
ggml 0.25.3, ggml commit 0c1e570-dirty) and numpy; the versions found at run time are written
into the "generator" field.
"""
import ctypes
import glob
import hashlib
import json
import os
import re
import sys
import tempfile

import llama_cpp
import numpy as np

N_CTX = 2048
N_THREADS = 2
TOP_K = 32
N_GREEDY = 8
N_EVAL = 4  # prompts (from the first) whose logits are recorded

PROSE = (
    "The old lighthouse stood at the edge of the cliff for more than a century, and in that "
    "time it had seen storms that tore boats from their moorings and calm summer evenings when "
    "the sea lay flat as glass. Its keeper, a quiet woman named Mara, climbed the spiral stairs "
    "every night at dusk. She trimmed the wick, polished the great lens, and wrote a few lines in "
    "the logbook: the direction of the wind, the height of the waves, the ships that passed. "
    "Most nights nothing happened. The beam swept across the water, the gulls settled on the "
    "rocks, and the village below slept.\n\n"
    "But the logbook, read from the first page to the last, told a longer story. It recorded "
    "the winter when the harbour froze and the fishermen walked out on the ice to free their "
    "nets. It recorded the night a steamer ran aground on the northern reef, and how the whole "
    "village came down with lanterns and ropes to bring the passengers ashore. It recorded "
    "births and funerals, a wedding held in the lamp room because the church roof had blown "
    "away, and the day electricity finally arrived and the old oil lamp was retired to a shelf.\n\n"
    "When the lighthouse was automated, Mara was asked to leave. She packed her books and her "
    "small collection of shells, and she carried the logbooks down the stairs one armful at a "
    "time. Visitors still come to the cliff. They read the plaque by the door, take photographs "
    "of the white tower against the sky, and look out at the horizon where the ships pass. Few "
    "of them know about the logbooks, which now sit in the village library, waiting for someone "
    "patient enough to read every page and learn what the sea has taught the people who live "
    "beside it."
)

PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "In 1984, 3.14159 and 42",
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, there was a little robot who loved to read books.",
    "def add(a, b):\n    return a + b  # sum\n\n\nif x == 1:\t{'k': [1, 2]}  \n  \n    print(\"done\")   \n",
    "Caf\u00e9 cr\u00e8me, \u00fcber na\u00efve \u2014 \u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8 "
    "\U0001F642\U0001F44D\U0001F3FD r\u00e9sum\u00e9 \u00bd \u00b2",
    "Hello world! How are you doing today?",
    "I'm sure it's what they'd've wanted; we'll see. DON'T you're",
    "Water boils at 100 degrees Celsius at sea level, but at higher altitudes it boils at "
    "lower temperatures.",
    PROSE,
]

TOKENIZER_CASES = [
    "a  b", "a   \n\n  b", "trailing spaces   ", "   leading spaces", "\ttabs\tand\t\ttabs\t",
    " ", "  ", "\n", "\n\n\n", " \n ", "a \n b", "x \t y", "   \n", "\n   x", "a\r\nb\r\n",
    "a  1", "a 1", "  12", "12  ", "1,000,000.5", "it's", "IT'S", "'s", "''s", " 's", "a's",
    "\u00a0non\u00a0breaking\u2003em\u3000ideographic", "e\u0301t\u00e9", "\u0663\u0664 \u2160\u2161",
    "<|im_end|><|im_start|>", "x<|endoftext|>y", "<<|im_start|>>", "<|im_", "<repo_name>a/b",
]


def sha256(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def generator_info():
    info = "llama-cpp-python %s" % llama_cpp.__version__
    try:
        info += ", libllama %s" % llama_cpp.llama_version().decode()
    except Exception:  # older bindings have no llama_version
        pass
    libs = glob.glob(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))
    if libs:
        lib = ctypes.CDLL(libs[0])
        for name in ("ggml_version", "ggml_commit"):
            fn = getattr(lib, name, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                info += ", %s %s" % (name, fn().decode())
    return info


def row_summary(row):
    row = np.asarray(row, dtype=np.float32)
    top = np.argsort(-row, kind="stable")[:TOP_K]
    return {
        "top_ids": [int(i) for i in top],
        "top_logits": [float(row[i]) for i in top],
        "mean": float(row.astype(np.float64).mean()),
        "std": float(row.astype(np.float64).std()),
    }


def evaluate(llm, ids):
    """First/last logits summaries and the greedy continuation of ids."""
    llm.reset()
    llm.eval(ids)
    scores = np.array(llm.scores[: len(ids)], dtype=np.float32)
    out = {"logits_first": row_summary(scores[0]),
           "logits_last": row_summary(scores[len(ids) - 1])}
    greedy = []
    for _ in range(N_GREEDY):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        greedy.append(tok)
        llm.eval([tok])
    out["greedy"] = greedy
    return out


def requantize_f32(model_path, out_path):
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_ALL_F32
    params.allow_requantize = True
    params.nthread = N_THREADS
    rc = llama_cpp.llama_model_quantize(model_path.encode(), out_path.encode(),
                                        ctypes.byref(params))
    if rc != 0:
        sys.exit(f"llama_model_quantize to F32 failed: {rc}")


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: make_reference.py MODEL.gguf OUT.json")
    model_path, out_path = sys.argv[1], sys.argv[2]
    llm = llama_cpp.Llama(model_path=model_path, n_ctx=N_CTX, logits_all=True,
                          n_threads=N_THREADS, verbose=False)

    prompts = []
    for k, text in enumerate(PROMPTS):
        entry = {
            "text": text,
            "ids": llm.tokenize(text.encode(), add_bos=False, special=True),
            "ids_plain": llm.tokenize(text.encode(), add_bos=False, special=False),
        }
        if k < N_EVAL:
            entry.update(evaluate(llm, entry["ids"]))
        prompts.append(entry)

    with tempfile.TemporaryDirectory() as tmp:
        f32_path = os.path.join(tmp, "model-f32.gguf")
        requantize_f32(model_path, f32_path)
        llm_f32 = llama_cpp.Llama(model_path=f32_path, n_ctx=N_CTX, logits_all=True,
                                  n_threads=N_THREADS, verbose=False)
        for entry in prompts[:N_EVAL]:
            entry["f32"] = evaluate(llm_f32, entry["ids"])
        del llm_f32

    cases = [{"text": t, "ids": llm.tokenize(t.encode(), add_bos=False, special=True)}
             for t in TOKENIZER_CASES]

    doc = {
        "generator": generator_info(),
        "model": os.path.basename(model_path),
        "model_sha256": sha256(model_path),
        "settings": {"n_ctx": N_CTX, "n_threads": N_THREADS, "logits_all": True,
                     "add_bos": False, "special": True, "top_k": TOP_K,
                     "greedy_tokens": N_GREEDY},
        "n_vocab": llm.n_vocab(),
        "prompts": prompts,
        "tokenizer_cases": cases,
    }
    text = json.dumps(doc, ensure_ascii=False, indent=1)
    # Lists of numbers on one line each, to keep the file short and diffable.
    text = re.sub(r"\[\s+([-0-9.eE+,\s]+?)\s+\]",
                  lambda m: "[" + " ".join(m.group(1).split()) + "]", text)
    with open(out_path, "w", encoding="utf-8") as f:
        f.write(text + "\n")


if __name__ == "__main__":
    main()
