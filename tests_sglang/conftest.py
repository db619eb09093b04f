"""Tests of specpilot.sglang against SGLang 0.5.23's real classes (`make test-sglang`, venv .venv-sglang).

They never skip: without SGLang, collection fails with the command that sets it up. One fixture, once per run,
publishes SGLang's parallel config (ServerArgs on a tiny Qwen3.5 checkpoint, `--quantization w12`) and
starts a gloo group of world size 1, as SGLang's scheduler does; the two-process tests spawn their own
gloo groups and need only torch and this package.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import types
from pathlib import Path

import pytest

try:
    import sglang  # noqa: F401
except ImportError as e:  # fail loudly: these tests are the SGLang integration's CI
    raise RuntimeError("tests_sglang need SGLang 0.5.23 installed; run them with `make test-sglang`, which builds "
                       ".venv-sglang with it") from e

from tests_sglang.tp_workers import free_port

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "specpilot" / "models" / "tiny_stdlib"


def stub_vllm_rope() -> None:
    """SGLang's RotaryEmbedding imports `vllm._custom_ops.rotary_embedding` at construction on a machine that is
    neither CUDA nor SGLang's CPU engine (which needs the CPU build of sgl-kernel, not on the package index); the
    kernel is used only in forward, which these tests do not run through it. A stand-in module lets the real model
    class be built; it is installed only when vllm is absent."""
    try:
        import vllm._custom_ops  # noqa: F401
    except ImportError:
        vllm = types.ModuleType("vllm")
        ops = types.ModuleType("vllm._custom_ops")
        ops.rotary_embedding = None
        vllm._custom_ops = ops
        sys.modules.setdefault("vllm", vllm)
        sys.modules.setdefault("vllm._custom_ops", ops)


def tiny_model_dir(dest: Path) -> Path:
    """The shipped tiny Qwen3.5 (W12-packed) with the one config key SGLang's Qwen3.5 reads that transformers
    does not write: `full_attention_interval` (layers 0-2 linear attention, layer 3 full attention)."""
    dest.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((TINY / "config.json").read_text())
    cfg["full_attention_interval"] = 4
    assert [("full_attention" if (i + 1) % 4 == 0 else "linear_attention") for i in range(4)] == cfg["layer_types"]
    (dest / "config.json").write_text(json.dumps(cfg, indent=1))
    shutil.copy(TINY / "model.w12.safetensors", dest / "model.w12.safetensors")
    return dest


def stub_web_stack() -> None:
    """SGLang's `model_runner` module, which the hybrid GDN backend imports (for type annotations), imports its HTTP
    server stack (uvicorn, fastapi), which the test environment leaves out. Stand-in modules, whose every attribute
    is an empty class, let it import; they are installed only for modules that are absent, and nothing of the
    server runs in these tests."""
    for name in ("uvicorn", "fastapi", "fastapi.responses"):
        try:
            __import__(name)
        except ImportError:
            mod = types.ModuleType(name)
            mod.__path__ = []

            def attr(key, _name=name):
                if key.startswith("__"):
                    raise AttributeError(key)
                cls = type(key, (), {"__init__": lambda self, *a, **k: None})
                setattr(sys.modules[_name], key, cls)
                return cls

            mod.__getattr__ = attr
            sys.modules[name] = mod


@pytest.fixture(scope="session")
def sglang_tp1(tmp_path_factory):
    """SGLang's runtime context for one tensor-parallel rank on the CPU, with the plugin registered."""
    os.environ.setdefault("SPECPILOT_SGLANG_HEAD", "1")
    os.environ.setdefault("SPECPILOT_SGLANG_TREE_ATTN", "1")
    os.environ.setdefault("SPECPILOT_SGLANG_GDN", "1")
    stub_vllm_rope()
    stub_web_stack()
    from specpilot.sglang.plugin import register

    status = register()
    assert all(v == "ok" for v in status.values()), status

    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import SpawnRanks, publish
    from sglang.srt.server_args import ServerArgs

    model_dir = tiny_model_dir(tmp_path_factory.mktemp("tiny_qwen35"))
    sa = ServerArgs(model_path=str(model_dir), device="cpu", tp_size=1, skip_tokenizer_init=True,
                    disable_radix_cache=True, quantization="w12", dtype="bfloat16")
    publish(sa, role="scheduler", ranks=SpawnRanks(world_rank=0, gpu_id=None))
    init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                                 local_rank=0, backend="gloo")
    initialize_model_parallel()
    return types.SimpleNamespace(server_args=sa, model_dir=model_dir, status=status)
