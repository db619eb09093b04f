"""Optuna search of the GDN WY kernel's launch configs on the current GPU; stores winners as tuned JSON.

    python3 perf/tune_gdn.py --out DIR [--groups B1-M32,B1-M16,B1-M8,B32-M8] [--trials 24] [--budget-s 420]
                             [--store]
    python3 perf/tune_gdn.py --smoke --out DIR     # CPU, interpreter, tiny dims (no timing value)

A tuned entry is keyed by the bucket `configs.wy_config` looks up (B bucketed, M = the plan's largest
request bucketed, K, V), so one entry serves every case of its bucket: B1-M32 holds the 32-node draft
tree and the 32-chain, and its objective is the sum of their times. Each trial builds a `WYConfig`
(inverse split / fold / square, BV, warps, stack, the split launch's own fields, register caps; PDL
where the GPU has it), checks its outputs on layers 0 and L-1 of every case, on the benchmark's
inputs and on hostile ones (`specpilot.bench.cases.gdn.hostile`: the doubling inverse's fallback),
within 2x the error of torch's fp32 WY form against fp64, and only then times all L layers in one
CUDA graph (median of replays). A config that fails to compile or to pass the check scores inf.
Trial 0 is the heuristic default. With --store, a group's best is written through
`autotune.store_tuned` (`gdn.tree_verify/wy/<bucket>`) only if it beats the default by more than
2% in this run; wy_config then returns it on this GPU. Every trial goes to DIR/tune_gdn.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for tune_gdn.json")
    ap.add_argument("--smoke", action="store_true", help="tiny dims on the CPU (interpreter)")
    ap.add_argument("--groups", default=None, help="comma-separated buckets (default: all)")
    ap.add_argument("--trials", type=int, default=24, help="trials per group, the default included")
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall budget for all groups")
    ap.add_argument("--store", action="store_true", help="write winners into autotune/configs/<gpu>.json")
    return ap.parse_args()


ARGS = parse()
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import optuna  # noqa: E402
import torch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from autotune import interpreter as _interp  # the interpreter's two traps, as in tests/conftest.py

    _interp.apply()
import gdn  # noqa: E402
from autotune import bucket_m, force, shape_key, store_tuned  # noqa: E402
from autotune.hardware import has_pdl  # noqa: E402
from gdn.configs import WYConfig, wy_config  # noqa: E402
from gdn.reference import chunk_reference, tree_reference  # noqa: E402
from specpilot.bench.cases.gdn import _inputs, hostile  # noqa: E402
from specpilot.bench.cases.gdn import _tree as draft_tree  # noqa: E402
from specpilot.bench.timing import time_fns  # noqa: E402
from specpilot.testing import error_bound  # noqa: E402

GPU = torch.cuda.is_available() and not ARGS.smoke
DEV = "cuda" if GPU else "cpu"
H, HV, K, V, L = (16, 48, 128, 128, 48) if GPU else (2, 4, 16, 16, 2)


def chain(n):
    return list(range(-1, n - 1))


def groups() -> dict[str, list[tuple[str, list[list[int]]]]]:
    rng = random.Random(4321)  # the benchmark's and gdn_explore's trees
    if not GPU:
        return {"B1-M8": [("B1-N6", [draft_tree(6, rng)]), ("chain5", [chain(5)])]}
    return {"B1-M32": [("B1-N32", [draft_tree(32, rng)]), ("chain32", [chain(32)])],
            "B1-M16": [("chain16", [chain(16)])], "B1-M8": [("chain8", [chain(8)])],
            "B32-M8": [("B24-N8", [draft_tree(8, rng) for _ in range(24)])]}


def suggest(trial) -> WYConfig:
    inverse = trial.suggest_categorical("inverse", ["split", "fold", "square"])
    f = dict(inverse=inverse, BV=trial.suggest_categorical("BV", [32, 64] if GPU else [16]),
             num_warps=trial.suggest_categorical("num_warps", [4, 8] if GPU else [4]),
             stack=trial.suggest_categorical("stack", [False, True]), pdl=GPU and has_pdl(DEV))
    if GPU:
        f["maxnreg"] = trial.suggest_categorical("maxnreg", [0, 128, 168]) or None
    if inverse == "split":
        f["inverse_warps"] = trial.suggest_categorical("inverse_warps", [4, 8] if GPU else [4])
        f["inverse_stack"] = trial.suggest_categorical("inverse_stack", [False, True])
        if GPU:
            f["inverse_maxnreg"] = trial.suggest_categorical("inverse_maxnreg", [0, 128, 168]) or None
    return WYConfig(**f)


def params_of(cfg: WYConfig) -> dict:
    """The trial parameters that rebuild `cfg` (to enqueue the default as trial 0)."""
    p = dict(inverse=cfg.inverse, BV=cfg.BV, num_warps=cfg.num_warps, stack=cfg.stack)
    if GPU:
        p["maxnreg"] = cfg.maxnreg or 0
    if cfg.inverse == "split":
        p.update(inverse_warps=cfg.inverse_warps, inverse_stack=cfg.inverse_stack)
        if GPU:
            p["inverse_maxnreg"] = cfg.inverse_maxnreg or 0
    return p


def prepare(trees, seed, bad):
    T = sum(len(t) for t in trees)
    q, k, v, g, beta, pool = _inputs(L, T, H, HV, K, V, len(trees), DEV, seed)
    if bad:
        k, g, beta = hostile(k, g, beta, seed + 1)
    plan = gdn.build_tree_plan(trees, device=DEV)
    idx = list(range(len(trees)))
    refs = {}
    for li in (0, L - 1) if L > 1 else (0,):
        a = (q[li], k[li], v[li], g[li], beta[li])
        refs[li] = (tree_reference(*a, pool[li].double(), idx, trees, use_qk_l2norm=True, dtype=torch.float64),
                    tree_reference(*a, pool[li], idx, trees, use_qk_l2norm=True, fn=chunk_reference))
    return dict(args=(q, k, v, g, beta, pool), plan=plan, T=T, refs=refs,
                idx=torch.arange(len(trees), device=DEV, dtype=torch.int32))


def run_layers(case, out):
    q, k, v, g, beta, pool = case["args"]
    for li in range(L):
        gdn.tree_verify(q[li], k[li], v[li], g[li], beta[li], pool[li], case["idx"], case["plan"],
                        use_qk_l2norm=True, variant="wy", out=out[li])


def checked(case) -> bool:
    o32 = torch.full((L, case["T"], HV, V), float("nan"), device=DEV)
    run_layers(case, o32)
    for li, (r64, r32) in case["refs"].items():
        c = error_bound(o32[li].double(), r64, r32, factor=2.0)
        if not c.ok:
            return False
    return True


def tune_group(name, cases, deadline, log) -> dict:
    prepared = [(cname, prepare(trees, 7 + i, False), prepare(trees, 70 + i, True))
                for i, (cname, trees) in enumerate(cases)]
    batch, nodes = len(cases[0][1]), max(len(t) for t in cases[0][1])
    default = wy_config(nodes, K, V, DEV, batch=batch, HV=HV)
    key = shape_key(B=bucket_m(batch), M=nodes, K=K, V=V)
    rows, seen = [], {}

    def objective(trial):
        cfg = suggest(trial)
        if cfg in seen:  # the sampler proposed a config already run: no device time for it again
            return seen[cfg]
        seen[cfg] = math.inf
        row = dict(group=name, trial=trial.number, config=dataclasses.asdict(cfg), us={}, ok=False)
        rows.append(row)
        t0 = time.time()
        try:
            with force("gdn.tree_verify", config=cfg):
                if not all(checked(p) and checked(h) for _, p, h in prepared):
                    row["error"] = "check failed"
                    return math.inf
                for cname, p, _ in prepared:
                    o = torch.empty(L, p["T"], HV, V, device=DEV, dtype=torch.bfloat16)
                    row["us"][cname] = time_fns([lambda p=p, o=o: run_layers(p, o)], reps=20 if GPU else 1,
                                                warmup=1).median * 1e6
        except Exception as e:  # noqa: BLE001 (a config that does not compile or launch)
            row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
            return math.inf
        row["ok"] = True
        total = seen[cfg] = sum(row["us"].values())
        log(f"  {name} trial {trial.number:2d} {total:9.1f} us {row['us']} {params_of(cfg)} ({time.time() - t0:.1f}s)")
        return total

    study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=0))
    study.enqueue_trial(params_of(default))
    study.optimize(objective, n_trials=ARGS.trials, timeout=max(1.0, deadline - time.time()))
    done = [r for r in rows if r["ok"]]
    base = next((r for r in rows if r["trial"] == 0 and r["ok"]), None)
    best = min(done, key=lambda r: sum(r["us"].values()), default=None)
    res = dict(group=name, key=key, default=dataclasses.asdict(default), trials=rows,
               default_us=sum(base["us"].values()) if base else None,
               best=best and dict(config=best["config"], us=best["us"], total=sum(best["us"].values())))
    if best and base and res["best"]["total"] < 0.98 * res["default_us"]:
        res["gain"] = res["default_us"] / res["best"]["total"]
        if ARGS.store:
            path = store_tuned("gdn.tree_verify", "wy", key, WYConfig(**best["config"]), device=DEV if GPU else None,
                               extra=dict(us=best["us"], default_us=res["default_us"], tuner="perf/tune_gdn.py"))
            res["stored"] = str(path)
    return res


def main():
    if ARGS.store and not GPU:
        raise SystemExit("--store writes this GPU's tuned file: it needs a GPU run (not --smoke)")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    t_end = time.time() + ARGS.budget_s
    every = groups()
    names = ARGS.groups.split(",") if ARGS.groups else list(every)
    unknown = sorted(set(names) - set(every))
    if unknown:
        raise SystemExit(f"unknown --groups {unknown}; known: {list(every)}")

    def log(s):
        print(s, flush=True)

    log(f"device={torch.cuda.get_device_name() if GPU else 'cpu'} torch={torch.__version__} L={L} H={H} HV={HV} "
        f"K={K} V={V} trials={ARGS.trials} budget={ARGS.budget_s}s store={ARGS.store}")
    results = []
    for i, name in enumerate(names):
        share = (t_end - time.time()) / (len(names) - i)
        res = tune_group(name, every[name], time.time() + share, log)
        results.append(res)
        b = res["best"]
        log(f"== {name} ({res['key']}): default {res['default_us']} us; best "
            f"{b and round(b['total'], 1)} us {b and b['config']}; gain {res.get('gain', 'none over 2%')}; "
            f"stored: {res.get('stored', 'no')}")
    if ARGS.out:
        os.makedirs(ARGS.out, exist_ok=True)
        meta = dict(device=torch.cuda.get_device_name() if GPU else "cpu", torch=torch.__version__,
                    triton=__import__("triton").__version__, L=L, H=H, HV=HV, K=K, V=V)
        with open(os.path.join(ARGS.out, "tune_gdn.json"), "w") as f:
            json.dump(dict(meta=meta, groups=results), f, indent=1)


if __name__ == "__main__":
    main()
