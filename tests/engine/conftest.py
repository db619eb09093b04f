"""Fixtures of the engine tests: the tiny checkpoints (engine_ckpt.py), one CPU thread."""

import pytest
import torch

pytest.importorskip("transformers")

from engine_ckpt import SHAPES, write_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory):
    """name -> (directory, the transformers model in BF16)."""
    root = tmp_path_factory.mktemp("engine-ckpt")
    return {name: (root / name, write_checkpoint(root / name, seed, **kw)) for name, (seed, kw) in SHAPES.items()}


@pytest.fixture(autouse=True)
def one_thread():
    # BF16 GEMMs of these sizes spin for milliseconds in a second OpenMP thread when the other core is busy
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
