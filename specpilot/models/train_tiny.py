"""Train, evaluate and load the tiny_stdlib model (a byte-level Qwen3.5-architecture model).

    python -m specpilot.models.train_tiny --out DIR [--steps N] [--seed S]

Corpus: the `*.py` files directly under the standard library directory (`os.path.dirname(os.__file__)`;
no subpackages), sorted by name. The modules in `HELDOUT_MODULES` are left out of training; their
text, concatenated in that order and cut at the last newline within `HELDOUT_CAP` bytes, is written
to `heldout.txt`, so evaluation does not depend on the Python version of the machine that runs it.
The training text is the other files' bytes, concatenated in name order.

Training: fp32 on the CPU, random windows of `SEQ_LEN + 1` bytes drawn with a generator seeded by
`--seed` (the same seed initialises the model through `torch.manual_seed`), AdamW with linear
warmup and a cosine decay to `MIN_LR_FRAC` of the peak rate. One thread by default: the run is
then deterministic given the seed and the Python version (the corpus).

Output (DIR): `config.json`, `model.w12.safetensors` (the BF16 weights packed by
`w12.checkpoint.pack_checkpoint`; the BF16 file it is packed from is written to a temporary
directory and removed), `heldout.txt` and `train.json` (recipe, corpus digest, metrics, the SHA-256
of every BF16 tensor). The recorded held-out metric is `heldout_loss` of the W12 checkpoint loaded
back (`load_state_dict` then `build_model`), not of the fp32 training weights.

`heldout_loss` is the one evaluation recipe: the script records it and tests/test_tiny_model.py
recomputes it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import pathlib
import platform
import sys
import tempfile
import time

import torch
import torch.nn.functional as F

from . import CONFIG_FILE, HELDOUT_FILE, TRAIN_FILE, WEIGHTS_FILE, tiny_stdlib_path

__all__ = ["DEFAULT_SEED", "HELDOUT_MODULES", "EVAL_CTX", "EVAL_MAX_BYTES", "make_config", "corpus_files",
           "heldout_loss", "unigram_loss", "load_state_dict", "build_model", "tensor_sha256", "cosine_lr", "adamw",
           "train", "main"]

DEFAULT_SEED = 0
DEFAULT_STEPS = 500
BATCH = 16
SEQ_LEN = 256
LR = 3e-3
MIN_LR_FRAC = 0.1
WARMUP = 30
WEIGHT_DECAY = 0.1
BETAS = (0.9, 0.95)
GRAD_CLIP = 1.0

HELDOUT_MODULES = ("bisect.py", "colorsys.py", "heapq.py", "keyword.py", "textwrap.py")
HELDOUT_CAP = 32 * 1024
EVAL_CTX = 512
EVAL_MAX_BYTES = 8192
ATTN_IMPLEMENTATION = "sdpa"


def _transformers():
    try:
        import transformers
    except ImportError as e:
        raise ImportError("specpilot.models.train_tiny: needs transformers (Qwen3_5ForCausalLM); "
                          "install the test extra: pip install -e '.[test]'") from e
    return transformers


def make_config():
    """The tiny_stdlib architecture: a byte-level `Qwen3_5TextConfig` of about 1M parameters."""
    cfg = _transformers().Qwen3_5TextConfig(
        vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32, linear_value_head_dim=32,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    cfg.architectures = ["Qwen3_5ForCausalLM"]
    cfg.dtype = "bfloat16"  # the weights as stored
    return cfg


def corpus_files(stdlib_dir=None) -> tuple[pathlib.Path, list[pathlib.Path], list[pathlib.Path]]:
    """(stdlib directory, training files sorted by name, held-out files in `HELDOUT_MODULES` order)."""
    root = pathlib.Path(stdlib_dir or os.path.dirname(os.__file__))
    files = sorted((p for p in root.glob("*.py") if p.is_file()), key=lambda p: p.name)
    held = [root / n for n in HELDOUT_MODULES if (root / n).is_file()]
    if not files or not held:
        raise FileNotFoundError(f"specpilot.models.train_tiny.corpus_files: no standard library modules in {root} "
                                f"(or none of {HELDOUT_MODULES}); pass the directory that holds os.py")
    held_names = {p.name for p in held}
    return root, [p for p in files if p.name not in held_names], held


def heldout_text(held: list[pathlib.Path]) -> bytes:
    """The held-out modules' bytes concatenated, cut at the last newline within `HELDOUT_CAP` bytes."""
    data = b"".join(p.read_bytes() for p in held)
    if len(data) > HELDOUT_CAP:
        data = data[: data.rfind(b"\n", 0, HELDOUT_CAP) + 1]
    return data


def _byte_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def _eval_windows(data: bytes | str, ctx: int, max_bytes: int) -> torch.Tensor:
    if isinstance(data, str):
        data = data.encode("utf-8")
    data = bytes(data[:max_bytes])
    n = len(data) // ctx
    if ctx < 2 or n == 0:
        raise ValueError(f"specpilot.models.train_tiny.heldout_loss: {len(data)} bytes give no full window of "
                         f"ctx={ctx} (ctx must be >= 2); pass more text or a smaller ctx")
    return _byte_tensor(data[: n * ctx]).view(n, ctx)


@torch.no_grad()
def heldout_loss(model, data: bytes | str, ctx: int = EVAL_CTX, max_bytes: int = EVAL_MAX_BYTES) -> float:
    """Mean next-byte cross-entropy (nats per byte) of `model` on the first `max_bytes` bytes of
    `data`, split into consecutive non-overlapping windows of `ctx` bytes (a trailing partial
    window is dropped); each window predicts its bytes 1..ctx-1 from the ones before, with no
    context carried across windows. `model` must be float32 on the CPU; it is run in eval mode,
    all windows in one batch."""
    p = next(model.parameters())
    if p.dtype != torch.float32 or p.device.type != "cpu":
        raise ValueError(f"specpilot.models.train_tiny.heldout_loss: the recipe runs a float32 model on the CPU, "
                         f"got {p.dtype} on {p.device}; pass model.float().cpu()")
    x = _eval_windows(data, ctx, max_bytes)
    was_training = model.training
    model.eval()
    try:
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
    finally:
        model.train(was_training)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), x[:, 1:].reshape(-1), reduction="sum")
    return float(loss.double() / x[:, 1:].numel())


def unigram_loss(train_data: bytes, data: bytes | str, ctx: int = EVAL_CTX, max_bytes: int = EVAL_MAX_BYTES) -> float:
    """The baseline for `heldout_loss`: cross-entropy (nats per byte) of the training text's byte
    frequencies (add-one smoothed) on the same predicted positions."""
    counts = torch.bincount(_byte_tensor(train_data), minlength=256).double() + 1.0
    logp = (counts / counts.sum()).log()
    y = _eval_windows(data, ctx, max_bytes)[:, 1:].reshape(-1)
    return float(-logp[y].mean())


def tensor_sha256(t: torch.Tensor) -> str:
    """SHA-256 of a tensor's raw bytes."""
    return hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def load_state_dict(ckpt_dir=None) -> dict[str, torch.Tensor]:
    """The checkpoint's weights as a BF16 state dict (Hugging Face names of `Qwen3_5ForCausalLM`):
    every W12 entry of `WEIGHTS_FILE` decoded exactly with `w12.unpack`, every other entry as stored.
    `ckpt_dir` defaults to the shipped tiny_stdlib."""
    import w12

    path = pathlib.Path(ckpt_dir or tiny_stdlib_path()) / WEIGHTS_FILE
    entries = w12.load_file(path, layout="planes")  # the planes: each W12 entry is decoded here, not tiled
    return {k: (w12.unpack(v) if isinstance(v, w12.W12Weight) else v) for k, v in entries.items()}


def build_model(ckpt_dir=None, dtype: torch.dtype = torch.float32):
    """`Qwen3_5ForCausalLM` from the checkpoint's config.json with its weights loaded strictly
    (no missing or unexpected keys), cast to `dtype`, on the CPU, in eval mode."""
    tf = _transformers()
    ckpt_dir = pathlib.Path(ckpt_dir or tiny_stdlib_path())
    cfg = tf.Qwen3_5TextConfig.from_pretrained(ckpt_dir)
    cfg._attn_implementation = ATTN_IMPLEMENTATION
    model = tf.Qwen3_5ForCausalLM(cfg).to(dtype)
    model.load_state_dict(load_state_dict(ckpt_dir), strict=True)
    return model.eval()


def cosine_lr(step: int, steps: int, lr: float, warmup: int, min_frac: float) -> float:
    """Linear warmup over `warmup` steps, then cosine decay from `lr` to `lr * min_frac` at `steps`."""
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (min_frac + (1 - min_frac) * 0.5 * (1 + math.cos(math.pi * t)))


def adamw(module: torch.nn.Module, lr: float, weight_decay: float, betas: tuple[float, float]) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices (2-D and up) and none on vectors and scalars."""
    params = list(module.parameters())
    return torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}], lr=lr, betas=betas)


def train(out, steps: int = DEFAULT_STEPS, seed: int = DEFAULT_SEED, threads: int = 1, log_every: int = 20) -> dict:
    """Train the model, write the checkpoint to `out` and return the record written to train.json."""
    from safetensors.torch import save_file

    from w12.checkpoint import pack_checkpoint

    tf = _transformers()
    torch.set_num_threads(threads)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()

    root, train_paths, held_paths = corpus_files()
    train_data = b"".join(p.read_bytes() for p in train_paths)
    held = heldout_text(held_paths)
    (out / HELDOUT_FILE).write_bytes(held)
    data = _byte_tensor(train_data)
    print(f"corpus: {len(train_paths)} files, {len(train_data)} bytes from {root}; held out "
          f"{[p.name for p in held_paths]}: {len(held)} bytes", flush=True)

    torch.manual_seed(seed)
    cfg = make_config()
    cfg._attn_implementation = ATTN_IMPLEMENTATION
    model = tf.Qwen3_5ForCausalLM(cfg).float()
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params}", flush=True)

    opt = adamw(model, LR, WEIGHT_DECAY, BETAS)
    gen = torch.Generator().manual_seed(seed)
    offsets = torch.arange(SEQ_LEN + 1)
    model.train()
    t_train = time.perf_counter()
    losses = []
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = cosine_lr(step, steps, LR, WARMUP, MIN_LR_FRAC)
        starts = torch.randint(0, data.numel() - SEQ_LEN - 1, (BATCH,), generator=gen)
        x = data[starts[:, None] + offsets]
        logits = model(input_ids=x[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        losses.append(float(loss.detach()))
        if (step + 1) % log_every == 0 or step + 1 == steps:
            el = time.perf_counter() - t_train
            print(f"step {step + 1}/{steps}  loss {sum(losses[-log_every:]) / len(losses[-log_every:]):.4f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  {el:.0f}s  ({el / (step + 1):.2f}s/step)", flush=True)
    train_seconds = time.perf_counter() - t_train

    fp32_loss = heldout_loss(model, held)
    state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    cfg.save_pretrained(out)
    with tempfile.TemporaryDirectory() as tmp:
        bf16_path = pathlib.Path(tmp) / "model.safetensors"
        save_file(state, bf16_path, metadata={"format": "pt"})
        report = pack_checkpoint(bf16_path, out / WEIGHTS_FILE, progress=False)
    print(report, flush=True)

    shipped = build_model(out)
    loaded = load_state_dict(out)
    if set(loaded) != set(state) or any(not torch.equal(loaded[k].view(torch.int16), state[k].view(torch.int16))
                                        for k in state):
        raise RuntimeError("specpilot.models.train_tiny.train: the W12 checkpoint does not decode to the BF16 "
                           "weights it was packed from; this is a w12 bug, report it")
    loss = heldout_loss(shipped, held)
    uni = unigram_loss(train_data, held)
    record = {
        "seed": seed, "steps": steps, "batch": BATCH, "seq_len": SEQ_LEN,
        "optimizer": {"name": "AdamW", "lr": LR, "min_lr": LR * MIN_LR_FRAC, "schedule": "linear warmup, cosine decay",
                      "warmup_steps": WARMUP, "weight_decay": WEIGHT_DECAY, "weight_decay_applies_to": "parameters of 2 or more dimensions",
                      "betas": list(BETAS), "grad_clip": GRAD_CLIP},
        "precision": "float32 training on the CPU; weights stored as BF16, W12-packed",
        "threads": threads,
        "parameters": n_params,
        "wall_time_s": {"training": round(train_seconds, 1), "total": round(time.perf_counter() - t_start, 1)},
        "train_loss_last_20_steps": round(sum(losses[-20:]) / len(losses[-20:]), 4),
        "corpus": {"source": "*.py directly under the standard library directory, sorted by name",
                   "python": platform.python_version(), "files": [p.name for p in train_paths],
                   "bytes": len(train_data), "sha256": hashlib.sha256(train_data).hexdigest()},
        "heldout": {"files": [p.name for p in held_paths], "file": HELDOUT_FILE, "bytes": len(held),
                    "cap_bytes": HELDOUT_CAP, "sha256": hashlib.sha256(held).hexdigest()},
        "eval": {"recipe": "specpilot.models.train_tiny.heldout_loss", "ctx": EVAL_CTX, "max_bytes": EVAL_MAX_BYTES,
                 "predicted_positions": int(_eval_windows(held, EVAL_CTX, EVAL_MAX_BYTES)[:, 1:].numel()),
                 "model": "W12 checkpoint decoded to BF16, loaded into a float32 Qwen3_5ForCausalLM",
                 "attn_implementation": ATTN_IMPLEMENTATION},
        "metrics": {"heldout_loss_nats_per_byte": loss, "heldout_perplexity": math.exp(loss),
                    "heldout_bits_per_byte": loss / math.log(2),
                    "unigram_loss_nats_per_byte": uni, "unigram_perplexity": math.exp(uni),
                    "fp32_training_weights_loss_nats_per_byte": fp32_loss},
        "weights": {"file": WEIGHTS_FILE, "bytes": (out / WEIGHTS_FILE).stat().st_size,
                    "tensors_packed": len(report.packed), "tensors_stored_bf16": len(report.copied),
                    "bf16_sha256": {k: tensor_sha256(state[k]) for k in sorted(state)}},
        "versions": {"torch": torch.__version__, "transformers": tf.__version__},
    }
    (out / TRAIN_FILE).write_text(json.dumps(record, indent=1) + "\n")
    print(f"held-out loss {loss:.4f} nats/byte (perplexity {math.exp(loss):.3f}); unigram {uni:.4f}; "
          f"fp32 weights {fp32_loss:.4f}; wrote {out}", flush=True)
    return record


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m specpilot.models.train_tiny", description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS)
    ap.add_argument("--seed", type=int, default=DEFAULT_SEED)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 gives a deterministic run)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    train(args.out, steps=args.steps, seed=args.seed, threads=args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
