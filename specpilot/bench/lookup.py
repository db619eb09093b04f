"""What the config lookup costs a call: the tuned-config dictionary and the plan cache against a kernel launch.

    python -m specpilot.bench.lookup [--out DIR] [--calls N]

* `autotune.get_config` with a tuned entry (a key of this GPU's store when it has one) and without (the
  heuristic), and `autotune.PlanCache.get` on a cached key: nanoseconds per call in a tight loop.
* `gdn.tree_conv1d` at hybrid-27b's conv width (D = 10240, one 32-node tree; `tiny` dims on a CPU), eager:
  the public call (validation, plan lookup, launch), the same call without validation (`gdn.ops._conv`: plan
  lookup and launch) and the launch alone with the plan resolved once (`gdn.ops._launch_conv`): host
  microseconds per call, each the median of interleaved repeats. The lookup's share of a call is the
  difference of the last two.
* On a GPU the last two also as CUDA-graph replays (`specpilot.bench.timing`): a graph holds the launches
  only, so a looked-up and a pre-resolved config give the same kernel time.

Writes lookup.json to --out (and prints the table).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

import autotune

__all__ = ["run"]


@dataclass(frozen=True)
class _Cfg:
    block: int = 64


def _ns_per_call(fn, calls: int) -> float:
    t0 = time.perf_counter_ns()
    for _ in range(calls):
        fn()
    return (time.perf_counter_ns() - t0) / calls


def _interleaved(fns: dict, calls: int, repeats: int, sync) -> dict:
    """Host µs per call of each fn: `repeats` rounds, the fns in turn within a round, median over rounds."""
    res = {k: [] for k in fns}
    for f in fns.values():  # warm-up (compiles, plan caches)
        f()
    sync()
    for _ in range(repeats):
        for k, f in fns.items():
            sync()
            t0 = time.perf_counter()
            for _ in range(calls):
                f()
            sync()
            res[k].append((time.perf_counter() - t0) / calls * 1e6)
    return {k: statistics.median(v) for k, v in res.items()}


def run(device=None, calls: int = 200_000, launches: int = 2000, repeats: int = 7) -> dict:
    import gdn
    from gdn import ops as gops
    from specpilot.bench.cases import draft_tree
    from specpilot.bench.shapes import get_shape_set

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out: dict = {"device": autotune.gpu_name(dev), "versions": autotune.versions(), "rows": []}

    def row(name, value, unit, note=""):
        out["rows"].append({"what": name, "value": round(value, 3), "unit": unit, "note": note})

    tuned = autotune.load_tuned(dev)
    hit = next(iter(tuned), None)
    if hit is not None:
        op, variant, key = hit.split("/", 2)
        entry = {k: v for k, v in tuned[hit].items() if k != "_"}
        import dataclasses

        cls = dataclasses.make_dataclass("Tuned", [(k, object, dataclasses.field(default=None)) for k in entry],
                                         frozen=True)
        row("get_config, tuned entry", _ns_per_call(lambda: autotune.get_config(op, variant, cls, cls, key=key,
                                                                                 device=dev), calls), "ns/call", hit)
    row("get_config, no entry (heuristic)", _ns_per_call(
        lambda: autotune.get_config("bench.lookup", "x", _Cfg, _Cfg, key="M1", device=dev), calls), "ns/call")
    cache = autotune.PlanCache()
    k = ("bench.lookup", "x", 8, torch.bfloat16, dev, autotune.forced("bench.lookup"))
    cache.get(k, lambda: autotune.Plan("x", "x", _Cfg()))
    row("PlanCache.get, cached key", _ns_per_call(lambda: cache.get(
        ("bench.lookup", "x", 8, torch.bfloat16, dev, autotune.forced("bench.lookup")), None), calls), "ns/call",
        "the key built per call, as the operators do")

    s = get_shape_set("hybrid-27b" if dev.type == "cuda" else "tiny")
    D = 2 * s.gdn_k_heads * s.gdn_head_dim + s.gdn_v_heads * s.gdn_head_dim
    W, n = s.conv_width, 32
    import random

    plan = gdn.build_tree_plan([draft_tree(n, random.Random(1))], device=dev)
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(n, D, device=dev, generator=g).to(torch.bfloat16)
    cs = torch.randn(1, D, W - 1, device=dev, generator=g).to(torch.bfloat16)
    w = torch.randn(D, W, device=dev, generator=g).to(torch.bfloat16)
    o = torch.empty_like(x)
    idx = torch.zeros(1, device=dev, dtype=torch.int32)
    args = (cs, idx, plan.node_req, plan.parent, plan.depth, plan.err, True)
    resolved = gops._plan_conv(None, x)
    fns = {
        "public gdn.tree_conv1d (validate + lookup + launch)":
            lambda: gdn.tree_conv1d(x, cs, w, plan, conv_state_indices=idx, activation="silu", out=o),
        "lookup + launch (gdn.ops._conv)": lambda: gops._conv(None, x, w, None, o, *args),
        "launch with the plan resolved once (gdn.ops._launch_conv)":
            lambda: gops._launch_conv(resolved, x, w, None, o, *args),
    }
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    host = _interleaved(fns, launches if dev.type == "cuda" else max(1, launches // 20), repeats, sync)
    for name, us in host.items():
        row(f"eager {name}", us, "us/call", f"D={D}, {n} nodes, config {resolved.config}")
    names = list(host)
    row("lookup's share of an eager call", host[names[1]] - host[names[2]], "us/call",
        "(lookup + launch) - (launch alone); within the repeats' noise when about 0")
    if dev.type == "cuda":
        from specpilot.bench.timing import time_ab

        a, b = time_ab([fns[names[1]]], [fns[names[2]]], dev, rounds=40)
        row("CUDA graph, looked-up config", a.median * 1e6, "us/call")
        row("CUDA graph, pre-resolved config", b.median * 1e6, "us/call")
        ratios = sorted(x / y for x, y in zip(a.samples, b.samples))
        row("CUDA graph, looked-up / pre-resolved (median of rounds)", ratios[len(ratios) // 2], "ratio")
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, metavar="DIR", help="folder for lookup.json")
    ap.add_argument("--calls", type=int, default=200_000, help="calls per tight loop (default 200000)")
    ap.add_argument("--device", default=None, help="cuda or cpu (default: cuda if present)")
    a = ap.parse_args(argv)
    res = run(a.device, calls=a.calls)
    print(f"config lookup cost on {res['device']}")
    for r in res["rows"]:
        print(f"  {r['what']:<66} {r['value']:>12.3f} {r['unit']:<8} {r['note']}")
    if a.out:
        Path(a.out).mkdir(parents=True, exist_ok=True)
        (Path(a.out) / "lookup.json").write_text(json.dumps(res, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
