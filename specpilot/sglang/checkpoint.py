"""W12-packed checkpoints (`specpilot pack`, `w12.save_file`) read through SGLang's weight loaders.

An AROUND hook on the safetensors iterators that SGLang's default loader calls
(`sglang.srt.model_loader.loader.safetensors_weights_iterator` and its multi-threaded twin): files
whose metadata holds a W12 index are read with `w12.load_file` (checksums and planes checked) and
every W12 tensor is yielded decoded (`w12.unpack`: the original BF16 bits); other files go to SGLang's
iterator as they are. SGLang's loaders then shard and merge the BF16 tensors as for any checkpoint,
and `--quantization w12` packs each rank's shard again and verifies it. Without `--quantization w12`
the same model runs in BF16. The decode costs load time (a BF16 copy of one file at a time in host
memory); it changes no weight.
"""

from __future__ import annotations

import logging
import os

import w12
from w12.io import _INDEX_KEY, read_metadata

logger = logging.getLogger("specpilot.sglang")

__all__ = ["is_w12_file", "decoded_tensors", "iterator_hook", "TARGETS"]

TARGETS = (
    "sglang.srt.model_loader.loader.safetensors_weights_iterator",
    "sglang.srt.model_loader.loader.buffered_multi_thread_safetensors_weights_iterator",
)


def is_w12_file(path) -> bool:
    try:
        return _INDEX_KEY in read_metadata(os.fspath(path))
    except Exception:
        return False


def decoded_tensors(path):
    """(name, tensor) of a W12 file, W12 weights decoded to BF16, plain tensors as stored."""
    for name, v in w12.load_file(path, layout="planes").items():
        yield name, (w12.unpack(v) if isinstance(v, w12.W12Weight) else v)


def iterator_hook(original, hf_weights_files, *args, **kwargs):
    files = list(hf_weights_files)
    packed = [f for f in files if is_w12_file(f)]
    if not packed:
        return original(files, *args, **kwargs)
    plain = [f for f in files if f not in packed]
    logger.info("specpilot.sglang: reading %d W12 file(s) decoded to BF16: %s", len(packed),
                ", ".join(os.path.basename(f) for f in packed))

    def gen():
        if plain:
            yield from original(plain, *args, **kwargs)
        for f in packed:
            yield from decoded_tensors(f)

    return gen()
