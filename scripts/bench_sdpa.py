#!/usr/bin/env python3
"""bench_sdpa.py — the outside reference of kvcap-bench-cuda's decode table: PyTorch's
scaled_dot_product_attention on the same decode shapes (one query position, 28 query / 4 KV
heads, d 128, F16), timed the same way: CUDA events around one CUDA-graph replay per run (eager
calls when capture fails), median of --reps runs after --warmup, the L2 cache flushed before
every run by an untimed read of twice its size. Run by scripts/bench-gpu.sh; needs torch with
CUDA (exit 77 without a device)."""
import argparse
import sys


def parse_list(text):
    values = [int(x) for x in text.split(",") if x]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of positive integers")
    return values


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--contexts", type=parse_list, default=parse_list("8192,16384,32768,65536,131072"))
    ap.add_argument("--batches", type=parse_list, default=parse_list("1,8"))
    ap.add_argument("--heads", default="28x4", help="query x KV heads (default 28x4)")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=["f16", "bf16", "f32"], default="f16")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--warm", action="store_true", help="leave the L2 cache warm")
    ap.add_argument("--no-graph", action="store_true", help="time eager calls, not graph replays")
    ap.add_argument("--copy-gbs", type=float, default=0.0,
                    help="device-to-device copy bandwidth (bytes copied / s, GB/s) for the %%copy column")
    ap.add_argument("--tsv", help="also write results as tab-separated lines")
    ap.add_argument("--device", type=int, default=0)
    args = ap.parse_args()
    hq, hkv = (int(x) for x in args.heads.split("x"))
    if hq % hkv:
        ap.error("--heads: KV heads must divide query heads")
    if args.reps < 1 or args.warmup < 0:
        ap.error("--reps >= 1, --warmup >= 0")

    try:
        import torch
        import torch.nn.functional as F
    except ImportError:
        print("bench_sdpa.py: PyTorch not available", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("bench_sdpa.py: no CUDA device visible to PyTorch", file=sys.stderr)
        return 77
    dev = torch.device("cuda", args.device)
    torch.cuda.set_device(dev)
    dtype = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}[args.dtype]
    es = torch.tensor([], dtype=dtype).element_size()
    d, G = args.head_dim, hq // hkv
    props = torch.cuda.get_device_properties(dev)
    l2 = getattr(props, "L2_cache_size", 0) or (64 << 20)
    flush = torch.rand((2 * l2) // 4, device=dev)
    sink = torch.empty((), device=dev)
    stream = torch.cuda.Stream(device=dev)

    # enable_gqa (torch >= 2.5) reads each KV head once; otherwise K/V are expanded to every
    # query head before timing, and the kernel reads G times the bytes.
    def sdpa_gqa(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    try:
        t = torch.zeros(1, hq, 1, d, device=dev, dtype=dtype)
        u = torch.zeros(1, hkv, 4, d, device=dev, dtype=dtype)
        sdpa_gqa(t, u, u)
        gqa = "enable_gqa"
    except (TypeError, RuntimeError):
        gqa = "expanded"

    def flush_l2():
        # with an explicit dim: torch 2.11 takes out= for a full reduction only with one
        torch.sum(flush, dim=0, out=sink)

    def time_runs(fn):
        """Median ms per run of fn (a graph replay or an eager call) on `stream`."""
        inner = 10 if args.warm else 1
        with torch.cuda.stream(stream):
            for _ in range(args.warmup):
                if not args.warm:
                    flush_l2()
                fn()
            events = []
            for _ in range(args.reps):
                if not args.warm:
                    flush_l2()
                e0 = torch.cuda.Event(enable_timing=True)
                e1 = torch.cuda.Event(enable_timing=True)
                e0.record(stream)
                for _ in range(inner):
                    fn()
                e1.record(stream)
                events.append((e0, e1))
        stream.synchronize()
        ms = sorted(e0.elapsed_time(e1) / inner for e0, e1 in events)
        mid = len(ms) // 2
        return ms[mid] if len(ms) % 2 else 0.5 * (ms[mid - 1] + ms[mid])

    print(f"PyTorch {torch.__version__} scaled_dot_product_attention on {props.name}: decode "
          f"(1 query position), {hq} q / {hkv} kv heads, d {d}, {args.dtype}; GQA: {gqa}; "
          f"timing: CUDA events, {'eager calls' if args.no_graph else 'one CUDA graph replay'} "
          f"per run, median of {args.reps} after {args.warmup} warm-up runs, "
          f"{'L2 warm' if args.warm else 'L2 flushed before every run (untimed)'}")
    print(f"{'context':>8} {'B':>3} {'sdpa us':>11} {'read':>10} {'GB/s':>10} {'%copy':>7}  note")
    tsv = open(args.tsv, "w") if args.tsv else None
    for B in args.batches:
        for n in args.contexts:
            q = k = v = graph = None
            try:
                g = torch.Generator(device=dev)
                g.manual_seed(n * 16 + B)
                q = torch.randn(B, hq, 1, d, device=dev, dtype=dtype, generator=g)
                k = torch.rand(B, hkv, n, d, device=dev, dtype=dtype, generator=g) * 2 - 1
                v = torch.rand(B, hkv, n, d, device=dev, dtype=dtype, generator=g)
                if gqa == "expanded":
                    k = k.repeat_interleave(G, dim=1)
                    v = v.repeat_interleave(G, dim=1)
                    call = lambda: F.scaled_dot_product_attention(q, k, v)  # noqa: E731
                else:
                    call = lambda: sdpa_gqa(q, k, v)  # noqa: E731
                fn, note = call, "eager"
                if not args.no_graph:
                    with torch.cuda.stream(stream):
                        for _ in range(2):  # warm the kernels' lazy setup outside capture
                            call()
                    stream.synchronize()
                    try:
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, stream=stream):
                            call()
                        fn, note = graph.replay, "graph"
                    except RuntimeError as e:
                        note = f"eager (graph capture failed: {str(e).splitlines()[0][:60]})"
                ms = time_runs(fn)
            except RuntimeError as e:  # torch.cuda.OutOfMemoryError is a RuntimeError
                if "out of memory" not in str(e):
                    raise
                print(f"{n:8d} {B:3d}  skipped: out of device memory")
                q = k = v = graph = fn = call = None
                torch.cuda.empty_cache()
                continue
            read = B * k.shape[1] * n * d * 2 * es
            gbs = read / (ms * 1e-3) * 1e-9
            pct = f"{100 * gbs / args.copy_gbs:6.0f}%" if args.copy_gbs > 0 else "      -"
            print(f"{n:8d} {B:3d} {ms * 1e3:11.1f} {read / 2**20:6.1f} MiB {gbs:10.1f} {pct}  {note}")
            sys.stdout.flush()
            if tsv:
                tsv.write(f"sdpa\t{args.dtype}\t{n}\t{B}\t{ms * 1e3:.3f}\t{read}\t{gqa}\t{note.split()[0]}\n")
            q = k = v = graph = fn = call = None
            torch.cuda.empty_cache()
    heads = hq if gqa == "expanded" else hkv
    print(f"  read: the K and V bytes the kernel reads at least, B x {heads} heads x n x d x {es} B "
          f"x 2{' (K/V expanded to every query head)' if gqa == 'expanded' else ''}; "
          f"GB/s = read / time; %copy: over the copy's bytes copied / time")
    if tsv:
        tsv.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
