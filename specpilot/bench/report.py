"""Reports from benchmark rows: a markdown table with its legend, geomean speedups, and a roofline PNG.

`render(json_path)` regenerates both from a results file written by the runner.

Floors are shown only where they are floors: from roofs measured on a GPU, and only if no timed row ran
faster than its floor. Otherwise the table has no floor columns and says why in one line (`floor_note`);
the JSON rows keep `floor_us` either way.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Sequence

__all__ = ["markdown", "geomeans", "roofline", "render", "write", "floor_note", "LEGEND", "INTERPRETED_NOTE"]

LEGEND = {
    "median µs": "median time of one call over the timed samples (CUDA-graph replays on a GPU)",
    "TB/s": "bytes the call must move (inputs, weights, outputs once) / median time",
    "TFLOP/s": "useful floating-point operations / median time",
    "floor µs": "the least time the call can take at this machine's measured roofs: max(bytes / copy bandwidth, "
                "FLOPs / BF16 matmul rate)",
    "×floor": "median / floor: 1.0 would run at the roof",
    "speedup vs baseline": "the baseline's median / this row's median, in the same run (baseline in brackets: "
                           "F.linear for the linears, cuBLAS on a GPU and torch on a CPU)",
}


INTERPRETED_NOTE = ("(interpreted): the row's Triton kernels ran under the CPU interpreter (TRITON_INTERPRET=1), "
                    "which checks them but times the interpreter, not the kernel; such rows have no speedup.")


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


def floor_note(rows: Sequence[dict], meta: dict | None) -> str | None:
    """Why the table shows no floors (None: it shows them)."""
    meta = meta or {}
    if not str(meta.get("device", "")).startswith("cuda"):
        return ("No floor column: on the CPU the measured roofs (a 16 MB copy, a 512³ matmul) are not upper bounds "
                "(caches and other kernels beat them), so a floor from them would not be a floor.")
    if meta.get("ceilings_source") != "measured":
        return f"No floor column: the roofs were not measured in this run ({meta.get('ceilings_source')})."
    beat = [r for r in rows if r.get("status") == "ok" and r.get("over_floor") is not None and r["over_floor"] < 1]
    if beat:
        return (f"No floor column: {len(beat)} rows ran faster than their floor (e.g. {beat[0]['op']}/"
                f"{beat[0]['variant']} {beat[0]['shape']}), so the measured roofs are not roofs for them.")
    return None


def markdown(rows: Sequence[dict], meta: dict | None = None) -> str:
    """The results table and its legend, the geomean speedups and the cases that were not timed."""
    lines = []
    note = floor_note(rows, meta)
    if meta:
        c = meta.get("ceilings") or {}
        roofs = (f"; roofs ({meta.get('ceilings_source')}): {_fmt(c.get('copy_tbs'))} TB/s copy, "
                 f"{_fmt(c.get('bf16_tflops'))} TFLOP/s BF16") if c else ""
        lines.append(f"**{meta.get('gpu')}**, torch {meta.get('torch')}, triton {meta.get('triton')}, "
                     f"CUDA {meta.get('cuda')}, specpilot {meta.get('specpilot')}{roofs}")
        lines.append("")
    cols = [c for c in LEGEND if note is None or c not in ("floor µs", "×floor")]
    lines.append("| op | variant | shape | " + " | ".join(cols) + " |")
    lines.append("|---|---|---|" + "---:|" * len(cols))
    for r in rows:
        if r.get("status") != "ok":
            continue
        sp = r.get("speedup")
        cell = {"median µs": _fmt(r.get("median_us")), "TB/s": _fmt(r.get("tbs")), "TFLOP/s": _fmt(r.get("tflops")),
                "floor µs": _fmt(r.get("floor_us")), "×floor": _fmt(r.get("over_floor")),
                "speedup vs baseline": f"{sp:.2f}× ({r['baseline']})" if sp else "-"}
        variant = r["variant"] + (" (interpreted)" if r.get("interpreted") else "")
        lines.append(f"| {r['op']} | {variant} | {r['shape']} | " + " | ".join(cell[c] for c in cols) + " |")
    lines.append("")
    lines += [f"- **{c}**: {LEGEND[c]}" for c in cols]
    if any(r.get("interpreted") and r.get("status") == "ok" for r in rows):
        lines += ["", INTERPRETED_NOTE]
    if note is not None:
        lines += ["", note]
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
    if floor_note(rows, meta) is not None:  # roofs that the rows may beat are not drawn
        bw = peak = None
    fig, ax = plt.subplots(figsize=(7.5, 5), dpi=120)
    series: dict[tuple[str, str], list[tuple[float, float]]] = {}
    for r in ok:
        label = r["variant"] + (" (interpreted)" if r.get("interpreted") else "")
        series.setdefault((r["op"], label), []).append((r["flops"] / r["bytes"], r["tflops"]))
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
    ax.set_title(f"Roofline: {(meta or {}).get('gpu', '?')}" + ("" if bw and peak else " (no roofs: see the table)"))
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
