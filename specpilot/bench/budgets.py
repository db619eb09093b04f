"""Batched decoding at fixed node budgets and at `budget="auto"`: tokens/s, τ, and the budgets "auto" took.

    python -m specpilot.bench.budgets [--model tiny|hybrid-27b] [--weights w12] [--rows 8] [--prompts 8]
                                      [--tokens 64] [--budgets 0,8,16,32,64,auto] [--device cuda] [--out DIR] [--dry]

`Engine.generate_batch` with the n-gram drafter (batched decoding takes a stateless drafter) over `prompts` prompts in
`rows` cache rows, once per budget (`auto`: each step's budget chosen by the candidates' measured step costs,
`specpilot.engine.batch`). Budget 0 is the autoregressive batch step; every other run's outputs are compared with
it, token for token: on the tiny model they must be identical (the exit status says so). On the synthetic model the
comparison is reported, not required: its random weights give flat logits, whose near-ties a pass of other rows (other
GEMM shapes, another reduction order) may break the other way, the case the engine's lossless check allows below a
top-2 margin of `NEAR_TIE` (docs/engine.md, "Lossless"). tokens/s is the tokens over the batch steps' summed
seconds (`Engine.stats()["batch"]`: drafting, tree building, the pass, acceptance and commit; not the prefill, not the
graphs' capture and not "auto"'s timing of its candidates, which `setup_s` gives beside it). Each budget runs once
untimed first (its graphs captured then).

Models: `tiny`, the shipped tiny model on windows of its held-out text (its τ is real); `hybrid-27b`, the synthetic
full-size model (`specpilot.engine.synthetic`, random weights, the glue as fused Triton kernels): its step costs are
the full-size model's, its prompts random tokens with a repeated motif, and what its drafts get accepted is not a
trained model's. `--dry`: `hybrid-27b`'s path on the CPU at the `tiny` shape set; it checks the script.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .drafters import heldout_prompts
from .engine import versions, write_run

__all__ = ["run", "markdown"]


def _prompts(model: str, n: int, vocab: int) -> list[list[int]]:
    if model == "tiny":
        return heldout_prompts(n)
    g = torch.Generator().manual_seed(11)
    out = []
    for i in range(n):
        motif = torch.randint(0, vocab, (6,), generator=g).tolist()
        out.append(torch.randint(0, vocab, (40 + 7 * i,), generator=g).tolist() + motif * 4)
    return out


def _synthetic_config(model: str, dry: bool):
    """The synthetic model's HF config (dry: the tiny one with 64-wide heads, for CPU runs); None for `tiny`."""
    if model == "tiny":
        return None
    from ..engine.synthetic import hf_config

    return hf_config("tiny" if dry else model, **({"head_dim": 64} if dry else {}))


def _engine(model: str, cfg, weights: str, rows: int, max_len: int, device: str):
    from ..engine import Engine

    if cfg is None:
        from ..models import tiny_stdlib_path

        return Engine.from_pretrained(tiny_stdlib_path(), device=device, weights=weights, drafter="ngram", rows=rows)
    from ..engine import HybridConfig, HybridModel, Kernels
    from ..engine.synthetic import SyntheticTensors

    dev = torch.device(device)
    hc = HybridConfig.from_hf(cfg)
    m = HybridModel(hc, SyntheticTensors(cfg, dev), device=dev, fmt=weights, kernels=Kernels.choose(dev), rows=rows,
                    max_len=max_len, fused_glue=dev.type == "cuda")
    return Engine(m, drafter="ngram")


def run(model: str = "tiny", weights: str = "w12", rows: int = 8, prompts: int = 8, tokens: int = 64,
        budgets=(0, 8, 16, 32, 64, "auto"), device: str = "cuda", out=None, dry: bool = False, log=print) -> dict:
    """Run every budget (module docstring); returns the results, and with `out` writes `<stamp>-budgets.json` and
    `.md` there."""
    from ..engine.batch import generate_batch
    from ..engine.model import MAX_STEP_NODES

    budgets = list(budgets)
    if not budgets or budgets[0] != 0:
        budgets = [0] + [b for b in budgets if b != 0]  # the reference run first
    t0 = time.perf_counter()
    cfg = _synthetic_config(model, dry)
    ps = _prompts(model, prompts, 256 if cfg is None else cfg.vocab_size)
    eng = _engine(model, cfg, weights, rows, max(len(p) for p in ps) + tokens + MAX_STEP_NODES, device)
    log(f"{model} {weights}: engine ready in {time.perf_counter() - t0:.1f} s")
    res = {"model": model, "weights": weights, "rows": rows, "prompts": prompts, "tokens": tokens,
           "device": device, "dry": dry, **versions(),
           "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "runs": []}
    ref = None
    for b in budgets:
        generate_batch(eng, [p[:40] for p in ps[:rows]], 4, budget=b)  # untimed: graphs captured, kernels built
        eng.reset_stats()
        lb: dict = {}
        t1 = time.perf_counter()
        outs = generate_batch(eng, ps, tokens, budget=b, log_budgets=lb)
        wall = time.perf_counter() - t1
        st = eng.stats()["batch"]
        ref = outs if ref is None else ref
        row = {"budget": b, "steps": st["steps"], "tokens": st["tokens"], "tokens_per_step": st["tau"],
               "mean_step_ms": st["mean_step_ms"], "tokens_per_s": st["tokens_per_s"], "steps_s": st["total_s"],
               "setup_s": wall - st["total_s"], "identical": outs == ref}
        if b == "auto":
            row["costs_ms"] = {str(k): 1e3 * v for k, v in sorted(lb["costs"].items())}
            row["steps_by_budget"] = {str(k): lb["steps"].count(k) for k in sorted(set(lb["steps"]))}
        res["runs"].append(row)
        log(f"budget {b}: {st['steps']} steps, {st['tau']:.2f} tokens a step, {st['mean_step_ms']:.2f} ms a step, "
            f"{st['tokens_per_s']:.1f} tokens/s, {'identical' if row['identical'] else 'DIFFERS'}"
            + (f"; costs {row['costs_ms']}, steps {row['steps_by_budget']}" if b == "auto" else ""))
    if out is not None:
        write_run(out, "budgets", res, markdown(res))
    return res


def markdown(res: dict) -> str:
    base = res["runs"][0]["tokens_per_s"]
    where = (f"{res['gpu']}, torch {res['torch']} (CUDA {res['cuda']}), Triton {res.get('triton')}" if not res["dry"]
             else f"CPU dry run (torch {res['torch']}): checks the script; its times are not figures of anything")
    lines = [f"# Batched decoding by node budget: {res['model']}, {res['weights']}, {res['prompts']} prompts in "
             f"{res['rows']} rows, {res['tokens']} new tokens each", "", where + ".", "",
             "| budget | steps | tokens per step (all requests) | ms/step | tokens/s | vs budget 0 | output |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in res["runs"]:
        lines.append(f"| {r['budget']} | {r['steps']} | {r['tokens_per_step']:.2f} | {r['mean_step_ms']:.2f} | "
                     f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | "
                     f"{'identical' if r['identical'] else 'DIFFERS'} |")
    for r in res["runs"]:
        if r["budget"] == "auto":
            lines += ["", "`auto`: measured step ms per candidate budget: "
                      + ", ".join(f"{k}: {v:.2f}" for k, v in r["costs_ms"].items())
                      + f" ({r['setup_s']:.1f} s to capture and time them); steps per budget taken: "
                      + ", ".join(f"{k}: {v}" for k, v in r["steps_by_budget"].items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specpilot.bench.budgets", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny", choices=("tiny", "hybrid-27b"))
    ap.add_argument("--weights", default="w12", choices=("bf16", "w12"))
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--budgets", default="0,8,16,32,64,auto", help="comma-separated ints and 'auto'")
    ap.add_argument("--device", default="cuda", choices=("cpu", "cuda"))
    ap.add_argument("--out", default=None)
    ap.add_argument("--dry", action="store_true", help="hybrid-27b's path on the CPU at tiny shapes")
    args = ap.parse_args(argv)
    if min(args.rows, args.prompts, args.tokens) < 1:
        ap.error("--rows, --prompts and --tokens must be >= 1")
    try:
        budgets = [x if x == "auto" else int(x) for x in args.budgets.split(",") if x]
    except ValueError:
        ap.error(f"--budgets {args.budgets!r}: pass comma-separated ints and 'auto'")
    if any(b != "auto" and b < 0 for b in budgets):
        ap.error("--budgets: a budget is >= 0")
    device = "cpu" if args.dry else args.device
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; pass --device cpu, or --dry")
    model = "hybrid-27b" if args.dry else args.model
    res = run(model, args.weights, args.rows, args.prompts, args.tokens, budgets, device, args.out, args.dry)
    print(markdown(res))
    return 0 if model != "tiny" or all(r["identical"] for r in res["runs"]) else 1


if __name__ == "__main__":
    sys.exit(main())
