#!/usr/bin/env python3
"""Applies the rule that chooses kvcap's shipped configuration for a span kind, on a development
run of kvcap-eval (never on a test run), and prints the chosen row with the table it came from.

The rule, fixed before the test split was first run: among the rows evaluated at every target
retention of the run (random eviction, the floor, and full excluded), the one with the best mean
rank over the targets in the report's own ranking (task accuracy, then KL from full, on the text
track; KL on the image track); a tie goes to the lower mean KL.

usage: python3 scripts/choose_shipped.py DEVELOPMENT_RUN/metrics.json
"""
import json
import math
import sys


def rank_key(run):
    """The report's ranking: higher task accuracy first (when measured), then lower KL."""
    acc = run.get("task", {}).get("accuracy")
    kl = run["kl"]
    return (-(acc if acc is not None else -math.inf), kl if kl is not None else math.inf)


def choose(metrics):
    split = metrics.get("setup", {}).get("split")
    if split == "test":
        raise SystemExit("choose_shipped: %s is a test run: the shipped configuration is "
                         "chosen on development data" % metrics.get("title", "this run"))
    runs = [r for r in metrics["runs"] if r["policy"] not in ("full", "random")]
    targets = sorted({r["retention"] for r in runs})
    ranks = {}
    kls = {}
    for t in targets:
        at = sorted((r for r in runs if r["retention"] == t), key=lambda r: (rank_key(r), r["id"]))
        for i, r in enumerate(at):
            ranks.setdefault(r["label"], {})[t] = i + 1
            kls.setdefault(r["label"], {})[t] = r["kl"]
    table = []
    for label, by_t in ranks.items():
        if len(by_t) != len(targets):
            continue  # not evaluated at every target
        table.append((sum(by_t.values()) / len(targets),
                      sum(kls[label].values()) / len(targets), label))
    if not table:
        raise SystemExit("choose_shipped: no row is evaluated at every target retention")
    table.sort()
    return targets, table


def main():
    if len(sys.argv) != 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__.strip())
        sys.exit(0 if len(sys.argv) == 2 else 2)
    path = sys.argv[1]
    try:
        with open(path) as f:
            metrics = json.load(f)
    except (OSError, ValueError) as e:
        raise SystemExit("choose_shipped: %s: %s" % (path, e))
    targets, table = choose(metrics)
    print("targets: %s" % ", ".join("%.2f" % t for t in targets))
    print("%-44s %9s %9s" % ("row", "mean rank", "mean KL"))
    for mean_rank, mean_kl, label in table:
        print("%-44s %9.2f %9.4f" % (label, mean_rank, mean_kl))
    print("chosen: %s" % table[0][2])


if __name__ == "__main__":
    main()
