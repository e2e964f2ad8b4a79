#!/usr/bin/env python3
"""Reference numbers for tests/test_gguf.c's real-model test, computed with the PyPI `gguf`
package (GGUFReader + gguf.quants.dequantize), which shares no code with formats/gguf.c.

    python3 -m venv /tmp/ggufvenv && /tmp/ggufvenv/bin/pip install gguf numpy
    /tmp/ggufvenv/bin/python tests/data/gguf/make_reference.py \
        ~/.cache/kvcap/models/SmolLM2-135M-Instruct.Q4_1.gguf

Prints the C initialisers pasted into real_refs[] of test_gguf.c: per tensor its type, ne (ggml
order), element count, the sum, sum of |x| and sum of squares (float64 accumulation), and the
first and last 8 values in ggml order (ne[0] fastest)."""
import sys
from importlib.metadata import version

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

TENSORS = ["token_embd.weight", "blk.0.attn_q.weight", "blk.29.ffn_down.weight",
           "output_norm.weight", "blk.7.attn_k.weight"]


def g(x):
    return "%.9g" % float(x)  # round-trips a float32


def g17(x):
    return "%.17g" % float(x)  # round-trips a float64


def main(path):
    r = GGUFReader(path)
    print("/* gguf %s, numpy %s; %d tensors, %d keys (GGUF.* pseudo-fields excluded) */"
          % (version("gguf"), np.__version__, len(r.tensors),
             sum(1 for k in r.fields if not k.startswith("GGUF."))))
    by_name = {t.name: t for t in r.tensors}
    for name in TENSORS:
        t = by_name[name]
        x = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)  # C order = ggml order
        ne = [int(v) for v in t.shape]  # the reader reports shape in ggml (ne) order
        ne += [1] * (2 - len(ne))       # real_refs[] holds ne[0] and ne[1]
        xd = x.astype(np.float64)
        print('    {"%s", %d, {%s}, %d,' % (name, int(t.tensor_type),
                                            ", ".join(str(v) for v in ne), x.size))
        print("     %s, %s, %s," % (g17(xd.sum()), g17(np.abs(xd).sum()), g17((xd * xd).sum())))
        for lead, vals, tail in (("{", x[:8], ","), ("{", x[-8:], "},")):
            a = ", ".join(g(v) + "f" for v in vals[:4])
            b = ", ".join(g(v) + "f" for v in vals[4:])
            print("     %s%s,\n      %s}%s" % (lead, a, b, tail))


if __name__ == "__main__":
    main(sys.argv[1])
