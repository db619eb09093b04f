"""Train the parallel drafter heads (`specpilot.engine.spec.heads`) for the tiny_stdlib model, on the CPU.

    python -m specpilot.models.train_heads --out DIR [--steps N] [--prompts N] [--seed S] [--threads T] [--markov]

Data: self-distillation. What a drafter of greedy decoding must predict is the target's own greedy
continuation, not the corpus. `--prompts` windows of `PROMPT_LEN` bytes are drawn from the training corpus of
`specpilot.models.train_tiny` (the standard library modules it trained on; seeded), the target continues each
greedily for `GEN_LEN` bytes (`transformers`' `generate`, fp32), and one teacher-forced pass over prompt and
continuation gives the final-normed hidden state of every position, rounded to BF16 as the engine computes it.
Along a greedy continuation the next bytes are the greedy continuation from every position, so each position t
from the prompt's second-to-last byte on is one example: (hidden state at t, the byte at t + 1) -> the bytes at
t + 2 .. t + 1 + positions. The evaluation set is built the same way from `EVAL_PROMPTS` windows of the
checkpoint's held-out text (`heldout.txt`), which training never reads.

Training: AdamW with warmup and cosine decay, batches of `BATCH` examples, cross-entropy per position weighted
by `POS_DECAY ** d` (an error at depth d ends the accepted chain there, so the first positions matter most).
Seeded (`--seed` draws the prompts and initialises the heads) and run on `--threads` torch threads: the same
seed, threads and corpus give the same weights. `--markov`: the Markov variant (`HeadsDims.markov`), each row also
reading the token above it, given the true one in training (teacher forcing); its evaluation feeds the same, which
counts the same leading run of correct tokens as feeding its own top-1 (they agree up to the first miss).

Output (DIR): `heads.safetensors` (BF16, `HeadsDrafter.save`) and `train.json` (recipe, data sizes, wall
times, versions, and on the evaluation set the top-1 accuracy per position and the mean accepted length of a
greedy chain of 8 and of 16, i.e. the τ a chain would reach, minus one for the bonus token).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import torch
import torch.nn.functional as F

from ..engine.spec.heads import HeadsDims, HeadsDrafter, HeadsNet, embed_sha256
from . import HEADS_FILE, HELDOUT_FILE, TRAIN_FILE, tiny_stdlib_path
from . import train_tiny

__all__ = ["make_examples", "chain_acceptance", "train", "main"]

RECORD_FILE = TRAIN_FILE

DEFAULT_SEED = 0
DEFAULT_STEPS = 1200
DEFAULT_PROMPTS = 1536
EVAL_PROMPTS = 128
PROMPT_LEN = 64
GEN_LEN = 96
GEN_BATCH = 256
BATCH = 256
LR = 2e-3
MIN_LR_FRAC = 0.05
WARMUP = 50
WEIGHT_DECAY = 0.01
BETAS = (0.9, 0.95)
POS_DECAY = 0.85
POSITIONS = 16

_WHERE = "specpilot.models.train_heads"


@torch.no_grad()
def make_examples(target, data: torch.Tensor, n_prompts: int, gen: torch.Generator, positions: int = POSITIONS,
                  prompt_len: int = PROMPT_LEN, gen_len: int = GEN_LEN, batch: int = GEN_BATCH):
    """(hidden [N, H] fp32 of BF16 values, pending [N] int64, labels [N, positions] int64) from `n_prompts`
    windows of the byte tensor `data` continued greedily by `target` (module docstring)."""
    if gen_len < positions + 1:
        raise ValueError(f"{_WHERE}.make_examples: gen_len={gen_len} < positions + 1 = {positions + 1}; a "
                         "continuation must hold the labels of at least one example")
    starts = torch.randint(0, data.numel() - prompt_len, (n_prompts,), generator=gen)
    offsets = torch.arange(prompt_len)
    hs, ps, ls = [], [], []
    S = prompt_len
    ts = torch.arange(S - 2, S + gen_len - 1 - positions)  # example positions t: labels t+2 .. t+1+positions
    lab = ts[:, None] + 2 + torch.arange(positions)[None]
    for a in range(0, n_prompts, batch):
        x = data[starts[a:a + batch, None] + offsets]
        seq = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=gen_len, do_sample=False,
                              min_new_tokens=gen_len)
        h = target(input_ids=seq, output_hidden_states=True, use_cache=False).hidden_states[-1]
        h = h.to(torch.bfloat16).float()  # the engine's hidden states are BF16
        hs.append(h[:, ts].reshape(-1, h.shape[-1]))
        ps.append(seq[:, ts + 1].reshape(-1))
        ls.append(seq[:, lab].reshape(-1, positions))
    return torch.cat(hs), torch.cat(ps), torch.cat(ls)


def _prev(net: HeadsNet, pending: torch.Tensor, labels: torch.Tensor) -> torch.Tensor | None:
    """The tokens above each row that a Markov net reads (the pending token, then the labels), else None."""
    return torch.cat([pending[:, None], labels[:, :-1]], 1) if net.dims.markov else None


@torch.no_grad()
def chain_acceptance(net: HeadsNet, hidden, pending, labels, batch: int = 4096) -> dict:
    """Top-1 accuracy per position (a Markov net's given the true token above), and the mean number of leading
    correct top-1 predictions of a chain of 8 and of 16 (the draft tokens a greedy chain verify step would
    accept)."""
    correct = []
    for a in range(0, hidden.shape[0], batch):
        p, y = pending[a:a + batch], labels[a:a + batch]
        pred = net(hidden[a:a + batch], p, _prev(net, p, y)).argmax(-1)
        correct.append(pred == labels[a:a + batch])
    ok = torch.cat(correct)
    run = ok.long().cumprod(-1)
    return {"top1_per_position": [round(float(v), 4) for v in ok.float().mean(0)],
            "chain8_accepted": round(float(run[:, :8].sum(-1).float().mean()), 4),
            "chain16_accepted": round(float(run[:, :16].sum(-1).float().mean()), 4)}


def train(out, steps: int = DEFAULT_STEPS, prompts: int = DEFAULT_PROMPTS, eval_prompts: int = EVAL_PROMPTS,
          seed: int = DEFAULT_SEED, threads: int = 1, target_dir=None, log=None, markov: bool = False) -> dict:
    """Build the data, train the heads, write `HEADS_FILE` and `RECORD_FILE` to `out`; returns the record.
    `log(line)`: progress lines (default: printed)."""
    log = log or (lambda line: print(line, flush=True))
    import transformers

    for name, v, lo in (("steps", steps, 1), ("prompts", prompts, 1), ("eval_prompts", eval_prompts, 1),
                        ("threads", threads, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < lo:
            raise ValueError(f"{_WHERE}.train: {name}={v!r}; pass an int >= {lo}")
    torch.set_num_threads(threads)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    target_dir = pathlib.Path(target_dir or tiny_stdlib_path())
    t0 = time.perf_counter()

    target = train_tiny.build_model(target_dir)
    _, train_paths, _ = train_tiny.corpus_files()
    corpus = train_tiny._byte_tensor(b"".join(p.read_bytes() for p in train_paths))
    held = train_tiny._byte_tensor((target_dir / HELDOUT_FILE).read_bytes())
    gen = torch.Generator().manual_seed(seed)
    train_set = make_examples(target, corpus, prompts, gen)
    eval_set = make_examples(target, held, eval_prompts, gen)
    t_data = time.perf_counter() - t0
    log(f"data: {train_set[0].shape[0]} training examples from {prompts} corpus prompts, {eval_set[0].shape[0]} "
        f"evaluation examples from {eval_prompts} held-out prompts, {t_data:.0f} s")

    torch.manual_seed(seed)
    cfg = target.config
    net = HeadsNet(HeadsDims(hidden=cfg.hidden_size, vocab=cfg.vocab_size, positions=POSITIONS, markov=bool(markov)))
    n_params = sum(p.numel() for p in net.parameters())
    opt = train_tiny.adamw(net, LR, WEIGHT_DECAY, BETAS)
    w = POS_DECAY ** torch.arange(POSITIONS, dtype=torch.float32)
    w = w / w.sum()
    hidden, pending, labels = train_set
    N = hidden.shape[0]
    net.train()
    t1 = time.perf_counter()
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = train_tiny.cosine_lr(step, steps, LR, WARMUP, MIN_LR_FRAC)
        idx = torch.randint(0, N, (min(BATCH, N),), generator=gen)
        logits = net(hidden[idx], pending[idx], _prev(net, pending[idx], labels[idx]))  # [B, P, V]
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[idx].reshape(-1), reduction="none")
        loss = (ce.view(-1, POSITIONS) * w).sum(-1).mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        losses.append(float(loss.detach()))
        if (step + 1) % 100 == 0 or step + 1 == steps:
            log(f"step {step + 1}/{steps}  loss {sum(losses[-100:]) / len(losses[-100:]):.4f}  "
                f"{time.perf_counter() - t1:.0f}s")
    t_train = time.perf_counter() - t1
    net.eval()

    # evaluate the weights as shipped: written as BF16 and loaded back
    drafter = HeadsDrafter(net, embed_sha256(target.model.embed_tokens.weight))
    drafter.save(out / HEADS_FILE)
    shipped = HeadsDrafter.load(out / HEADS_FILE)
    metrics = {"eval": chain_acceptance(shipped.net, *eval_set),
               "train_sample": chain_acceptance(shipped.net, *(t[:eval_set[0].shape[0]] for t in train_set))}
    record = {
        "seed": seed, "threads": threads, "steps": steps, "batch": BATCH,
        "heads": json.loads(json.dumps(shipped.dims.__dict__)), "parameters": n_params,
        "data": {"target": str(target_dir.name), "prompts": prompts, "eval_prompts": eval_prompts,
                 "prompt_len": PROMPT_LEN, "gen_len": GEN_LEN, "train_examples": int(N),
                 "eval_examples": int(eval_set[0].shape[0]),
                 "labels": "the target's greedy continuation (transformers generate, fp32)",
                 "eval_text": HELDOUT_FILE},
        "optimizer": {"name": "AdamW", "lr": LR, "min_lr": LR * MIN_LR_FRAC, "warmup_steps": WARMUP,
                      "weight_decay": WEIGHT_DECAY, "betas": list(BETAS), "grad_clip": 1.0,
                      "position_weight": f"{POS_DECAY} ** d, normalised"},
        "train_loss_last_100_steps": round(sum(losses[-100:]) / len(losses[-100:]), 4),
        "metrics": metrics,
        "wall_time_s": {"data": round(t_data, 1), "training": round(t_train, 1),
                        "total": round(time.perf_counter() - t0, 1)},
        "weights": {"file": HEADS_FILE, "bytes": (out / HEADS_FILE).stat().st_size, "dtype": "bfloat16",
                    "target_embed_sha256": drafter.target_embed_sha256},
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "python": platform.python_version()},
    }
    (out / RECORD_FILE).write_text(json.dumps(record, indent=1) + "\n")
    log(f"eval: chain of 8 accepts {metrics['eval']['chain8_accepted']:.2f}, chain of 16 "
        f"{metrics['eval']['chain16_accepted']:.2f} draft tokens per step; wrote {out}")
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specpilot.models.train_heads", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="corpus prompts continued for the data")
    ap.add_argument("--eval-prompts", type=int, default=EVAL_PROMPTS, help="held-out prompts for the evaluation")
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the same count reproduces the weights)")
    ap.add_argument("--target", default=None, help="target checkpoint folder (default: the shipped tiny_stdlib)")
    ap.add_argument("--markov", action="store_true", help="the Markov variant: each row also reads the token above")
    args = ap.parse_args(argv)
    for name in ("steps", "prompts", "eval_prompts", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1")
    train(args.out, steps=args.steps, prompts=args.prompts, eval_prompts=args.eval_prompts, seed=args.seed,
          threads=args.threads, target_dir=args.target, markov=args.markov)
    return 0


if __name__ == "__main__":
    sys.exit(main())
