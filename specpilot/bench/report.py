"""Reports from benchmark rows: a markdown table, geomean speedups, and a roofline PNG.

`render(json_path)` regenerates both from a results file written by the runner.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

__all__ = ["markdown", "geomeans", "roofline", "render", "write"]


def _fmt(x, digits: int = 3) -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "-"
    if abs(x) >= 100:
        return f"{x:.0f}"
    if abs(x) >= 10:
        return f"{x:.1f}"
    return f"{x:.{digits}g}"


def geomeans(rows: Sequence[dict]) -> dict[tuple[str, str], tuple[float, int]]:
    """(op, variant) -> (geometric-mean speedup vs the baseline, number of shapes)."""
    acc: dict[tuple[str, str], list[float]] = {}
    for r in rows:
        s = r.get("speedup")
        if r.get("status") == "ok" and s and s > 0:
            acc.setdefault((r["op"], r["variant"]), []).append(math.log(s))
    return {k: (math.exp(sum(v) / len(v)), len(v)) for k, v in sorted(acc.items())}


def markdown(rows: Sequence[dict], meta: dict | None = None) -> str:
    """The results table, the geomean speedups and the cases that were not timed."""
    lines = []
    if meta:
        c = meta.get("ceilings") or {}
        roofs = (f"; roofs ({meta.get('ceilings_source')}): {_fmt(c.get('copy_tbs'))} TB/s copy, "
                 f"{_fmt(c.get('bf16_tflops'))} TFLOP/s BF16") if c else ""
        lines.append(f"**{meta.get('gpu')}**, torch {meta.get('torch')}, triton {meta.get('triton')}, "
                     f"CUDA {meta.get('cuda')}, specpilot {meta.get('specpilot')}{roofs}")
        lines.append("")
    lines.append("| op | variant | shape | median µs | TB/s | TFLOP/s | floor µs | ×floor | speedup vs baseline |")
    lines.append("|---|---|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        if r.get("status") != "ok":
            continue
        sp = r.get("speedup")
        sp_s = f"{sp:.2f}× ({r['baseline']})" if sp else "-"
        lines.append(
            f"| {r['op']} | {r['variant']} | {r['shape']} | {_fmt(r.get('median_us'))} | {_fmt(r.get('tbs'))} | "
            f"{_fmt(r.get('tflops'))} | {_fmt(r.get('floor_us'))} | {_fmt(r.get('over_floor'))} | {sp_s} |"
        )
    gm = geomeans(rows)
    if gm:
        lines += ["", "| op | variant | geomean speedup vs baseline | shapes |", "|---|---|---:|---:|"]
        lines += [f"| {op} | {v} | {g:.3f}× | {n} |" for (op, v), (g, n) in gm.items()]
    bad = [r for r in rows if r.get("status") != "ok"]
    if bad:
        lines += ["", f"Not reported ({len(bad)}): a case is reported only if its check passed in the same run.", ""]
        for r in bad:
            err = str(r.get("error") or "").splitlines()[0][:200] if r.get("error") else ""
            lines.append(f"- {r['op']}/{r['variant']} {r['shape']}: **{r['status']}** {err}")
    return "\n".join(lines) + "\n"


def roofline(rows: Sequence[dict], meta: dict | None, path) -> Path:
    """Arithmetic intensity (FLOP/byte) vs achieved TFLOP/s, one marker per (op, variant),
    under the bandwidth and compute roofs (measured where the run measured them)."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    path = Path(path)
    ok = [r for r in rows if r.get("status") == "ok" and r.get("tflops") and r.get("bytes")]
    c = (meta or {}).get("ceilings") or {}
    bw, peak = c.get("copy_tbs"), c.get("bf16_tflops")
    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=120)
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in ok:
        series.setdefault((r["op"], r["variant"]), []).append((r["flops"] / r["bytes"], r["tflops"]))
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    lo = min(xs + [0.5]) / 2
    hi = max(xs + [peak / bw if bw and peak else 1.0]) * 4
    for (op, v), pts in series.items():
        ax.scatter([p[0] for p in pts], [p[1] for p in pts], s=18, label=f"{op} / {v}", alpha=0.8)
    if bw and peak:
        ridge = peak / bw
        grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
        ax.plot(grid, [min(peak, bw * x) for x in grid], color="k", lw=1.2,
                label=f"roof: {bw:.3g} TB/s, {peak:.3g} TFLOP/s ({(meta or {}).get('ceilings_source', '?')})")
        ax.axvline(ridge, color="0.6", lw=0.8, ls=":")
        ys.append(peak)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    if ys:
        ax.set_ylim(min(ys) / 3, max(ys) * 2)
    ax.set_xlabel("arithmetic intensity (FLOP / byte)")
    ax.set_ylabel("achieved TFLOP/s")
    ax.set_title(f"Roofline: {(meta or {}).get('gpu', '?')}")
    ax.grid(True, which="both", lw=0.3, alpha=0.5)
    if series or (bw and peak):
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


def write(rows: Sequence[dict], meta: dict | None, json_path) -> tuple[Path, Path]:
    """Write `<stem>.md` and `<stem>.png` next to `json_path`."""
    json_path = Path(json_path)
    md = json_path.with_suffix(".md")
    md.write_text(markdown(rows, meta))
    png = roofline(rows, meta, json_path.with_suffix(".png"))
    return md, png


def render(json_path, out_dir=None) -> tuple[Path, Path]:
    """Regenerate the markdown table and the roofline PNG from a runner results file."""
    json_path = Path(json_path)
    data = json.loads(json_path.read_text())
    if "rows" not in data:
        raise ValueError(f"{json_path}: not a results file (needs 'meta' and 'rows')")
    target = Path(out_dir) / json_path.name if out_dir is not None else json_path
    return write(data["rows"], data.get("meta"), target)
