"""GDN tree-verify exploration on one GPU: the default CUDA and WY kernels side by side with recurrent and fla,
the alternative WY forms (levels, wgmma) and the phase ablations.

    python3 perf/gdn_explore.py --out $OUT            # H200, hybrid-27b dims, <= ~3.5 min
    python3 perf/gdn_explore.py --smoke               # CPU, interpreter, tiny dims (no timing value)

Every case runs all L layers inside one CUDA graph (per-layer inputs and state pools), times the
median of graph replays, and is only timed after its output passed the derived check on layers
0 and L-1: within 2x the error of the same algorithm in torch fp32 against fp64 (fp32 output
buffer, so the kernel's own error shows). Prints n_regs/n_spills of every compiled kernel, then
a best-per-case table last. A hard time budget skips what is left and still prints the table.
The kernels' launch configs (`WYConfig`, `CudaConfig`) are searched by `specpilot tune --op gdn.tree_verify`
(gdn/space.py, docs/autotune.md), not here.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def parse():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="folder for results.json")
    ap.add_argument("--smoke", action="store_true", help="tiny dims on CPU (interpreter)")
    ap.add_argument("--budget", type=float, default=190.0, help="hard wall budget in seconds (all of it)")
    ap.add_argument("--fla-budget", type=float, default=75.0,
                    help="share of the budget for fla (run first: its first-call autotune is ~60 s)")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--cases", default=None, help="comma-separated case names (default: all)")
    ap.add_argument("--configs", default=None,
                    help="comma-separated name prefixes of the WY configs to run beside wy and recurrent "
                         "(default: all)")
    ap.add_argument("--ablate", action="store_true",
                    help="also time B1 configs with phases removed (the stacked, split and one-launch configs; "
                         "WYConfig.skip / CudaConfig.skip: wrong outputs, timing only, never checked or ranked)")
    return ap.parse_args()


ARGS = parse()
T0 = time.time()
if ARGS.smoke:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":
    from autotune import interpreter as _interp  # the interpreter's two traps, as in tests/conftest.py

    _interp.apply()
import gdn  # noqa: E402
from autotune import force  # noqa: E402
from gdn.configs import WY_WGMMA, CudaConfig, WYConfig  # noqa: E402
from gdn.reference import chunk_reference, recurrent_reference, root_path, tree_reference  # noqa: E402
from specpilot.bench.cases.gdn import _inputs as bench_inputs  # noqa: E402
from specpilot.bench.cases.gdn import hostile as bench_hostile  # noqa: E402
from specpilot.bench.timing import time_fns  # noqa: E402
from specpilot.testing import error_bound  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() and not ARGS.smoke else "cpu"
GPU = DEV == "cuda"
if GPU:
    H, HV, K, V, L, W = 16, 48, 128, 128, 48, 4
else:
    H, HV, K, V, L, W = 2, 4, 16, 16, 2, 4
if ARGS.layers:
    L = ARGS.layers
C = 2 * H * K + HV * V if GPU else 24

# The CUDA C++ kernel (gdn/csrc/gdn_tree.cu, variant "cuda", its default config) and its phase ablations.
CUDA = {"cuda": None,
        # ablations (wrong outputs, timing only): exit after the wait, exit after the loads, no solve, no products
        **{f"ablate-cuda-skip{b}": CudaConfig(skip=b) for b in (1, 8, 2, 4, 6)}}

# The Triton WY kernel: name -> pinned config (None = the default, configs.wy_config). Timings on the H200 are
# in docs/gdn.md.
WY = {
    "wy": None,
    "levels": WYConfig(BV=32, num_warps=4, inverse="levels"),  # substitution: the guard's fallback, alone
    "wgmma": WY_WGMMA,  # transposed, the config that emits wgmma
}
# --ablate (wrong outputs, timed only; gdn/kernels/wy.py SKIP bits): the stacked square config's phases
ABLATE = {f"ablate-skip{b}": WYConfig(BV=64, num_warps=8, stack=True, pdl=True, skip=b)
          for b in (1, 2, 4, 5, 7)}
# the split config's phases (first launch's rounds; bit 4: the second launch no longer waits on the first)
ABLATE.update({f"ablate-split-skip{b}": WYConfig(BV=32, num_warps=4, stack=True, inverse="split", pdl=True, skip=b)
               for b in (1, 2, 4)})
# the one-launch split's phases (bit 2: no rounds; bit 4: consumers read no N, producers raise no flag)
ABLATE.update({f"ablate-flag-skip{b}": WYConfig(BV=32, num_warps=4, stack=True, inverse="split", pdl=True,
                                                  inverse_stack=True, handoff="flag", skip=b) for b in (2, 4)})
ESSENTIAL: dict[str, tuple[str, ...]] = {}  # names run even past the case's budget share
if not GPU:
    WY = {"wy": WYConfig(BV=16), "levels": WYConfig(BV=16, inverse="levels"), "t-bv16": WYConfig(BV=16, trans=True)}

ROWS: list[dict] = []
LOG: list[str] = []


def left() -> float:
    return ARGS.budget - (time.time() - T0)


def say(*a):
    s = " ".join(str(x) for x in a)
    print(s, flush=True)
    LOG.append(s)


def draft_tree(n, rng):
    return [-1] + [rng.randrange(max(0, i - 5), i) for i in range(1, n)]


def chain(n):
    return list(range(-1, n - 1))


def inputs(T, B, seed, hostile=False):
    """Stacked per-layer q, k, v, g, beta and state pool: the benchmark case's own inputs. hostile:
    keys nearly parallel within each layer and head (corr 0.95), beta in [0.9, 1], gates near 0, so
    the doubling inverses' guard sends every program to its substitution fallback (its cost)."""
    q, k, v, g, beta, pool = bench_inputs(L, T, H, HV, K, V, B, DEV, seed)
    if hostile:
        k, g, beta = bench_hostile(k, g, beta, seed + 1)
    return q, k, v, g, beta, pool


def time_fn(fn, reps=20):
    """Median microseconds of one call of fn (all layers), timed by specpilot.bench.timing
    (CUDA-graph replays on the GPU; one call under perf_counter on the CPU)."""
    return time_fns([fn], reps=reps if GPU else 1, warmup=1).median * 1e6


_SEEN: set = set()


def kernel_report(tag):
    """n_regs / n_spills of compiled kernels new since the last call."""
    if not GPU:
        return
    from gdn.kernels.commit import gdn_commit_conv_kernel, gdn_commit_state_kernel
    from gdn.kernels.conv import gdn_tree_conv_kernel
    from gdn.kernels.recurrent import gdn_tree_recurrent_kernel
    from gdn.kernels.wy import gdn_tree_split_kernel, gdn_tree_wy_kernel

    for kern in (gdn_tree_wy_kernel, gdn_tree_split_kernel, gdn_tree_recurrent_kernel, gdn_tree_conv_kernel, gdn_commit_state_kernel,
                 gdn_commit_conv_kernel):
        for entry in getattr(kern, "device_caches", {}).values():
            for key, ck in entry[0].items():
                if id(ck) in _SEEN:
                    continue
                _SEEN.add(id(ck))
                try:
                    ck._init_handles()
                except Exception:
                    pass
                md = ck.metadata
                ptx = ck.asm.get("ptx", "") if hasattr(ck, "asm") else ""
                mma = "wgmma" if "wgmma" in ptx else ("mma" if "mma.sync" in ptx else "fma")
                say(f"  [regs] {tag:<22} {kern.fn.__name__:<28} warps={md.num_warps} regs={getattr(ck, 'n_regs', '?')} "
                    f"spills={getattr(ck, 'n_spills', '?')} smem={getattr(md, 'shared', '?')} {mma}")


def check(o32, case, fnref, layers, bf16=False):
    """Derived check: kernel vs fp64 within 2x the torch fp32 algorithm's error (norm and max); bf16: a bf16
    output against the torch fp32 result rounded to bf16 (configs that keep fewer state bits)."""
    q, k, v, g, beta, pool, trees = case["inputs"] + (case["trees"],)
    idx = list(range(len(trees)))
    worst = 0.0
    for li in layers:
        key = (li, fnref.__name__)
        if key not in case["refs"]:
            a = (q[li], k[li], v[li], g[li], beta[li])
            r64 = tree_reference(*a, pool[li].double(), idx, trees, use_qk_l2norm=True, dtype=torch.float64)
            r32 = tree_reference(*a, pool[li], idx, trees, use_qk_l2norm=True, fn=fnref)
            case["refs"][key] = (r64, r32)
        r64, r32 = case["refs"][key]
        c = error_bound(o32[li].double(), r64, r32.to(torch.bfloat16) if bf16 else r32, factor=2.0)
        ok = c.ok
        worst = max(worst, c.err / max(c.base_err, 1e-30), c.max_abs / max(c.base_max_abs, 1e-30))
        if not ok:
            return False, worst
    return True, worst


def run_verify(case, name, cfg, kernel):
    q, k, v, g, beta, pool = case["inputs"]
    plan, T = case["plan"], case["T"]
    idx = torch.arange(len(case["trees"]), device=DEV, dtype=torch.int32)
    o32 = torch.full((L, T, HV, V), float("nan"), device=DEV)
    o = torch.empty(L, T, HV, V, device=DEV, dtype=torch.bfloat16)

    def call(out):
        def f():
            ctx = force("gdn.tree_verify", config=cfg) if cfg is not None else None
            if ctx:
                ctx.__enter__()
            try:
                for li in range(L):
                    gdn.tree_verify(q[li], k[li], v[li], g[li], beta[li], pool[li], idx, plan, use_qk_l2norm=True,
                                    variant=kernel, out=out[li])
            finally:
                if ctx:
                    ctx.__exit__(None, None, None)
        return f

    call(o32)()
    if cfg is not None and getattr(cfg, "skip", 0):
        ok, ratio = False, float("nan")  # an ablation: wrong by design, timed and never ranked
        us = time_fn(call(o))
        kernel_report(name)
        return ok, ratio, us
    bf16 = isinstance(cfg, CudaConfig) and cfg.pieces == 2
    if bf16:
        call(o)()
    ok, ratio = check(o.float() if bf16 else o32, case, recurrent_reference if kernel == "recurrent" else chunk_reference,
                      (0, L - 1) if L > 1 else (0,), bf16=bf16)
    us = time_fn(call(o)) if ok else float("nan")
    kernel_report(name)
    return ok, ratio, us


def run_fla(case, name):
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception as e:  # noqa: BLE001
        return None, f"fla not importable ({type(e).__name__})"
    f = chunk_gated_delta_rule if name == "fla.chunk" else fused_recurrent_gated_delta_rule
    q, k, v, g, beta, pool = case["inputs"]
    qe, ke = (t.repeat_interleave(HV // H, 2) for t in (q, k))
    outs = [None] * L

    def fn():
        for li in range(L):
            outs[li] = f(q=qe[li, None], k=ke[li, None], v=v[li, None], g=g[li, None], beta=beta[li, None],
                         scale=K ** -0.5, initial_state=pool[li], output_final_state=False,
                         use_qk_l2norm_in_kernel=True)[0]

    with torch.inference_mode():
        fn()
        o = torch.stack([x[0] for x in outs]).float()
        r64, _ = case["refs"].get((0, "recurrent_reference"), (None, None))
        if r64 is None:
            a = (q[0], k[0], v[0], g[0], beta[0])
            r64 = recurrent_reference(*a, pool[0, 0].double(), use_qk_l2norm=True, dtype=torch.float64)
        err = float((o[0].double() - r64).norm() / r64.norm())
        us = time_fn(fn)
    return us, f"rel_err={err:.2e} (bf16 out)"


def main():
    rng = random.Random(4321)
    if GPU:
        specs = [("B1-N32", [draft_tree(32, rng)]), ("B24-N8", [draft_tree(8, rng) for _ in range(24)]),
                 ("chain8", [chain(8)]), ("chain16", [chain(16)]), ("chain32", [chain(32)]),
                 ("B1-N32-hostile", [draft_tree(32, random.Random(4321))]), ("chain32-hostile", [chain(32)]),
                 ("B1-N64", [draft_tree(64, random.Random(64))])]
    else:
        specs = [("B1-N6", [draft_tree(6, rng)]), ("B3-N3", [draft_tree(3, rng) for _ in range(3)]),
                 ("chain4", [chain(4)]), ("chain8-hostile", [chain(8)])]
    if ARGS.cases:
        keep = ARGS.cases.split(",")
        unknown = sorted(set(keep) - {n for n, _ in specs})
        if unknown:
            raise SystemExit(f"unknown --cases {unknown}; known: {[n for n, _ in specs]}")
        specs = [sp for sp in specs if sp[0] in keep]
    if ARGS.ablate:
        WY.update(ABLATE if GPU else {f"ablate-skip{b}": WYConfig(BV=16, stack=True, skip=b) for b in (1, 7)})
    say(f"device={torch.cuda.get_device_name() if GPU else 'cpu'} torch={torch.__version__} "
        f"L={L} H={H} HV={HV} K={K} V={V} budget={ARGS.budget}s")
    best: dict[str, list] = {}
    cases = {}
    for sname, trees in specs:
        T = sum(len(t) for t in trees)
        cases[sname] = dict(trees=trees, T=T, plan=gdn.build_tree_plan(trees, device=DEV),
                            inputs=inputs(T, len(trees), 7 + T, hostile=sname.endswith("-hostile")), refs={})
    # fla first, on its own share of the budget: warm-up call (autotune) untimed, then timed
    fla_end = time.time() + (ARGS.fla_budget if GPU else 0.0)
    for sname, _ in specs:
        for name in (["fla.chunk", "fla.fused_recurrent"] if GPU and sname.startswith("chain") else []):
            if time.time() > fla_end or left() < 100:
                say(f"  (fla budget) skipped {sname} {name}")
                continue
            t = time.time()
            try:
                us, note = run_fla(cases[sname], name)
            except Exception as e:  # noqa: BLE001
                us, note = None, f"ERROR {type(e).__name__}: {str(e)[:160]}"
            us = float("nan") if us is None else us
            say(f"== {sname} {name:<20} {us:9.1f} us  {note}  ({time.time() - t:.1f}s incl. warm-up)")
            ROWS.append(dict(case=sname, variant=name, us=us, ok=us == us, note=note))
            if us == us:
                best.setdefault(sname, []).append((us, name))
    for sname, trees in specs:
        case = cases[sname]
        T, plan = case["T"], case["plan"]
        floor = L * (2 * T * H * K * 2 + T * HV * V * 2 + T * HV * 6 + len(trees) * HV * K * V * 4 + T * HV * V * 2)
        floor_us = floor / 3.3e12 * 1e6  # at ~3.3 TB/s measured-ish H200 copy bandwidth
        say(f"== {sname}: T={T} depth<= {max(len(root_path(t, i)) for t in trees for i in range(len(t))) - 1} "
            f"byte floor {floor / 1e6:.1f} MB ~ {floor_us:.0f} us")
        # essentials first (default wy, baselines), then the other configs within this case's share
        names = ["wy", "recurrent"] + [n for n in WY if n != "wy"]
        if ARGS.configs:
            names = names[:2] + [n for n in names[2:] if n.startswith(tuple(ARGS.configs.split(",")))]
        names = names[:2] + (list(CUDA) if GPU else []) + names[2:]
        cases_left = len(specs) - [s_ for s_, _ in specs].index(sname)
        case_end = time.time() + max(10.0, (left() - 20) / cases_left)
        for name in names:
            if name.startswith("ablate-") and not sname.startswith("B1"):
                continue
            essential = (name in ("wy", "recurrent") + ESSENTIAL.get(sname, ())
                         or name.startswith(("ablate-", "cuda")))
            if left() < 12 or (not essential and time.time() > case_end):
                say(f"  (budget) skipped {name}")
                continue
            t = time.time()
            try:
                kern = "recurrent" if name == "recurrent" else "cuda" if name in CUDA else "wy"
                ok, ratio, us = run_verify(case, name, CUDA[name] if name in CUDA else WY.get(name), kern)
                if name.startswith("ablate-"):
                    note = "ABLATION: phases removed, wrong outputs, timing only"
                else:
                    note = f"err/torch32={ratio:.2f}" + ("" if ok else " FAILED CHECK")
            except Exception as e:  # noqa: BLE001
                ok, us, note = False, float("nan"), f"ERROR {type(e).__name__}: {str(e)[:160]}"
            if us is None:
                us = float("nan")
            say(f"  {name:<22} {us:9.1f} us  {note}  ({time.time() - t:.1f}s)")
            ROWS.append(dict(case=sname, variant=name, us=us, ok=ok, note=note))
            if ok and us == us:
                best.setdefault(sname, []).append((us, name))
    # the other two ops of the step
    if left() > 10:
        try:
            other_ops()
        except Exception as e:  # noqa: BLE001
            say(f"other ops ERROR {type(e).__name__}: {str(e)[:200]}")
    say("")
    say("== best per case (checked outputs only; us for all layers in one graph)")
    for sname, _ in specs:
        rows = sorted(best.get(sname, []))
        rec = next((u for u, n in rows if n == "recurrent"), float("nan"))
        fla = min([u for u, n in rows if n.startswith("fla.")] or [float("nan")])
        top = ", ".join(f"{n} {u:.0f}" for u, n in rows if not n.startswith(("fla.", "recurrent")))
        top = ", ".join(top.split(", ")[:3])
        new = next((u for u, n in rows if n == "wy"), float("nan"))
        cuda = next((u for u, n in rows if n == "cuda"), float("nan"))
        say(f"  {sname:<8} best: {top} | default wy {new:.0f} | default cuda {cuda:.0f} | recurrent {rec:.0f} "
            f"| fla {fla:.0f}")
    if ARGS.out:
        os.makedirs(ARGS.out, exist_ok=True)
        with open(os.path.join(ARGS.out, "gdn_explore.json"), "w") as f:
            json.dump(dict(rows=ROWS, log=LOG), f, indent=1)
    say(f"wall {time.time() - T0:.0f}s")


def other_ops():
    rng = random.Random(1)
    trees = [draft_tree(32 if GPU else 6, rng)]
    T = len(trees[0])
    plan = gdn.build_tree_plan(trees, device=DEV)
    gen = torch.Generator(device=DEV).manual_seed(3)
    x = torch.randn(L, T, C, device=DEV, generator=gen).to(torch.bfloat16)
    cs = torch.randn(L, 1, C, W - 1, device=DEV, generator=gen).to(torch.bfloat16)
    w = (torch.randn(L, C, W, device=DEV, generator=gen) * 0.5).to(torch.bfloat16)
    y = torch.empty_like(x)
    us = time_fn(lambda: [gdn.tree_conv1d(x[li], cs[li], w[li], plan, out=y[li]) for li in range(L)])
    say(f"== tree_conv1d B1-N{T} all layers: {us:.1f} us ({L} launches)")
    q, k, v, g, beta, pool = inputs(T, 1, 11)
    path = root_path(trees[0], max(range(T), key=lambda i: len(root_path(trees[0], i))))
    acc = torch.tensor([path], dtype=torch.int32, device=DEV)
    acc_len = torch.tensor([len(path)], dtype=torch.int32, device=DEV)
    idx = torch.zeros(1, dtype=torch.int32, device=DEV)
    us = time_fn(lambda: gdn.commit(pool, cs, idx, plan, acc, acc_len, k, v, g, beta, x, use_qk_l2norm=True))
    say(f"== commit B1 accepted {len(path)} all layers: {us:.1f} us (2 launches: state + conv, all layers each)")
    kernel_report("conv/commit")


if __name__ == "__main__":
    main()
