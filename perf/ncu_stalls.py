"""Warp-stall samples of one profiled kernel, per reason, per SASS opcode and per program region,
from `ncu --import REPORT --page source --csv --print-source sass` (perf/gdn_ncu.py's recipe).

    python3 perf/ncu_stalls.py source.csv [--regions 20]
"""

from __future__ import annotations

import argparse
import collections
import csv
import io

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def _opcode(src: str) -> str:
    words = src.split()
    if not words:
        return "?"
    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]  # skip a predicate
    return op.split(".")[0]


def load(path: str) -> tuple[list[dict], list[str]]:
    text = open(path).read()
    rows = list(csv.reader(io.StringIO(text[text.index('"Address"'):])))
    head = rows[0]
    reasons = [n for n in head if n.startswith("stall_") and "Not Issued" not in n]
    out = []
    for r in rows[1:]:
        if len(r) < len(head):
            continue
        rec = dict(zip(head, r))
        out.append(dict(samples=int(rec[SAMPLES] or 0), executed=int(rec[EXECUTED] or 0),
                        op=_opcode(rec["Source"].strip()),
                        stalls={c: int(rec[c] or 0) for c in reasons}))
    return out, reasons


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("csv")
    ap.add_argument("--regions", type=int, default=20, help="equal slices of the instruction list")
    args = ap.parse_args()
    ins, reasons = load(args.csv)
    total = sum(i["samples"] for i in ins) or 1
    print(f"samples {total}, warp instructions executed {sum(i['executed'] for i in ins)}, "
          f"SASS instructions {len(ins)}")
    by_reason = collections.Counter()
    for i in ins:
        by_reason.update(i["stalls"])
    for reason, n in by_reason.most_common(10):
        print(f"  {reason:<26} {n:6d} {100 * n / total:5.1f}%")
    by_op, exec_op = collections.Counter(), collections.Counter()
    for i in ins:
        by_op[i["op"]] += i["samples"]
        exec_op[i["op"]] += i["executed"]
    print("samples by opcode: share, warp instructions executed")
    for op, n in by_op.most_common(15):
        print(f"  {op:<10} {100 * n / total:5.1f}%  {exec_op[op]}")
    print("program regions (instruction index): share, top stall, most frequent opcodes")
    step = max(1, len(ins) // args.regions)
    for lo in range(0, len(ins), step):
        part = ins[lo:lo + step]
        n = sum(i["samples"] for i in part)
        st = collections.Counter()
        for i in part:
            st.update(i["stalls"])
        ops = collections.Counter(i["op"] for i in part)
        top = st.most_common(1)[0][0] if n else "-"
        print(f"  [{lo:5d}-{lo + len(part):5d}] {100 * n / total:5.1f}%  {top:<20} "
              + " ".join(f"{k}:{v}" for k, v in ops.most_common(5)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
