"""Small trained models shipped with SpecPilot.

`tiny_stdlib`: a 4-layer Qwen3.5-architecture byte-level language model (vocab 256, token id =
byte value; three Gated DeltaNet layers and one gated full-attention layer, about 1M parameters)
trained on the Python standard library's top-level modules. Its weights are stored W12-packed
(lossless BF16). `specpilot.models.train_tiny` trains it, evaluates it and loads it back.

Files in `tiny_stdlib_path()`:

* `CONFIG_FILE`: the Hugging Face `Qwen3_5TextConfig` (model_type "qwen3_5_text"),
* `WEIGHTS_FILE`: the weights, W12-packed (read with `w12.load_file`, decode with `w12.unpack`),
* `HELDOUT_FILE`: held-out text (standard library modules left out of training),
* `TRAIN_FILE`: the training recipe, corpus digest, held-out metrics and the SHA-256 of every
  BF16 tensor.

`tiny_stdlib_heads`: the trained parallel drafter for tiny_stdlib (`specpilot.engine.spec.heads`; the engine's
`drafter="heads"`), trained by `specpilot.models.train_heads`. Files in `tiny_stdlib_heads_path()`: `HEADS_FILE`
(BF16 safetensors) and `TRAIN_FILE` (recipe, data sizes, evaluation on held-out continuations, versions). It
lives outside the checkpoint folder, whose every `*.safetensors` file the engine's loader reads as the model's.
`tiny_stdlib_heads_markov` (`tiny_stdlib_heads_path(markov=True)`): the Markov variant of the same heads (each row
also reads the draft token above it; the engine's `drafter="heads-markov"`), the same two files.
"""

from __future__ import annotations

import pathlib

__all__ = ["tiny_stdlib_path", "tiny_stdlib_heads_path", "TINY_STDLIB", "TINY_STDLIB_HEADS",
           "TINY_STDLIB_HEADS_MARKOV", "CONFIG_FILE",
           "WEIGHTS_FILE", "HELDOUT_FILE", "TRAIN_FILE", "HEADS_FILE"]

TINY_STDLIB = "tiny_stdlib"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.w12.safetensors"
HELDOUT_FILE = "heldout.txt"
TRAIN_FILE = "train.json"
TINY_STDLIB_HEADS = "tiny_stdlib_heads"
TINY_STDLIB_HEADS_MARKOV = "tiny_stdlib_heads_markov"
HEADS_FILE = "heads.safetensors"


def tiny_stdlib_path() -> pathlib.Path:
    """The directory of the shipped tiny_stdlib checkpoint (inside the installed package)."""
    return pathlib.Path(__file__).resolve().parent / TINY_STDLIB


def tiny_stdlib_heads_path(markov: bool = False) -> pathlib.Path:
    """The directory of the shipped drafter heads of tiny_stdlib (inside the installed package); `markov`: of their
    Markov variant."""
    return pathlib.Path(__file__).resolve().parent / (TINY_STDLIB_HEADS_MARKOV if markov else TINY_STDLIB_HEADS)
