"""Checks of what a caller hands the engine: counts, flags, devices, drafters and token ids.

Each check raises `TypeError` (wrong kind of value) or `ValueError` (wrong value) with one line in the
library's style, `specpilot.engine.<fn>: what is wrong; how to fix`, before any work is done.
"""

from __future__ import annotations

import numbers
from pathlib import Path

import torch

__all__ = ["count", "flag", "device", "drafter", "token_ids", "text_codec", "DRAFTERS"]

DRAFTERS = ("ngram", "self", "heads", "heads-markov")


def count(fn: str, name: str, value, lo: int = 1, hi: int | None = None) -> int:
    """`value` as an int in [lo, hi]. bool is refused: a flag passed by mistake is not read as 0 or 1."""
    span = f">= {lo}" if hi is None else f"in {lo}..{hi}"
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{fn}: {name}={value!r} is a {type(value).__name__}; pass an int {span}")
    value = int(value)
    if value < lo or (hi is not None and value > hi):
        raise ValueError(f"{fn}: {name}={value}; pass an int {span}")
    return value


def flag(fn: str, name: str, value, none_ok: bool = False) -> bool | None:
    if value is None and none_ok:
        return None
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name}={value!r} is a {type(value).__name__}; pass True or False"
                        + (" (or None)" if none_ok else ""))
    return value


def device(fn: str, value) -> torch.device:
    """A usable device: None picks CUDA when present, else the CPU."""
    if value is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(value, (str, torch.device)):
        raise TypeError(f"{fn}: device={value!r} is a {type(value).__name__}; pass 'cpu', 'cuda', 'cuda:N' or None")
    try:
        dev = torch.device(value)
    except (RuntimeError, ValueError):
        raise ValueError(f"{fn}: device={value!r} is not a device name; pass 'cpu', 'cuda', 'cuda:N' or None "
                         "(None: CUDA when present, else the CPU)") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"{fn}: device={value!r}; the engine runs on 'cpu' or 'cuda'")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"{fn}: device={value!r} but this machine has no CUDA device; pass device='cpu' "
                             "(or None: CUDA when present, else the CPU)")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{fn}: device={value!r} but this machine has {torch.cuda.device_count()} CUDA "
                             "device(s); pass an index below that")
    return dev


def drafter(fn: str, value):
    """None, a shipped drafter's name, or an object with `propose(context, positions, k)`."""
    if value is None or (isinstance(value, str) and value in DRAFTERS) or callable(getattr(value, "propose", None)):
        return value
    if isinstance(value, str):
        raise ValueError(f"{fn}: drafter={value!r} is not a shipped drafter; pass one of "
                         f"{', '.join(map(repr, DRAFTERS))}, None (autoregressive only), or an object with "
                         "propose(context, positions, k)")
    raise TypeError(f"{fn}: drafter={value!r} ({type(value).__name__}) has no propose method; pass one of "
                    f"{', '.join(map(repr, DRAFTERS))}, None, or an object with propose(context, positions, k) "
                    "(specpilot.engine.spec.drafters.Drafter)")


def token_ids(fn: str, ids, vocab: int, encode=None, what: str = "the prompt", empty_ok: bool = False) -> list[int]:
    """Token ids as a list of ints in [0, vocab). A str is encoded with `encode` (the model's text codec) when
    there is one; a 1-D integer tensor, a sequence of ints, or bytes are taken as ids."""
    if isinstance(ids, str):
        if encode is None:
            raise TypeError(f"{fn}: {what} is a str but this model has no text codec (no tokenizer files beside its "
                            "config and a vocabulary larger than bytes); pass token ids, e.g. "
                            "transformers.AutoTokenizer.from_pretrained(path)(text).input_ids")
        ids = encode(ids)
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1 or ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
            raise TypeError(f"{fn}: {what} is a {ids.dtype} tensor of shape {tuple(ids.shape)}; pass a 1-D integer "
                            "tensor or a list of token ids")
        ids = ids.tolist()
    elif isinstance(ids, (bytes, bytearray)):
        ids = list(ids)
    else:
        try:
            ids = list(ids)
        except TypeError:
            raise TypeError(f"{fn}: {what} is a {type(ids).__name__}; pass a list of token ids (ints), a 1-D integer "
                            "tensor, or a str for a model with a text codec") from None
        out = []
        for t in ids:
            if isinstance(t, torch.Tensor) and t.dim() == 0 and not (t.dtype.is_floating_point or t.dtype.is_complex
                                                                     or t.dtype == torch.bool):
                t = int(t)
            if isinstance(t, bool) or not isinstance(t, numbers.Integral):
                raise TypeError(f"{fn}: {what} holds {t!r} ({type(t).__name__}); pass token ids as ints")
            out.append(int(t))
        ids = out
    if not ids and not empty_ok:
        raise ValueError(f"{fn}: {what} is empty; pass at least one token id")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{fn}: {what} holds ids outside [0, {vocab}) (e.g. {bad[0]}); pass ids of this model's "
                         "vocabulary")
    return ids


class ByteCodec:
    """Text as UTF-8 bytes, token id = byte value: the shipped byte-level model's vocabulary."""

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        return bytes(int(t) for t in ids).decode("utf-8", errors="replace")


class TokenizerCodec:
    """The checkpoint's own tokenizer (`transformers.AutoTokenizer`), loaded at first use."""

    def __init__(self, path: Path):
        self.path, self._tok = Path(path), None

    def _get(self):
        if self._tok is None:
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(str(self.path))
        return self._tok

    def encode(self, text: str) -> list[int]:
        return list(self._get()(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids) -> str:
        return self._get().decode([int(t) for t in ids])


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def text_codec(vocab: int, path=None):
    """How text becomes token ids for a model: its checkpoint's tokenizer when the folder has tokenizer files;
    bytes when the vocabulary is exactly the 256 byte values (the shipped tiny model); otherwise None (the caller
    passes token ids)."""
    if path is not None and any((Path(path) / f).is_file() for f in _TOKENIZER_FILES):
        return TokenizerCodec(Path(path))
    if vocab == 256:
        return ByteCodec()
    return None
