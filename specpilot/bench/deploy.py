"""Batched verify steps on a synthetic full-size model, the steps `generate_batch` runs on a GPU.

    python -m specpilot.bench.deploy [--shapes hybrid-27b] [--prefix 4096] [--batches 8,24]
                                     [--budgets 64,128,192,256] [--formats bf16,w12] [--reps 30] [--out DIR] [--dry]

For each weight format and each batch of B requests (cache rows 0..B-1, each after the same `prefix`-token context):
the B-row autoregressive step (budget 0: every request's pending token alone) and the batch verify step at each node
budget (B + budget rows: the B pending tokens and `budget` draft nodes, split evenly over the requests as random
best-first trees of `positions` positions and top-`topk`), each one CUDA graph (`specpilot.engine.GraphedBatchStep`),
timed by replaying it under CUDA events (`specpilot.bench.timing`), the median of `reps`. Beside them, at one request:
two-level verification's Q pass (the target on its W12 8-bit view over a `nodes`-row tree, its argmax and greedy
acceptance, no cache written: `Engine._q_pass`) as one CUDA graph, against the exact verify step of the same tree
(`specpilot.engine.GraphedStep`) of each format. The byte floor of a batch step (`autotune.byte_floor`) reads every
weight of its format once and each request's KV prefix and recurrent and conv states. Weights BF16 and W12 (the
layers on the runtime layout, as `specpilot.bench.engine`), the glue as fused Triton kernels. Writes JSON and Markdown
to `out`.

`--profile B,BUDGET`: also, per format, where one step's time goes: the eager body of that step under
`torch.profiler`, device time per kernel name (on the CPU: self time per operator), the largest first, in the JSON
(`profile`) and the table.

`--dry`: the same code on the CPU at tiny shapes (`DRY`: the `tiny` shape set with attention heads of 64, the
kernels' smallest), the graphs' bodies run eagerly and timed with `time.perf_counter`: it exercises the script; its
times are not figures of anything.
"""

from __future__ import annotations

import argparse
import time

import torch

import autotune

from .engine import _model_bytes, _random_tree, _state_bytes, versions, write_run
from .timing import time_cpu, time_cuda

__all__ = ["run", "markdown", "DRY"]

# the --dry run: shapes, config overrides (hf_config), prefix, batches, budgets, verify rows, positions, reps
DRY = dict(shapes="tiny", overrides={"head_dim": 64}, prefix=40, batches=(2, 3), budgets=(4, 8), nodes=8,
           positions=4, reps=2)
TAUS = (2, 4, 6)  # tokens per request per verify step at which the implied speedups are given


def _replayer(body, device: torch.device):
    """A function that runs `body` as captured in a CUDA graph (on the CPU: `body` itself, eagerly)."""
    if device.type != "cuda":
        return body
    from ..engine.graphs import capture_graph

    graph, _ = capture_graph(body, device)
    return graph.replay


def _time(fn, device: torch.device, reps: int):
    if device.type == "cuda":
        return time_cuda([fn], reps=reps, warmup=3, graph=False)
    return time_cpu([fn], reps=reps, warmup=1)


def _trees(vocab: int, positions: int, topk: int, batch: int, budget: int, seed: int) -> list:
    """`batch` random best-first trees of `budget` draft nodes in all, split evenly (the first ones one more)."""
    out = []
    for b in range(batch):
        n = budget // batch + (b < budget % batch)
        out.append(_random_tree(vocab, positions, topk, n + 1, seed=seed + b) if n else None)
    return out


def _share_prefix(model, rows: int, prefix: int) -> None:
    """Rows 1..rows-1 take row 0's context: its recurrent and conv states and its first `prefix` KV slots."""
    L = model.max_len
    for r in range(1, rows):
        model.copy_row(0, r)
        model.k_cache[:, r * L:r * L + prefix].copy_(model.k_cache[:, :prefix])
        model.v_cache[:, r * L:r * L + prefix].copy_(model.v_cache[:, :prefix])


def _batch_step(model, B: int, budget: int, positions: int, topk: int):
    """The batch step of cache rows 0..B-1 and `budget` draft nodes (`GraphedBatchStep`, not captured, not loaded)
    and its seeded random trees and pending tokens: (step, trees, roots)."""
    from ..engine.graphs import GraphedBatchStep

    g = GraphedBatchStep(model, list(range(B)), budget, max_depth=positions)
    trees = _trees(model.cfg.vocab, positions, topk, B, budget, seed=100 * B + budget)
    roots = torch.randint(0, model.cfg.vocab, (B,), generator=torch.Generator().manual_seed(B + budget)).tolist()
    return g, trees, roots


def _batch_row(model, fmt_bytes, B: int, budget: int, prefix: int, positions: int, topk: int, reps: int,
               dev: torch.device) -> dict:
    wbytes, params, kv, st = fmt_bytes
    g, trees, roots = _batch_step(model, B, budget, positions, topk)
    replay = _replayer(g._body, dev)
    t0 = time.perf_counter()
    g.load([prefix] * B, roots, trees)
    host = time.perf_counter() - t0
    t = _time(replay, dev, reps)
    row = {"batch": B, "budget": budget, "rows": g.total, "draft_nodes": sum(x.n for x in trees if x is not None),
           "ms": 1e3 * t.median, "p10_ms": 1e3 * t.p10, "p90_ms": 1e3 * t.p90, "ms_per_request": 1e3 * t.median / B,
           "host_load_ms": 1e3 * host, "method": t.method}
    row["floor_ms"] = (1e3 * autotune.byte_floor(2 * params * g.total, wbytes + B * (kv + st), dev)
                       if dev.type == "cuda" else None)
    del g, replay
    return row


def _profile(model, B: int, budget: int, prefix: int, positions: int, topk: int, dev: torch.device,
             top: int = 25) -> dict:
    """Kernels of one batch step (`GraphedBatchStep`'s body run eagerly, after two warm-up runs) under
    torch.profiler: device time per kernel name on a GPU, self CPU time per operator on the CPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    g, trees, roots = _batch_step(model, B, budget, positions, topk)
    g.load([prefix] * B, roots, trees)
    cuda = dev.type == "cuda"
    for _ in range(2):
        g._body()
    if cuda:
        torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as p:
        g._body()
        if cuda:
            torch.cuda.synchronize(dev)
    if cuda:
        rows = [(e.device_time_total, e) for e in p.key_averages() if e.device_type == DeviceType.CUDA]
    else:
        rows = [(e.self_cpu_time_total, e) for e in p.key_averages()]
    rows.sort(key=lambda r: -r[0])
    out = {"batch": B, "budget": budget, "rows": g.total, "max_nodes": g.max_nodes,
           "what": "device time per kernel" if cuda else "self CPU time per operator",
           "total_ms": sum(t for t, _ in rows) / 1e3,
           "kernels": [{"name": e.key[:160], "ms": t / 1e3, "calls": e.count} for t, e in rows[:top]]}
    del g
    return out


def _one_request(model, fmt: str, prefix: int, nodes: int, positions: int, topk: int, reps: int,
                 dev: torch.device) -> dict:
    """The exact verify step of one request (`GraphedStep`, `nodes` rows) and, on W12 weights, the Q pass over the
    same tree."""
    from ..engine.graphs import GraphedStep
    from ..engine.spec.accept import greedy_accept

    ver = GraphedStep(model, nodes, positions, row=0)
    exact = _replayer(ver._body, dev)
    tree = _random_tree(model.cfg.vocab, positions, topk, nodes, seed=7)
    ver.load(prefix, 1, tree)
    t = _time(exact, dev, reps)
    out = {"exact_rows": ver.nodes, "exact_ms": 1e3 * t.median, "exact_p10_ms": 1e3 * t.p10,
           "exact_p90_ms": 1e3 * t.p90}
    if fmt == "w12":
        def q_pass():  # Engine._q_pass on the loaded step: the 8-bit view's argmax and acceptance, no commit
            target = model.logits(model.forward(ver.step, q8=True), q8=True).argmax(-1)
            return greedy_accept(ver.d_tokens, ver.d_parents, ver.d_depths, ver.d_count, target[None],
                                 max_depth=positions)

        try:
            tq = _time(_replayer(q_pass, dev), dev, reps)
        except Exception as e:  # a launch the capture refuses: the figures above stand without it, and say why
            out["q_pass_error"] = f"{type(e).__name__}: {e}"
        else:
            out.update(q_pass_ms=1e3 * tq.median, q_pass_p10_ms=1e3 * tq.p10, q_pass_p90_ms=1e3 * tq.p90,
                       q_over_exact=tq.median / t.median)
    return out


def run(shapes: str = "hybrid-27b", prefix: int = 4096, batches=(8, 24), budgets=(64, 128, 192, 256),
        nodes: int = 32, positions: int = 16, topk: int = 4, reps: int = 30, formats=("bf16", "w12"), out=None,
        device=None, overrides: dict | None = None, log=print, profile: tuple[int, int] | None = None) -> dict:
    """Time the steps (module docstring) on `device` (default CUDA; the CPU runs the graphs' bodies eagerly) and
    return the results; with `out`, also write them there as `<stamp>-deploy.json` and `.md`. `profile`: (B,
    budget) of the step whose kernels each format also reports (`--profile`)."""
    from ..engine import HybridConfig, HybridModel, Kernels
    from ..engine.model import MAX_STEP_NODES
    from ..engine.synthetic import SyntheticTensors, hf_config

    dev = torch.device(device if device is not None else "cuda")
    overrides = dict(overrides or {})
    cfg = hf_config(shapes, **overrides)
    hc = HybridConfig.from_hf(cfg)
    asked = prefix
    # a verify pass reaches prefix + 64 positions: the prefix shrinks to what the config's positions hold
    prefix = max(1, min(prefix, cfg.max_position_embeddings - MAX_STEP_NODES))
    batches, budgets = tuple(int(b) for b in batches), tuple(int(b) for b in budgets)
    rows = max(batches + ((int(profile[0]),) if profile is not None else ()))
    fused = dev.type == "cuda"
    res = {"shapes": shapes, "overrides": overrides, "prefix": prefix, "batches": list(batches),
           "budgets": list(budgets), "nodes": nodes, "positions": positions, "topk": topk, "fused_glue": fused,
           "device": str(dev), "dry": dev.type != "cuda", **versions(),
           "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "formats": {}}
    if prefix != asked:
        res["prefix_asked"] = asked
        log(f"prefix {asked} -> {prefix}: the config holds {cfg.max_position_embeddings} positions")
    syn = SyntheticTensors(cfg, dev)
    prompt = torch.randint(0, hc.vocab, (prefix + 1,), generator=torch.Generator().manual_seed(1)).tolist()
    model = None
    for fmt in formats:
        t0 = time.perf_counter()
        if model is None or fmt == "bf16":
            model = HybridModel(hc, syn, device=dev, fmt=fmt, kernels=Kernels.choose(dev), rows=rows,
                                max_len=prefix + MAX_STEP_NODES, fused_glue=fused)
            model.consume(0, 0, prompt[:-1])
            _share_prefix(model, rows, prefix)
        else:
            model.to_w12()
        log(f"{fmt}: model ready in {time.perf_counter() - t0:.1f} s")
        wbytes, params = _model_bytes(model)
        kv, st = _state_bytes(model, prefix)
        entry = {"weight_bytes": wbytes, "params": params, "kv_bytes_per_request": kv,
                 "state_bytes_per_request": st, "steps": []}
        for B in batches:
            ar = None
            for budget in (0,) + budgets:
                if budget > (MAX_STEP_NODES - 1) * B:
                    log(f"{fmt}: B={B} budget {budget}: over {MAX_STEP_NODES - 1} nodes per request, skipped")
                    continue
                row = _batch_row(model, (wbytes, params, kv, st), B, budget, prefix, positions, topk, reps, dev)
                ar = row if budget == 0 else ar
                row["over_ar"] = row["ms"] / ar["ms"]
                row["over_floor"] = row["ms"] / row["floor_ms"] if row["floor_ms"] else None
                if budget:
                    row["implied"] = {str(tau): {"tokens_per_s": 1e3 * B * tau / row["ms"],
                                                 "speedup_vs_ar": tau * ar["ms"] / row["ms"]} for tau in TAUS}
                else:
                    row["tokens_per_s"] = 1e3 * B / row["ms"]
                entry["steps"].append(row)
                log(f"{fmt}: B={B} budget {budget} ({row['rows']} rows): {row['ms']:.2f} ms, {row['over_ar']:.3f}x "
                    f"the {B}-row AR step")
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        if profile is not None:
            entry["profile"] = _profile(model, profile[0], profile[1], prefix, positions, topk, dev)
            top = entry["profile"]["kernels"][:3]
            log(f"{fmt}: profile of B={profile[0]} budget {profile[1]}: {entry['profile']['total_ms']:.2f} ms; "
                + ", ".join(f"{k['name'][:40]} {k['ms']:.2f} ms" for k in top))
        entry["one_request"] = _one_request(model, fmt, prefix, nodes, positions, topk, reps, dev)
        log(f"{fmt}: one request: {entry['one_request']}")
        res["formats"][fmt] = entry
    del model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    fm = res["formats"]
    q = fm.get("w12", {}).get("one_request", {})
    if "q_pass_ms" in q:
        res["q_pass"] = {"ms": q["q_pass_ms"], "rows": q["exact_rows"], "over_w12_exact": q["q_over_exact"],
                         "over_bf16_exact": (q["q_pass_ms"] / fm["bf16"]["one_request"]["exact_ms"]
                                             if "bf16" in fm else None)}
    if out is not None:
        write_run(out, "deploy", res, markdown(res))
    return res


def _f(x, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def markdown(res: dict) -> str:
    where = (f"{res['gpu']}, torch {res['torch']} (CUDA {res['cuda']}), Triton {res.get('triton')}. Every step one "
             "CUDA graph; medians of graph replays under CUDA events." if not res["dry"] else
             f"CPU dry run (torch {res['torch']}): the graphs' bodies run eagerly; the times check the script and are "
             "not figures of anything.")
    lines = [f"# Batch verify steps: {res['shapes']}, prefix {res['prefix']} per request", "", where, "",
             "| weights | B | budget | rows | step ms | ms per request | vs B-row AR | floor ms | host refill ms |",
             "|---|---|---|---|---|---|---|---|---|"]
    for fmt, e in res["formats"].items():
        for r in e["steps"]:
            lines.append(f"| {fmt} | {r['batch']} | {r['budget'] or 'AR'} | {r['rows']} | {r['ms']:.2f} | "
                         f"{r['ms_per_request']:.3f} | {r['over_ar']:.3f}x | {_f(r['floor_ms'])} | "
                         f"{r['host_load_ms']:.2f} |")
    lines += ["", f"One request, {res['nodes']}-row verify step:", "",
              "| weights | exact step ms | Q pass ms | Q / exact |", "|---|---|---|---|"]
    for fmt, e in res["formats"].items():
        o = e["one_request"]
        lines.append(f"| {fmt} | {o['exact_ms']:.2f} | {_f(o.get('q_pass_ms'))} | "
                     f"{_f(o.get('q_over_exact'), '.3f')}{'x' if 'q_over_exact' in o else ''} |")
    err = res["formats"].get("w12", {}).get("one_request", {}).get("q_pass_error")
    if err:
        lines += ["", f"The Q pass did not run: {err}"]
    for fmt, e in res["formats"].items():
        pr = e.get("profile")
        if pr:
            lines += ["", f"{fmt}: one step of B = {pr['batch']}, budget {pr['budget']} ({pr['rows']} rows, at most "
                      f"{pr['max_nodes']} nodes a request), its eager body under torch.profiler: {pr['what']}, "
                      f"{pr['total_ms']:.2f} ms in all", "", "| kernel | ms | calls |", "|---|---|---|"]
            lines += [f"| `{k['name'][:100]}` | {k['ms']:.3f} | {k['calls']} |" for k in pr["kernels"][:15]]
    q = res.get("q_pass")
    if q and q.get("over_bf16_exact") is not None:
        lines += ["", f"The Q pass (W12 8-bit view) takes {q['over_bf16_exact']:.3f}x the BF16 exact step."]
    return "\n".join(lines) + "\n"


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specpilot.bench.deploy")
    ap.add_argument("--shapes", default=None, help="shape set (default hybrid-27b; --dry: tiny)")
    ap.add_argument("--prefix", type=int, default=None, help="context tokens per request (default 4096)")
    ap.add_argument("--batches", default=None, help="requests per step, comma-separated (default 8,24)")
    ap.add_argument("--budgets", default=None, help="draft nodes per step, comma-separated (default 64,128,192,256)")
    ap.add_argument("--nodes", type=int, default=None, help="rows of the one-request verify step (default 32)")
    ap.add_argument("--reps", type=int, default=None, help="timed replays per step (default 30)")
    ap.add_argument("--formats", default="bf16,w12")
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", default=None, metavar="B,BUDGET",
                    help="also each format's kernels of one step of B requests and BUDGET draft nodes")
    ap.add_argument("--dry", action="store_true", help="the CPU at tiny shapes: checks the script, times nothing")
    a = ap.parse_args(argv)
    if not a.dry and not torch.cuda.is_available():
        print("specpilot.bench.deploy: needs a CUDA GPU; pass --dry to run the script on the CPU at tiny shapes")
        return 2
    kw = dict(DRY, device="cpu") if a.dry else {}
    for key, val in (("shapes", a.shapes), ("prefix", a.prefix), ("nodes", a.nodes), ("reps", a.reps),
                     ("batches", a.batches and _ints(a.batches)), ("budgets", a.budgets and _ints(a.budgets))):
        if val is not None:
            kw[key] = val
    if a.dry and kw["shapes"] != DRY["shapes"]:
        kw.pop("overrides")  # the overrides are the tiny set's
    if a.profile is not None:
        prof = _ints(a.profile)
        if len(prof) != 2 or prof[0] < 1 or prof[1] < 0:
            ap.error(f"--profile {a.profile!r}: pass B,BUDGET, e.g. 8,64")
        kw["profile"] = prof
    run(formats=tuple(a.formats.split(",")), out=a.out, **kw)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
