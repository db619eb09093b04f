"""Summarise a benchmark JSON's W12 rows: geomean speedup vs cuBLAS per variant and M, the minimum
cell, the LM head and the decode step.

    python3 perf/w12_bench_summary.py perf/results/h200/<stamp>-<ops>.json
"""

from __future__ import annotations

import collections
import json
import math
import sys


def main(path: str) -> int:
    d = json.load(open(path))
    by = collections.defaultdict(list)
    cells = collections.defaultdict(list)
    for r in d["rows"]:
        if r["status"] != "ok" or not r.get("speedup"):
            continue
        if r["op"] in ("w12.matmul", "w12.matmul_q8"):
            m = r["dims"]["M"]
            by[(r["op"], r["variant"], m)].append(r["speedup"])
            cells[(r["op"], r["variant"])].append((r["speedup"], r["shape"], r.get("tbs")))
        elif r["op"] == "decode_step":
            print(f"decode_step {r['variant']}: {r['median_us']:.1f} us, {r['speedup']:.3f}x")
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    for (op, v), xs in sorted(cells.items()):
        ms = sorted({m for (o, vv, m) in by if o == op and vv == v})
        per_m = "  ".join(f"M{m} {gm(by[(op, v, m)]):.2f}" for m in ms)
        lo = min(xs)
        print(f"{op:14s} {v:8s} all {gm([s for s, _, _ in xs]):.3f}x  min {lo[0]:.2f}x ({lo[1]})  | {per_m}")
        lm = [x for x in xs if x[1].startswith("lm_head")]
        if lm:
            print(" " * 24 + "lm_head: " + "  ".join(f"{s:.2f}x@{(tb or 0):.2f}TB/s" for s, _, tb in lm))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
