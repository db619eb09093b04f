"""Summarise a benchmark results JSON (`specpilot bench` output) in a few lines: per (op, variant) the
geomean speedup over the group's baseline, per M where the cases have one, the slowest cell; the LM
head's cells; the decode step; and every case that was not reported.

    python3 perf/bench_summary.py perf/results/h200/<stamp>-<ops>.json [--op PREFIX]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import sys


def _gm(xs) -> float:
    return math.exp(sum(map(math.log, xs)) / len(xs))


def summary(data: dict, op_prefix: str = "") -> list[str]:
    meta, rows = data["meta"], data["rows"]
    lines = [f"bench  : {meta.get('ok')} timed, {meta.get('failed')} not, {meta.get('wall_s')} s, on {meta.get('gpu')}"]
    rows = [r for r in rows if r["op"].startswith(op_prefix)]
    cells = collections.defaultdict(list)  # (op, variant) -> [(speedup, shape, TB/s, M)]
    for r in rows:
        if r["status"] != "ok" or not r.get("speedup") or r["variant"] == r.get("baseline"):
            continue
        if r["op"] == "decode_step":
            lines.append(f"  decode_step {r['variant']}: {r['median_us']:.1f} us, {r['speedup']:.3f}x")
            continue
        m = (r.get("dims") or {}).get("M")
        cells[(r["op"], r["variant"])].append((r["speedup"], r["shape"], r.get("tbs"), m))
    for (op, v), xs in sorted(cells.items()):
        by_m = collections.defaultdict(list)
        for s, _, _, m in xs:
            if m is not None:
                by_m[m].append(s)
        per_m = "  ".join(f"M{m} {_gm(by_m[m]):.2f}" for m in sorted(by_m))
        lo = min(xs)
        lines.append(f"  {op}/{v}: geomean {_gm([x[0] for x in xs]):.3f}x over {len(xs)} shapes, "
                     f"min {lo[0]:.2f}x ({lo[1]})" + (f" | {per_m}" if len(by_m) > 1 else ""))
        lm = [x for x in xs if x[1].startswith("lm_head")]
        if lm and op != "lm_head":
            lines.append("    lm_head: " + "  ".join(f"{s:.2f}x@{(tb or 0):.2f}TB/s" for s, _, tb, _ in lm))
    for r in rows:
        if r["status"] != "ok":
            err = str(r["error"])[:160]
            lines.append(f"  NOT REPORTED {r['op']}/{r['variant']} {r['shape']}: {r['status']}: {err}")
    return lines


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--op", default="", help="only ops whose name starts with this (e.g. w12)")
    a = ap.parse_args(argv)
    with open(a.path) as f:
        print("\n".join(summary(json.load(f), a.op)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
