"""Drafters on the shipped tiny model: τ and tokens/s of autoregressive decoding, the n-gram drafter, the trained
heads and their Markov variant (a chain of 8, a chain of 16, a 32-node tree each), and two-level verification with
the n-gram drafter, on held-out prompts, every output checked against the autoregressive one.

    python -m specpilot.bench.drafters [--prompts 4] [--tokens 200] [--threads 1] [--device cpu|cuda]

Prompts: `--prompts` windows of `PROMPT_BYTES` bytes of the model's held-out text (`heldout.txt`, modules left out
of the target's and the heads' training), evenly spaced. Each decoding runs every prompt once after a short warm-up
generation; τ is the tokens returned over the steps, tokens/s the tokens over the steps' total time (drafting,
tree building, the verify pass, acceptance and commit; the prefill is not counted). Prints a Markdown table and the
machine, versions and command. On `--device cuda` the engine's steps run as it runs them there (CUDA graphs where
it captures them); the times are wall-clock seconds around each step, as on the CPU.
"""

from __future__ import annotations

import argparse
import platform
import sys

import torch

__all__ = ["MODES", "PROMPT_BYTES", "heldout_prompts", "measure", "main"]

PROMPT_BYTES = 300

# name -> (drafter, Engine keywords)
MODES = {
    "autoregressive": (None, {}),
    "n-gram drafter (16 positions, top-4, 32-node tree)": ("ngram", dict(positions=16, topk=4, tree_nodes=32)),
    "n-gram drafter, two-level verification (Q pass on the 8-bit view)": ("ngram", dict(positions=16, topk=4,
                                                                                        tree_nodes=32, two_level=True)),
    "heads, chain of 8": ("heads", dict(positions=8, topk=1, tree_nodes=9)),
    "heads, chain of 16": ("heads", dict(positions=16, topk=1, tree_nodes=17)),
    "heads, 32-node tree (16 positions, top-4)": ("heads", dict(positions=16, topk=4, tree_nodes=32)),
    "Markov heads, chain of 8": ("heads-markov", dict(positions=8, topk=1, tree_nodes=9)),
    "Markov heads, chain of 16": ("heads-markov", dict(positions=16, topk=1, tree_nodes=17)),
    "Markov heads, 32-node tree (16 positions, top-4)": ("heads-markov", dict(positions=16, topk=4, tree_nodes=32)),
}


def heldout_prompts(n: int) -> list[list[int]]:
    """`n` windows of `PROMPT_BYTES` bytes of the shipped tiny model's held-out text, evenly spaced (module doc)."""
    from ..models import HELDOUT_FILE, tiny_stdlib_path

    text = (tiny_stdlib_path() / HELDOUT_FILE).read_bytes()
    step = (len(text) - PROMPT_BYTES) // max(n, 1)
    return [list(text[i * step:i * step + PROMPT_BYTES]) for i in range(n)]


def measure(n_prompts: int = 4, new_tokens: int = 200, weights: str = "w12", log=print,
            device: str = "cpu") -> list[dict]:
    from ..engine import Engine
    from ..models import tiny_stdlib_path

    path = tiny_stdlib_path()
    prompts = heldout_prompts(n_prompts)
    rows, ref = [], None
    for name, (drafter, kw) in MODES.items():
        eng = Engine.from_pretrained(path, device=device, weights=weights, drafter=drafter, **kw)
        spec = drafter is not None
        eng.generate(prompts[0][:16], 4, speculative=spec)
        eng.reset_stats()
        outs = [eng.generate(p, new_tokens, speculative=spec) for p in prompts]
        st = eng.stats()["verify" if spec else "ar"]
        if ref is None:
            ref = outs
        same = outs == ref
        rows.append({"decoding": name, "steps": st["steps"], "tokens": st["tokens"], "tau": st["tau"],
                     "mean_step_ms": st["mean_step_ms"], "tokens_per_s": st["tokens_per_s"], "identical": same})
        log(f"{name}: τ {st['tau']:.2f}, {st['mean_step_ms']:.1f} ms/step, {st['tokens_per_s']:.1f} tokens/s, "
            f"{'identical to autoregressive' if same else 'DIFFERS from autoregressive'}")
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specpilot.bench.drafters", description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    args = ap.parse_args(argv)
    if args.prompts < 1 or args.tokens < 1 or args.threads < 1:
        ap.error("--prompts, --tokens and --threads must be >= 1")
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: no CUDA device here; run on the CPU with --device cpu")
    torch.set_num_threads(args.threads)
    rows = measure(args.prompts, args.tokens, device=args.device)
    base = rows[0]["tokens_per_s"]
    print("\n| decoding | steps | τ (tokens per step) | ms/step (mean) | tokens/s | vs autoregressive | output |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['decoding']} | {r['steps']} | {r['tau']:.2f} | {r['mean_step_ms']:.1f} | {r['tokens_per_s']:.1f} "
              f"| {r['tokens_per_s'] / base:.2f}x | {'identical' if r['identical'] else 'DIFFERS'} |")
    import transformers

    where = torch.cuda.get_device_name() if args.device == "cuda" else \
        f"CPU: {platform.processor() or platform.machine()}, {args.threads} torch thread(s)"
    print(f"\n{where}; torch {torch.__version__}, transformers {transformers.__version__}, Python "
          f"{platform.python_version()}; command: python -m specpilot.bench.drafters --prompts {args.prompts} "
          f"--tokens {args.tokens} --threads {args.threads} --device {args.device}")
    return 0 if all(r["identical"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
