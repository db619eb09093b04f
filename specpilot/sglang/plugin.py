"""The SGLang plugin entry point: `register()`, loaded by SGLang from the `sglang.srt.plugins`
entry-point group (name `specpilot`; `SGLANG_PLUGINS=specpilot` selects it among others).

One switch per feature (environment variables, read when the plugin loads; `1` on, `0` off):

| variable                     | default | what it registers |
| ---------------------------- | ------- | ----------------- |
| `SPECPILOT_SGLANG_W12`       | 1 | the `w12` quantization method (`--quantization w12`) |
| `SPECPILOT_SGLANG_W12_CKPT`  | 1 | reading W12-packed safetensors files through SGLang's loader |
| `SPECPILOT_SGLANG_HEAD`      | 0 | the certified greedy head on the argmax-only path (changes near-tie answers from the BF16-rounded head's to the exact head's, so it is opt-in) |
| `SPECPILOT_SGLANG_TREE_ATTN` | 0 | `--attention-backend specpilot_tree`: tree_attn on target verify (tree_backend.py) |
| `SPECPILOT_SGLANG_GDN`       | 0 | gdn.tree_verify and gdn.commit in SGLang's hybrid GDN backend, no per-token snapshots (gdn_verify.py) |
| `SPECPILOT_SGLANG_W12_EXCLUDE` | (none) | comma-separated fnmatch patterns of linear-layer prefixes that `w12` keeps in BF16 |

SGLang only logs a plugin's exceptions, so `register()` checks itself: every enabled feature is
registered, then exercised on tiny CPU tensors (W12 pack, unpack bit for bit and matmul against
F.linear; the certified head against torch.argmax; the tree backend's mask conversion and tree_attn
against its fp64 reference; the GDN verify and commit against the fp64 recurrence), and the outcome is logged at
WARNING (all passed) or ERROR (what failed) under the logger `specpilot.sglang`, and kept in `STATUS`.
"""

from __future__ import annotations

import logging
import os

logger = logging.getLogger("specpilot.sglang")

__all__ = ["register", "STATUS", "SWITCHES", "switch"]

SWITCHES = {"SPECPILOT_SGLANG_W12": True, "SPECPILOT_SGLANG_W12_CKPT": True, "SPECPILOT_SGLANG_HEAD": False,
            "SPECPILOT_SGLANG_TREE_ATTN": False, "SPECPILOT_SGLANG_GDN": False}
STATUS: dict[str, str] = {}  # feature -> "ok", "off", or "failed: <reason>"


def switch(name: str) -> bool:
    raw = os.environ.get(name)
    if raw is None or raw.strip() == "":
        return SWITCHES[name]
    v = raw.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"specpilot.sglang: {name}={raw!r}; set it to 1 or 0")


def _register_w12() -> None:
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers import quantization as q

    from .quant import NAME, W12Config

    q.QUANTIZATION_METHODS[NAME] = W12Config
    q.CPU_QUANTIZATION_METHODS[NAME] = W12Config  # consulted instead on CPUs with AMX
    if NAME not in choices.QUANTIZATION_CHOICES:
        choices.add_quantization_method_choices([NAME])


def _check_w12() -> None:
    import torch

    import w12
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS, get_quantization_config

    from .quant import W12Config, pack_verified

    if QUANTIZATION_METHODS.get("w12") is not W12Config or "w12" not in choices.QUANTIZATION_CHOICES:
        raise RuntimeError("w12 is not in QUANTIZATION_METHODS / the --quantization choices")
    if get_quantization_config("w12") is not W12Config:
        raise RuntimeError("get_quantization_config('w12') does not return W12Config")
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(24, 96, generator=g) * 0.05).to(torch.bfloat16)
    x = torch.randn(3, 96, generator=g).to(torch.bfloat16)
    p = pack_verified(w, "self-check weight")
    want = torch.nn.functional.linear(x.float(), w.float()).to(torch.bfloat16)
    got = w12.matmul(x, p)
    if not torch.equal(got, want):
        raise RuntimeError("w12.matmul on the CPU differs from F.linear over the unpacked weight")


def _register_hooks(targets, hooks) -> None:
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in zip(targets, hooks):
        if not any(h is hook for _, h, _ in HookRegistry._hooks.get(target, [])):
            HookRegistry.register(target, hook, HookType.AROUND)
    HookRegistry.apply_hooks()  # idempotent; load_plugins() calls it again after every plugin
    missing = [t for t in targets if t not in HookRegistry._patched]
    if missing:
        raise RuntimeError(f"hooks not applied to {missing}")


def _register_ckpt() -> None:
    from . import checkpoint

    _register_hooks(checkpoint.TARGETS, (checkpoint.iterator_hook,) * len(checkpoint.TARGETS))


def _register_head() -> None:
    from . import greedy_head

    _register_hooks(greedy_head.TARGETS, (greedy_head.forward_hook, greedy_head.compute_lm_head_hook,
                                          greedy_head.weights_loaded_hook))


def _check_head() -> None:
    import torch

    from .head import ShardedCertifiedHead

    g = torch.Generator().manual_seed(1)
    W = (torch.randn(50, 64, generator=g) * 0.1).to(torch.bfloat16)
    h = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    ids = ShardedCertifiedHead(W).argmax(h)
    want = (h.float() @ W.float().T).argmax(-1)
    if not torch.equal(ids, want):
        raise RuntimeError(f"certified argmax {ids.tolist()} != torch.argmax {want.tolist()}")


def _register_tree_attn() -> None:
    from sglang.srt.arg_groups import choices
    from sglang.srt.layers.attention.attention_registry import register_attention_backend

    from .tree_backend import NAME, create_backend

    register_attention_backend(NAME)(create_backend)
    if NAME not in choices.ATTENTION_BACKEND_CHOICES:
        choices.add_attention_backend_choices([NAME])


def _check_tree_attn() -> None:
    import torch

    import tree_attn
    from sglang.srt.arg_groups.choices import ATTENTION_BACKEND_CHOICES
    from sglang.srt.layers.attention.attention_registry import ATTENTION_BACKENDS

    from .tree_backend import FULL_MASK, NAME, ancestor_bits, check_tree, create_backend

    if ATTENTION_BACKENDS.get(NAME) is not create_backend or NAME not in ATTENTION_BACKEND_CHOICES:
        raise RuntimeError(f"{NAME} is not in ATTENTION_BACKENDS / the --attention-backend choices")
    # one request, prefix 5, the tree 0 -> {1, 2}, 1 -> 3, in SGLang's FULL_MASK layout [n, prefix + n]
    parents, n, L = (-1, 0, 0, 1), 4, 5
    full = torch.ones(n, L + n, dtype=torch.bool)
    full[:, L:] = False
    for i in range(n):
        a = i
        while a >= 0:
            full[i, L + a] = True
            a = parents[a]
    bits = ancestor_bits(full.reshape(-1), torch.tensor([L]), n, FULL_MASK)
    check_tree(bits, 1, n)
    if bits.tolist() != [0b1, 0b11, 0b101, 0b1011]:
        raise RuntimeError(f"mask conversion gave {bits.tolist()}, not the tree's ancestor bits")
    g = torch.Generator().manual_seed(2)
    kc, vc = (torch.randn(8, 1, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    q = torch.randn(n, 2, 64, generator=g).to(torch.bfloat16)
    kn, vn = (torch.randn(n, 1, 64, generator=g).to(torch.bfloat16) for _ in range(2))
    i32 = {"dtype": torch.int32}
    args = (torch.tensor([0, L], **i32), torch.arange(L, **i32), torch.tensor([0, n], **i32), bits)
    got = tree_attn.tree_attention(q, kc, vc, *args, k_new=kn, v_new=vn)
    want, _ = tree_attn.tree_attention_reference(q, kc, vc, *args, k_new=kn, v_new=vn, dtype=torch.float64)
    if not torch.allclose(got.double(), want, atol=2e-2, rtol=0):
        raise RuntimeError("tree_attn on the CPU differs from its fp64 reference on the self-check tree")


def _register_gdn() -> None:
    from . import gdn_verify

    _register_hooks(gdn_verify.TARGETS, (gdn_verify.init_hook, gdn_verify.verify_hook, gdn_verify.commit_hook))


def _check_gdn() -> None:
    """A 4-token tree 0 -> {1, 2}, 1 -> 3 in SGLang's first-child / next-sibling links, two layers, one request:
    the verify outputs and the committed SSM and conv states along the path 0 -> 1 -> 3 against the fp64
    recurrence (gdn.recurrent_reference) and the conv window."""
    import torch

    import gdn

    from .gdn_verify import GDNStep, commit_step, gates, tree_parents, verify_layer

    nt, ns = torch.tensor([[1, 3, -1, -1]]), torch.tensor([[-1, 2, -1, -1]])
    parents = tree_parents(nt, ns, 1, 4)
    if parents != [[-1, 0, 0, 1]]:
        raise RuntimeError(f"tree links gave parents {parents}, not [[-1, 0, 0, 1]]")
    H, HV, K, W, L, T = 1, 2, 16, 4, 2, 4
    D = 2 * H * K + HV * K
    g = torch.Generator().manual_seed(3)
    temporal = torch.randn(L, 3, HV, K, K, generator=g) * 0.1
    conv = torch.randn(L, 3, D, W - 1, generator=g)
    t0, c0 = temporal.clone(), conv.clone()
    rows = torch.tensor([2])
    step = GDNStep(meta=None, plan=gdn.build_tree_plan(parents), parents=parents, rows=rows)
    ws = [(torch.randn(D, W, generator=g) * 0.3, torch.randn(T, D, generator=g), torch.randn(T, HV, generator=g),
           torch.randn(T, HV, generator=g), torch.randn(HV, generator=g) * 0.1, torch.randn(HV, generator=g) * 0.1)
          for _ in range(L)]
    for i, (w, x, a, b, A_log, dt) in enumerate(ws):
        o = verify_layer(step, i, x, a, b, w, None, "silu", A_log, dt, conv[i], temporal[i], (H, H, HV, K, K))
        xc = gdn.conv_reference(x, conv[i], w, parents, None, "silu", [2], dtype=torch.float64)
        q, k, v = torch.split(xc, [H * K, H * K, HV * K], -1)
        gg, bb = gates(A_log, dt, a, b)
        want, S = gdn.recurrent_reference(q.reshape(T, H, K), k.reshape(T, H, K), v.reshape(T, HV, K), gg, bb,
                                          t0[i, 2].transpose(-1, -2), parents=parents[0], use_qk_l2norm=True,
                                          return_states=True, dtype=torch.float64)
        if not torch.allclose(o[0].double(), want, atol=1e-4, rtol=1e-4):
            raise RuntimeError(f"gdn verify of layer {i} differs from the fp64 recurrence")
        if not torch.equal(temporal[i], t0[i]) or not torch.equal(conv[i], c0[i]):
            raise RuntimeError("gdn verify wrote the committed state")
        ws[i] = S[3]  # the state after the accepted path 0 -> 1 -> 3
    commit_step(step, torch.tensor([3]), temporal, conv)
    for i in range(L):
        if not torch.allclose(temporal[i, 2].transpose(-1, -2).double(), ws[i], atol=1e-4, rtol=1e-4):
            raise RuntimeError(f"gdn.commit's SSM state of layer {i} differs from the fp64 recurrence")
        x = step.layers[i][0]
        if not torch.equal(conv[i, 2], torch.cat([c0[i, 2], x[[0, 1, 3]].T], 1)[:, -(W - 1):]):
            raise RuntimeError(f"gdn.commit's conv state of layer {i} is not the window of the accepted path")
        if not torch.equal(temporal[i, :2], t0[i, :2]):
            raise RuntimeError("gdn.commit wrote a row it was not given")


_FEATURES = (
    ("w12", "SPECPILOT_SGLANG_W12", _register_w12, _check_w12),
    ("w12_checkpoint", "SPECPILOT_SGLANG_W12_CKPT", _register_ckpt, None),
    ("certified_head", "SPECPILOT_SGLANG_HEAD", _register_head, _check_head),
    ("tree_attn", "SPECPILOT_SGLANG_TREE_ATTN", _register_tree_attn, _check_tree_attn),
    ("gdn", "SPECPILOT_SGLANG_GDN", _register_gdn, _check_gdn),
)


def register() -> dict[str, str]:
    """Register every enabled feature with SGLang, check it, log the outcome; returns `STATUS`."""
    for feature, env, reg, check in _FEATURES:
        try:
            if not switch(env):
                STATUS[feature] = "off"
                continue
            reg()
            if check is not None:
                check()
            STATUS[feature] = "ok"
        except Exception as e:  # SGLang would only log it: say it loudly and keep the other features
            STATUS[feature] = f"failed: {type(e).__name__}: {e}"
            logger.exception("specpilot.sglang: %s FAILED its registration or self-check", feature)
    line = ", ".join(f"{k}={v}" for k, v in STATUS.items())
    if any(v.startswith("failed") for v in STATUS.values()):
        logger.error("specpilot.sglang plugin: SELF-CHECK FAILED: %s", line)
    else:
        logger.warning("specpilot.sglang plugin: self-check passed: %s", line)
    return dict(STATUS)
