"""`specpilot demo`: the shipped tiny model (specpilot.models), packed, verified and decoded three ways.

1. The shipped W12 checkpoint is decoded to BF16 and packed again with `w12.pack_checkpoint`, which
   verifies every tensor bit for bit; the repacked weights must decode to the shipped BF16 exactly.
2. The engine loads the repacked checkpoint and continues a held-out prompt greedily: autoregressively,
   then speculatively with the n-gram drafter, the trained heads (`drafter="heads"`: the shipped
   `specpilot.models.tiny_stdlib_heads`, which recognise the repacked model by its embedding digest) and the
   self-drafter (the W12 8-bit view).
3. It prints the continuation, τ (tokens per verify step), the time per step and the lossless check
   (each speculative output against the autoregressive one, token for token). The table's figures all come
   from `Engine.stats()` over the same steps: ms/step is the mean (total step time / steps), so
   tokens/s = τ / (ms/step) holds row by row.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path

import torch

__all__ = ["run", "table_row", "TABLE_HEADER"]

TABLE_HEADER = (f"{'decoding':>15} | steps | tokens/step (τ) | ms/step | tokens/s | vs autoregressive   (ms/step: the "
                "mean, total / steps; the prefill is not counted)")


def table_row(name: str, st: dict, same: str) -> str:
    """One row of the demo's table from one kind of `Engine.stats()` entry: steps, τ, the mean step time and
    tokens/s, all over the same steps and the same total time."""
    return (f"{name:>15} | {st['steps']:5d} | {st['tau']:15.2f} | {st['mean_step_ms']:7.1f} | "
            f"{st['tokens_per_s']:8.1f} | {same}")


def _repack(src: Path, dst: Path, log) -> None:
    import w12
    from safetensors.torch import save_file
    from w12.checkpoint import pack_checkpoint

    from ..models import CONFIG_FILE, WEIGHTS_FILE

    shipped = w12.load_file(src / WEIGHTS_FILE, layout="planes")  # decoded to BF16 below
    bf16 = {k: (v.unpack() if isinstance(v, w12.W12Weight) else v) for k, v in shipped.items()}
    dst.mkdir(parents=True, exist_ok=True)
    save_file(bf16, str(dst / "bf16.safetensors"))
    t0 = time.perf_counter()
    rep = pack_checkpoint(dst / "bf16.safetensors", dst / WEIGHTS_FILE, progress=False)
    (dst / "bf16.safetensors").unlink()
    again = w12.load_file(dst / WEIGHTS_FILE, layout="planes")
    for k, v in again.items():
        got = v.unpack() if isinstance(v, w12.W12Weight) else v
        if not torch.equal(got.view(torch.int16), bf16[k].view(torch.int16)):
            raise RuntimeError(f"specpilot demo: {k} does not decode to the shipped weights; the pack is broken")
    shutil.copy(src / CONFIG_FILE, dst / CONFIG_FILE)
    log(f"pack     : {len(rep.packed)} tensors to W12 at {8 * rep.packed_bytes / max(rep.num_weights, 1):.2f} bits "
        f"per weight, verified bit for bit, in {time.perf_counter() - t0:.2f} s")


def run(device=None, new_tokens: int = 256, prompt_bytes: int = 400, log=print) -> int:
    from tqdm.auto import tqdm

    from ..models import HELDOUT_FILE, tiny_stdlib_path
    from . import Engine

    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    src = tiny_stdlib_path()
    log(f"model    : {src.name} (Qwen3.5 hybrid: 3 Gated DeltaNet + 1 attention layer, bytes as tokens) on {dev}")
    tmp = Path(tempfile.mkdtemp(prefix="specpilot-demo-"))
    try:
        _repack(src, tmp, log)
        prompt = list((src / HELDOUT_FILE).read_bytes()[:prompt_bytes])
        rows, ref = [], None
        for name, drafter, spec in (("autoregressive", None, False), ("n-gram drafter", "ngram", True),
                                    ("trained heads", "heads", True), ("self-drafter", "self", True)):
            eng = Engine.from_pretrained(tmp, device=dev, weights="w12", drafter=drafter)
            eng.generate(prompt[:8], 2, speculative=spec)  # builds the kernels (and graphs) before timing
            eng.reset_stats()
            with tqdm(total=new_tokens, desc=f"{name:>15}", unit="tok", leave=False) as bar:
                out = eng.generate(prompt, new_tokens, speculative=spec, callback=lambda t: bar.update(len(t)))
            if ref is None:
                ref = out
            same = next((i for i, (a, b) in enumerate(zip(ref, out)) if a != b), None)
            rows.append(table_row(name, eng.stats()["verify" if spec else "ar"],
                                  "identical" if same is None and len(out) == len(ref) else f"differs at {same}"))
        log("prompt   : " + bytes(prompt[-120:]).decode(errors="replace").replace("\n", "\n           "))
        log("output   : " + bytes(ref).decode(errors="replace").replace("\n", "\n           "))
        log("")
        log(TABLE_HEADER)
        log("\n".join(rows))
        ok = all(r.endswith("| identical") for r in rows)
        log(f"lossless : {'every speculative output equals the autoregressive one' if ok else 'DIVERGED'}")
        return 0 if ok else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
