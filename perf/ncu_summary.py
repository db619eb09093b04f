"""One line per profiled kernel from an `ncu --csv --page details` file (the ncu stage of perf/w12_gpu.sh
or perf/gdn_gpu.sh): duration, DRAM throughput, grid, registers, warps per scheduler, and the largest
stall reasons (cycles per issued instruction) when the stall metrics were collected.

    python3 perf/ncu_summary.py ncu.csv
"""

from __future__ import annotations

import csv
import io
import sys

SHOW = ["Duration", "DRAM Throughput", "Grid Size", "Block Size", "Registers Per Thread",
        "Dynamic Shared Memory Per Block", "Active Warps Per Scheduler", "Eligible Warps Per Scheduler",
        "Warp Cycles Per Issued Instruction", "Compute (SM) Throughput", "L2 Hit Rate", "Memory Throughput",
        "Achieved Occupancy"]
STALL = "smsp__average_warps_issue_stalled_"


def main(path: str) -> int:
    text = open(path).read()
    rows = list(csv.reader(io.StringIO(text[text.index('"ID"'):])))
    col = {name: i for i, name in enumerate(rows[0])}
    kernels: dict[tuple[str, str], dict[str, str]] = {}
    for r in rows[1:]:
        key = (r[col["ID"]], r[col["Kernel Name"]][:40])
        kernels.setdefault(key, {})[r[col["Metric Name"]]] = f"{r[col['Metric Value']]} {r[col['Metric Unit']]}".strip()
    for (kid, name), m in kernels.items():
        shown = "; ".join(f"{k}={m[k]}" for k in SHOW if k in m)
        stalls = []
        for k, v in m.items():
            if k.startswith(STALL):
                try:
                    stalls.append((float(v.split()[0].replace(",", "")), k[len(STALL):].split("_per_issue")[0]))
                except ValueError:
                    pass
        top = ", ".join(f"{reason} {val:.2f}" for val, reason in sorted(stalls, reverse=True)[:5])
        print(f"[{kid}] {name}: {shown}" + (f" | stalls: {top}" if top else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
