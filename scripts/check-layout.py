#!/usr/bin/env python3
"""check-layout.py — the include graph of the source tree against its floors.

Floors (README "Layout"): include/ → common/ → formats/, configs/, kernels/ → runtime/ → the
tools (cli/, calibrate/, convert/; the evaluation's engine/ and report/, then eval/; bench/)
→ tests/. A file may include files of its own folder
and of the folders listed for it below, nothing else; and no set of files includes itself in a
loop (a circle). Prints one line per violation and exits 1 when there is any, else prints
nothing and exits 0. Usage: check-layout.py [REPO_ROOT]
"""
import os
import re
import subprocess
import sys

ALLOWED = {
    "include": set(),
    "common": {"include"},
    "formats": {"include", "common", "configs"},  # the artifact header names config enums
    "configs": {"include", "common"},
    "kernels": {"include", "common"},
    "runtime": {"include", "common", "formats", "configs", "kernels"},
    "cli": {"include", "common"},
    "calibrate": {"include", "common", "formats", "configs", "kernels", "runtime", "cli"},
    "convert": {"include", "common", "formats", "configs", "kernels", "runtime", "cli",
                "calibrate"},
    # the evaluation: its model engine and its report stand apart (report/ knows no model), and
    # kvcap-eval uses both
    "engine": {"include", "common", "formats", "kernels", "runtime"},
    "report": {"include", "common", "cli"},
    "eval": {"include", "common", "formats", "configs", "kernels", "runtime", "cli",
             "calibrate", "convert", "engine", "report"},
    "bench": {"include", "common", "formats", "configs", "kernels", "runtime", "cli",
              "calibrate"},
}
SOURCE = re.compile(r"\.(c|h|cu|cuh)$")
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def folder(path):
    top = path.split("/", 1)[0]
    return top


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    files = subprocess.run(["git", "-C", root, "ls-files", "--cached", "--others", "--exclude-standard"], check=True, capture_output=True,
                           text=True).stdout.split()
    files = [f for f in files if SOURCE.search(f) and folder(f) in ALLOWED]
    known = set(files)
    graph, problems = {}, []
    for f in files:
        with open(os.path.join(root, f), encoding="utf-8", errors="replace") as fp:
            text = fp.read()
        edges = []
        for inc in INCLUDE.findall(text):
            target = "include/kvcap.h" if inc == "kvcap.h" else inc
            if target not in known:
                problems.append(f"{f}: includes \"{inc}\", which is not a path from the "
                                "repository root")
                continue
            src, dst = folder(f), folder(target)
            if dst != src and dst not in ALLOWED[src]:
                problems.append(f"{f}: includes {target} ({src}/ may not use {dst}/)")
            edges.append(target)
        graph[f] = edges
    # Circles: strongly connected components of more than one file (Tarjan, iterative).
    index, low, on, stack, comps, counter = {}, {}, set(), [], [], [0]
    for start in graph:
        if start in index:
            continue
        work = [(start, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = counter[0]
                counter[0] += 1
                stack.append(v)
                on.add(v)
            recurse = False
            for j in range(i, len(graph[v])):
                w = graph[v][j]
                if w not in index:
                    work.append((v, j + 1))
                    work.append((w, 0))
                    recurse = True
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            if recurse:
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1 or v in graph[v]:
                    comps.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    for comp in comps:
        problems.append("include circle: " + " <-> ".join(comp))
    for p in problems:
        print(p)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
