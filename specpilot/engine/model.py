"""The Qwen3.5 hybrid forward pass on this library's operators, over token trees.

Every forward pass is a batch of token trees (`gdn.TreePlan`): prefill chunks are chains, an
autoregressive step is a one-node tree, a verify step is the pending token with the draft tree below
it. One plan serves every layer: `gdn.tree_conv1d` and `gdn.tree_verify` in the Gated DeltaNet layers,
`tree_attn.run` (its mask is the plan's `anc`) in the attention layers. Nothing is written to the
caches during the pass; `commit` then advances the recurrent and conv states along the accepted path
(`gdn.commit`) and copies the accepted nodes' keys and values into the request's next KV slots
(compaction), so rejected nodes leave no trace.

Numerics follow `transformers`' Qwen3.5 in BF16: RMSNorm in fp32 scaled by (1 + w), residual adds in
BF16, the decay g in fp32, queries and keys L2-normalised inside the GDN kernels; the head is
`lmhead.CertifiedHead` (fp32 logits, exact argmax).

Caches: request row r owns GDN state row r, conv state row r and the KV slots
[r * max_len, (r + 1) * max_len); the last slot of the KV cache is a scratch slot that absorbs the
masked writes of a fixed-size commit.

Shapes the fast kernels do not take run on the operator's reference or the torch glue instead, decided once
per model (`Paths.decide`) and announced by one `KernelFallbackWarning`.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

import gdn
import lmhead
import tree_attn
import w12

from .loader import HybridConfig

__all__ = ["Kernels", "Paths", "KernelFallbackWarning", "Linear", "HybridModel", "Step", "MAX_STEP_NODES"]

MAX_STEP_NODES = 64  # nodes per request in one pass: one int64 ancestor mask per node (gdn, tree_attn)


@dataclass(frozen=True)
class Kernels:
    """The `variant=` passed to each operator; None lets the operator choose for the device."""

    w12: str | None = None
    gdn: str | None = None
    conv: str | None = None
    commit: str | None = None
    attn: str | None = None
    head: str | None = None

    @classmethod
    def choose(cls, device: torch.device, mode: str = "auto") -> "Kernels":
        """"auto": the operators' own choice on a GPU, their torch references on the CPU (the Triton
        interpreter runs kernels, not models); "reference": the torch references everywhere; "kernels":
        the operators' own choice everywhere (on the CPU: the Triton kernels under the interpreter)."""
        if mode not in ("auto", "reference", "kernels"):
            raise ValueError(f"specpilot.engine.Kernels.choose: kernels={mode!r}; pass 'auto', 'reference' or "
                             "'kernels'")
        if mode == "reference" or (mode == "auto" and device.type != "cuda"):
            return cls("torch", "reference", "reference", "reference", "reference", "reference")
        return cls()


class KernelFallbackWarning(UserWarning):
    """A layer kind of the model runs an operator's reference or the torch glue where a kernel would have run:
    the kernels do not take the model's shapes. Same tokens, slower steps. Raised once, when the model is built."""


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class Paths:
    """The path each layer kind of a model takes, decided once when the model is built (`decide`): the operator
    variants, whether the fused glue's attention prologue runs, and, for every part moved off a kernel that would
    otherwise have run, what moved and why (the text of the `KernelFallbackWarning`)."""

    kernels: Kernels
    fused_attn_prep: bool
    fallbacks: tuple[str, ...] = ()

    @classmethod
    def decide(cls, cfg: HybridConfig, kernels: Kernels, device, fused_glue: bool) -> "Paths":
        # Gated DeltaNet has nothing to decide here: gdn's automatic choice moves a call its CUDA kernel cannot
        # take (K not a multiple of 32 or above 256, more than 32 nodes) to the Triton WY kernel, and the Triton
        # kernels (WY, conv, commit) mask K, V and D to any size. Nodes neither: a pass holds MAX_STEP_NODES
        # nodes per request, the tree_attn and gdn kernels' own bound (one int64 ancestor mask per node).
        device = torch.device(device)
        fallbacks = []
        if cfg.attn_layers and kernels.attn != "reference":
            why = tree_attn.unsupported(head_dim=cfg.head_dim)
            if why is not None:
                # the reference by name: an automatic choice of an unsupported head_dim raises, on CPU tensors too
                if tree_attn.VARIANTS.pick(kernels.attn, device) != tree_attn.VARIANTS.fallback:
                    fallbacks.append(f"the full-attention layers run tree_attn's torch reference, not its kernels: "
                                     f"{why}")
                kernels = replace(kernels, attn="reference")
        fused_prep = bool(fused_glue)
        if fused_prep and cfg.attn_layers and not _pow2(cfg.head_dim):
            fused_prep = False
            fallbacks.append(f"the attention prologue (per-head norm and rotary) runs the torch glue, not the fused "
                             f"kernel: head_dim {cfg.head_dim} is not a power of two (the kernel holds one head in "
                             "one tl.arange)")
        return cls(kernels, fused_prep, tuple(fallbacks))

    @property
    def host_syncs(self) -> str | None:
        """Why a step of this model cannot be captured as a CUDA graph (None: it can): a reference path reads
        the step's plan on the host."""
        k = self.kernels
        refs = [op for op, v in (("gdn.tree_verify", k.gdn), ("gdn.tree_conv1d", k.conv), ("gdn.commit", k.commit),
                                 ("tree_attn", k.attn)) if v == "reference"]
        return f"the torch reference of {', '.join(refs)} reads the step's plan on the host" if refs else None

    def warning(self, device) -> str | None:
        """The one warning's text for a model on `device` (None: every layer kind runs the kernels it would run
        on any shape)."""
        if not self.fallbacks:
            return None
        eager = self.host_syncs is not None and torch.device(device).type == "cuda"
        return ("specpilot.engine: " + "; ".join(self.fallbacks) + ". The tokens are the same; steps are slower"
                + (" and run eagerly (no CUDA graphs)" if eager else "") + ".")


class Linear:
    """A projection held as BF16 (`F.linear`), W12 planes (`w12.matmul`) or W12 in the runtime layout alone
    (`tiled`, `w12.matmul_tiled`: the flow kernel at 1..32 rows, about 12.1 bits per weight in memory); `q8=True`
    reads the W12 8-bit view."""

    def __init__(self, weight: torch.Tensor | None = None, packed: "w12.W12Weight | None" = None,
                 tiled: "w12.layout.TiledW12 | None" = None, paired: bool = False):
        if paired and tiled is None:
            raise ValueError("specpilot.engine.Linear: paired gate and up rows are held in the runtime layout only "
                             "(tiled=w12.pack(w12.pair_rows(weight)))")
        self.weight, self.packed, self.tiled = weight, packed, tiled
        # `tiled` holds gate and up rows paired (w12.pair_rows) for the fused SwiGLU (`swiglu`)
        self.paired = paired
        self._q8 = None  # the decoded 8-bit view, kept on the torch reference path

    @classmethod
    def make(cls, weight: torch.Tensor, fmt: str, device, tiled: bool = False) -> "Linear":
        weight = weight.to(device=device, dtype=torch.bfloat16).contiguous()
        if fmt != "w12":
            return cls(weight=weight)
        if tiled:
            return cls(tiled=w12.pack(weight, layout="runtime"))
        return cls(packed=w12.pack(weight, layout="planes"))  # w12.matmul with the engine's variant, the head's rows

    @property
    def shape(self) -> tuple[int, int]:
        if self.weight is not None:
            return tuple(self.weight.shape)
        w = self.packed if self.packed is not None else self.tiled
        return (w.N, w.K)

    def ensure_packed(self) -> "w12.W12Weight":
        if self.paired:
            raise ValueError("specpilot.engine.Linear: this projection holds gate and up rows paired for the fused "
                             "SwiGLU; its version-1 planes would be in that order")
        if self.packed is None:
            self.packed = (w12.layout.untile(self.tiled) if self.tiled is not None
                           else w12.pack(self.weight, layout="planes"))
        return self.packed

    def __call__(self, x: torch.Tensor, kernels: Kernels, q8: bool = False,
                 out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, K] -> [T, N]; `out`: a contiguous [T, N] tensor of x's dtype to write (and return) instead of a
        new one."""
        if self.tiled is not None:
            # PDL at every row count: the glue kernel before it (fused.FusedGlue) lets it launch early
            y = w12.matmul_tiled(x, self.tiled, q8=q8, out=None if self.paired else out, pdl=True)
            if self.paired:  # gate and up back in their halves
                y = torch.cat(w12.unpair_cols(y), -1)
                return y if out is None else out.copy_(y)
            return y
        if q8 and kernels.w12 == "torch":
            # the torch path of w12.matmul_q8 decodes the view on every call; a drafter calls it per token
            if self._q8 is None:
                self._q8 = w12.decode_q8(self.ensure_packed()).float()
            y = F.linear(x.float(), self._q8).to(x.dtype)
            return y if out is None else out.copy_(y)
        if q8:
            return w12.matmul_q8(x, self.ensure_packed(), variant=kernels.w12, out=out)
        if self.packed is not None:
            return w12.matmul(x, self.packed, variant=kernels.w12, out=out)
        return F.linear(x, self.weight) if out is None else torch.mm(x, self.weight.t(), out=out)

    def swiglu(self, x: torch.Tensor, kernels: Kernels, glue, q8: bool = False) -> torch.Tensor:
        """SwiGLU of this gate-and-up projection of x: the flow kernel's fused epilogue where the rows are paired
        (`w12.matmul_swiglu`), else the product and `glue.swiglu`."""
        if self.paired:
            return w12.matmul_swiglu(x, self.tiled, q8=q8, pdl=True)
        return glue.swiglu(self(x, kernels, q8))


def swiglu_pairs() -> bool:
    """Whether a W12 model in the runtime layout holds each MLP's gate and up rows paired and runs SwiGLU with the
    product (`w12.matmul_swiglu`: the flow kernel's epilogue up to 96 rows, one Triton kernel on the product's paired
    columns above), where the intermediate size is a multiple of 8. On by default: it took the hybrid-27b one-token
    step 1% faster than the glue kernel on an H100 (perf/results/h100-sxm/20261206T0320-w12-xs-ab.json, key
    `swiglu_engine`; docs/engine.md gives the batch rows). SPECPILOT_W12_SWIGLU=0 turns it off (unpaired rows, the
    product, then the glue's SwiGLU kernel)."""
    v = os.environ.get("SPECPILOT_W12_SWIGLU", "1")
    if v not in ("0", "1"):
        raise ValueError(f"SPECPILOT_W12_SWIGLU must be 0 or 1, got {v!r}")
    return v == "1"


def _paired_tiled(gate_up: torch.Tensor) -> "w12.layout.TiledW12":
    """A gate-and-up weight in the runtime layout with its rows paired (`w12.pair_rows`), for `Linear.swiglu`."""
    return w12.pack(w12.pair_rows(gate_up), layout="runtime")


def rms_norm(x: torch.Tensor, w1: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: fp32 statistics, scaled by w1 = 1 + w (fp32), back to x's dtype."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w1).to(x.dtype)


def add_norm(h: torch.Tensor, y: torch.Tensor, w1: torch.Tensor, eps: float):
    """The residual add (BF16) and the next RMSNorm: (h + y, rms_norm(h + y))."""
    h = h + y
    return h, rms_norm(h, w1, eps)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, -1)
    return F.silu(gate) * up


def gdn_gates(proj: torch.Tensor, neg_a: torch.Tensor, dt_bias: torch.Tensor, split: list[int],
              g_out: torch.Tensor, beta_out: torch.Tensor) -> torch.Tensor:
    """The gates of the fused GDN in-projection [conv input | z | b | a] (widths `split`): g = -exp(A_log)
    softplus(a + dt_bias) (fp32) into g_out, beta = sigmoid(b) into beta_out; returns the output gate z (a view).
    The conv input is read in place, proj[:, :split[0]]."""
    _, z, b, a = proj.split(split, -1)
    beta_out.copy_(b.sigmoid())
    g_out.copy_(neg_a * F.softplus(a.float() + dt_bias))
    return z


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm: RMSNorm (weight w, not zero-centred) times silu(gate), fp32 inside; [T, HV * V]."""
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = ((w * y) * F.silu(gate.reshape(x.shape).float())).to(x.dtype)
    return out.reshape(x.shape[0], -1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int) -> torch.Tensor:
    return torch.cat((x[..., :r] * cos + _rotate_half(x[..., :r]) * sin, x[..., r:]), -1)


def attn_prep(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_w1: torch.Tensor, k_w1: torch.Tensor,
              heads: tuple[int, int, int, int], eps: float, k_out: torch.Tensor, v_out: torch.Tensor):
    """Split the fused q (with its gate), k, v projection; q and k normed per head and rotated (the first r
    dims); k and v written to k_out, v_out. Returns (q [T, H, D], gate [T, H * D])."""
    H, Hkv, D, r = heads
    T = qkv.shape[0]
    qg, k, v = qkv.split([2 * H * D, Hkv * D, Hkv * D], -1)
    qg = qg.reshape(T, H, 2 * D)
    q, gate = qg[..., :D], qg[..., D:].reshape(T, H * D)
    q = _rope(rms_norm(q, q_w1, eps), cos, sin, r)
    k_out.copy_(_rope(rms_norm(k.reshape(T, Hkv, D), k_w1, eps), cos, sin, r))
    v_out.copy_(v.reshape(T, Hkv, D))
    return q, gate


def attn_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """o * sigmoid(gate) as [T, N], for a gate [T, N] or [T, H, D]."""
    return (o.reshape(gate.shape) * torch.sigmoid(gate)).reshape(gate.shape[0], -1)


class TorchGlue:
    """The glue functions above, as the forward pass calls them (`fused.FusedGlue` has the same methods)."""

    rms_norm = staticmethod(rms_norm)
    add_norm = staticmethod(add_norm)
    swiglu = staticmethod(swiglu)
    gdn_gates = staticmethod(gdn_gates)
    gated_rms_norm = staticmethod(gated_rms_norm)
    attn_prep = staticmethod(attn_prep)
    attn_gate = staticmethod(attn_gate)


@dataclass
class Step:
    """One forward pass: the packed trees of B requests and everything the layers read."""

    ids: torch.Tensor  # int64 [T] token of each node
    pos: torch.Tensor  # int64 [T] position of each node (context length + depth)
    tree: gdn.TreePlan
    attn: tree_attn.TreeAttnPlan
    rows: torch.Tensor  # int32 [B] cache row of each request
    kv_next: torch.Tensor  # int64 [B] first free KV slot of each request
    total: int  # T


class HybridModel:
    """Weights, caches and the forward pass of a Qwen3.5 hybrid (module docstring)."""

    def __init__(self, cfg: HybridConfig, tensors: dict, *, device, fmt: str = "bf16", kernels: Kernels,
                 rows: int = 1, max_len: int = 4096, head_screen: str = "auto", fused_glue: bool = False):
        from .loader import fuse_layer_weights

        if fmt not in ("bf16", "w12"):
            raise ValueError(f"specpilot.engine.HybridModel: weights={fmt!r}; pass 'bf16' or 'w12'")
        self.cfg, self.device, self.fmt = cfg, torch.device(device), fmt
        self.paths = Paths.decide(cfg, kernels, self.device, fused_glue)
        self.kernels = self.paths.kernels
        self.tiled_w12 = self._wants_tiled(fmt)
        if self.paths.fallbacks:
            warnings.warn(self.paths.warning(self.device), KernelFallbackWarning, stacklevel=2)
        self.rows, self.max_len = int(rows), int(max_len)
        dev = self.device

        def small(t):
            t = t if isinstance(t, torch.Tensor) else t.unpack()
            return t.to(dev)

        self.layers = []
        for d in fuse_layer_weights(cfg, tensors):  # not enumerate: its reused result tuple would hold the last d
            L = {"kind": cfg.layer_types[len(self.layers)]}
            for k, v in d.items():
                if self._pairs(k, v):
                    L[k] = Linear(tiled=_paired_tiled(v.to(device=dev, dtype=torch.bfloat16)), paired=True)
                    continue
                L[k] = Linear.make(v, fmt, dev, tiled=self.tiled_w12) if v.dim() == 2 and k != "conv" else small(v)
            for k in ("input_norm", "post_norm", "q_norm", "k_norm"):  # zero-centred: they scale by 1 + w (fp32)
                if k in L:
                    L[k + "1"] = 1.0 + L[k].float()
            if "A_log" in L:
                L["neg_a"] = -L["A_log"].float().exp()
            self.layers.append(L)
            d = v = None  # this layer's BF16 tensors go before the next layer is fused (W12: only its layout stays)
        self.embed = small(tensors["embed_tokens.weight"]).to(torch.bfloat16)
        self.final_norm = small(tensors["norm.weight"])
        self.final_norm1 = 1.0 + self.final_norm.float()
        if fused_glue:
            from .fused import FusedGlue

            self.glue = FusedGlue()
            if not self.paths.fused_attn_prep:
                self.glue.attn_prep = attn_prep
        else:
            self.glue = TorchGlue()

        head = tensors.get("lm_head.weight", None)
        if head is None:
            if not cfg.tie_embeddings:
                raise KeyError("specpilot.engine.HybridModel: the checkpoint has no lm_head.weight and does not tie "
                               "embeddings; pass a checkpoint with its head")
            head = tensors["embed_tokens.weight"]
        if isinstance(head, torch.Tensor):
            head = head.to(dev, torch.bfloat16).contiguous()
            self.head_linear = Linear.make(head, fmt, dev)
        else:
            head = head.to(dev)
            self.head_linear = Linear(packed=head) if fmt == "w12" else Linear(weight=head.unpack())
        hw = self.head_linear.packed if fmt == "w12" else self.head_linear.weight
        self.head = lmhead.CertifiedHead(hw, screen=head_screen, variant=self.kernels.head)
        inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.rotary_dim, 2, dtype=torch.float) / cfg.rotary_dim))
        self.inv_freq = inv.to(dev)
        self._alloc_caches()

    def _pairs(self, key: str, weight) -> bool:
        """Whether projection `key` of a layer is held with gate and up rows paired for SwiGLU in the flow kernel's
        epilogue (`swiglu_pairs`): the MLP's gate_up, a BF16 weight whose halves are multiples of 8 rows, in a model
        whose layers take the runtime layout."""
        return (key == "gate_up" and self.tiled_w12 and isinstance(weight, torch.Tensor) and weight.shape[0] % 16 == 0
                and swiglu_pairs())

    def _wants_tiled(self, fmt: str) -> bool:
        """Whether the layers' W12 projections are held in the runtime layout alone (`Linear.tiled`): W12 weights on
        a GPU where the CUDA kernels build, with w12's own choice of kernel (no `Kernels.w12` pinned). The head
        keeps the planes, which the certified head's screen reads."""
        if fmt != "w12" or self.device.type != "cuda" or self.kernels.w12 is not None:
            return False
        from w12 import cuda as wcuda

        return wcuda.unavailable(self.device) is None

    def to_w12(self, head_screen: str = "auto") -> None:
        """Re-hold every projection (and the head) as W12 in place, one at a time (each packed and verified,
        its BF16 copy dropped): the same model, 12-bit weights (the layers' in the runtime layout alone where
        `tiled_w12`)."""
        self.tiled_w12 = self._wants_tiled("w12")
        for key, lin in [(k, v) for L in self.layers for k, v in L.items() if isinstance(v, Linear)] + \
                [("head", self.head_linear)]:
            if self._pairs(key, lin.weight):  # gate and up rows paired: SwiGLU in the flow kernel's epilogue
                lin.tiled, lin.paired = _paired_tiled(lin.weight), True
                lin.weight = lin.packed = None
            else:
                lin.ensure_packed()
                lin.weight = None
                if self.tiled_w12 and lin is not self.head_linear:
                    lin.tiled, lin.packed = w12.layout.tile(lin.packed), None
            if self.device.type == "cuda":
                # the freed BF16 blocks go back to the device instead of being split by the smaller W12 tensors:
                # converting hybrid-27b on an 80 GB GPU ran out of memory with 12 GB cached but unused
                torch.cuda.empty_cache()
        self.fmt = "w12"
        self.head = lmhead.CertifiedHead(self.head_linear.packed, screen=head_screen, variant=self.kernels.head)

    # ---- caches ---------------------------------------------------------------------------
    def _alloc_caches(self):
        c, dev, R = self.cfg, self.device, self.rows
        Lg, La = len(c.gdn_layers), len(c.attn_layers)
        self.state = torch.zeros(Lg, R, c.v_heads, c.k_dim, c.v_dim, dtype=torch.float32, device=dev)
        self.conv_state = torch.zeros(Lg, R, c.conv_dim, c.conv_width - 1, dtype=torch.bfloat16, device=dev)
        self.kv_slots = R * self.max_len + 1  # + the scratch slot
        self.k_cache = torch.zeros(La, self.kv_slots, c.kv_heads, c.head_dim, dtype=torch.bfloat16, device=dev)
        self.v_cache = torch.zeros_like(self.k_cache)
        T = MAX_STEP_NODES * R
        # the GDN layers' in-projections [conv input | z | b | a] and conv outputs [q | k | v] are written here
        # by the forward pass, and the commit reads the conv inputs, k and v in place (no copies)
        width = c.conv_dim + c.v_heads * c.v_dim + 2 * c.v_heads
        self.stash = {
            "proj": torch.zeros(Lg, T, width, dtype=torch.bfloat16, device=dev),
            "conv": torch.zeros(Lg, T, c.conv_dim, dtype=torch.bfloat16, device=dev),
            "g": torch.zeros(Lg, T, c.v_heads, dtype=torch.float32, device=dev),
            "beta": torch.zeros(Lg, T, c.v_heads, dtype=torch.bfloat16, device=dev),
            "ak": torch.zeros(La, T, c.kv_heads, c.head_dim, dtype=torch.bfloat16, device=dev),
            "av": torch.zeros(La, T, c.kv_heads, c.head_dim, dtype=torch.bfloat16, device=dev),
        }

    def reset_rows(self, rows) -> None:
        """Forget the recurrent and conv states of these rows (their KV slots are overwritten as they fill)."""
        idx = torch.as_tensor(list(rows), dtype=torch.long, device=self.device)
        self.state[:, idx] = 0
        self.conv_state[:, idx] = 0

    def copy_row(self, src: int, dst: int) -> None:
        """Row dst takes row src's recurrent and conv states (its KV slots are the caller's business)."""
        self.state[:, dst].copy_(self.state[:, src])
        self.conv_state[:, dst].copy_(self.conv_state[:, src])

    # ---- planning (host) ------------------------------------------------------------------
    def plan(self, rows: list[int], ctx_lens: list[int], tokens: list[list[int]], parents: list[list[int]],
             kv_rows: list[int] | None = None, *, capacity: int | None = None) -> Step:
        """The Step for request b = (cache row rows[b], ctx_lens[b] tokens already in its KV slots, a tree of
        tokens[b] with local parents[b], -1 for the children of the committed context). kv_rows[b]: whose
        KV slots the prefix is read from (default: rows[b]). `capacity`: fixed attention work items, so that
        the Step can be refilled for any context up to max_len (`GraphedStep`)."""
        dev, B = self.device, len(rows)
        kv_rows = rows if kv_rows is None else kv_rows
        for b in range(B):
            n = len(tokens[b])
            if not 1 <= n <= MAX_STEP_NODES or len(parents[b]) != n:
                raise ValueError(f"specpilot.engine.HybridModel.plan: request {b} has {n} nodes; a pass takes "
                                 f"1..{MAX_STEP_NODES} "
                                 "nodes per request, one parent each")
            if ctx_lens[b] + n > self.max_len:
                raise ValueError(f"specpilot.engine.HybridModel.plan: request {b} would reach {ctx_lens[b] + n} "
                                 "tokens, beyond "
                                 f"max_len={self.max_len}; build the engine with a larger max_len")
        tree = gdn.build_tree_plan(parents, device=dev)
        pos, kv_indptr, kv_indices, kv_next = self.layout(ctx_lens, parents, kv_rows)
        c = self.cfg
        attn = tree_attn.plan(tree.cu_seqlens, torch.tensor(kv_indptr, dtype=torch.int32, device=dev),
                              kv_indices.to(dev), tree.anc, num_qo_heads=c.q_heads, num_kv_heads=c.kv_heads,
                              head_dim=c.head_dim, cache_slots=self.kv_slots, variant=self.kernels.attn,
                              capacity=capacity, kv_capacity=self.max_len * B if capacity else None)
        flat = [t for ts in tokens for t in ts]
        return Step(ids=torch.tensor(flat, dtype=torch.int64, device=dev),
                    pos=torch.tensor(pos, dtype=torch.int64, device=dev), tree=tree, attn=attn,
                    rows=torch.tensor(rows, dtype=torch.int32, device=dev),
                    kv_next=torch.tensor(kv_next, dtype=torch.int64, device=dev), total=len(flat))

    def layout(self, ctx_lens: list[int], parents: list[list[int]], kv_rows: list[int]):
        """Host lists of a step: node positions (context length + depth), the prefix slots as kv_indptr and
        kv_indices (int32 CPU tensor), and each request's first free KV slot."""
        pos = []
        for c, ps in zip(ctx_lens, parents):
            d: list[int] = []
            for p in ps:
                d.append(0 if p < 0 else d[p] + 1)
            pos += [c + x for x in d]
        kv_indptr = [0]
        for c in ctx_lens:
            kv_indptr.append(kv_indptr[-1] + c)
        base = [r * self.max_len for r in kv_rows]
        kv_indices = torch.cat([torch.arange(s, s + c, dtype=torch.int32) for s, c in zip(base, ctx_lens)]
                               + [torch.zeros(0, dtype=torch.int32)])
        return pos, kv_indptr, kv_indices, [s + c for s, c in zip(base, ctx_lens)]

    # ---- forward --------------------------------------------------------------------------
    def forward(self, s: Step, q8: bool = False) -> torch.Tensor:
        """Final-normed hidden states [T, hidden] (BF16) of every node; caches untouched, inputs stashed."""
        c, k = self.cfg, self.kernels
        h = self.embed[s.ids]
        freqs = s.pos[:, None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        cos, sin = emb.cos().to(h.dtype)[:, None], emb.sin().to(h.dtype)[:, None]
        x = self.glue.rms_norm(h, self.layers[0]["input_norm1"], c.eps)
        gi = ai = 0
        for li, L in enumerate(self.layers):
            if L["kind"] == "linear_attention":
                y = self._gdn(gi, L, x, s, q8)
                gi += 1
            else:
                y = self._attn(ai, L, x, s, cos, sin, q8)
                ai += 1
            h, x = self.glue.add_norm(h, y, L["post_norm1"], c.eps)
            y = L["down"](L["gate_up"].swiglu(x, k, self.glue, q8), k, q8)
            nxt = self.layers[li + 1]["input_norm1"] if li + 1 < len(self.layers) else self.final_norm1
            h, x = self.glue.add_norm(h, y, nxt, c.eps)
        return x

    def _gdn(self, i: int, L: dict, x: torch.Tensor, s: Step, q8: bool) -> torch.Tensor:
        c, k, T, st = self.cfg, self.kernels, s.total, self.stash
        vd = c.v_heads * c.v_dim
        proj = L["in_proj"](x, k, q8, out=st["proj"][i, :T])
        z = self.glue.gdn_gates(proj, L["neg_a"], L["dt_bias"], [c.conv_dim, vd, c.v_heads, c.v_heads],
                                st["g"][i, :T], st["beta"][i, :T])
        conv = gdn.tree_conv1d(proj[:, :c.conv_dim], self.conv_state[i], L["conv"], s.tree, activation="silu",
                               conv_state_indices=s.rows, variant=k.conv, out=st["conv"][i, :T])
        q, kk, v = self._qkv(conv)
        o = gdn.tree_verify(q, kk, v, st["g"][i, :T], st["beta"][i, :T], self.state[i], s.rows, s.tree,
                            use_qk_l2norm=True, variant=k.gdn)
        return L["out_proj"](self.glue.gated_rms_norm(o, z, L["norm"], c.eps), k, q8)

    def _qkv(self, conv: torch.Tensor):
        """q [..., H, K], k [..., H, K], v [..., HV, V]: views of a GDN conv output [..., q | k | v] (one layer's
        [T, D] or the stash's [L, T, D])."""
        c = self.cfg
        kd = c.k_heads * c.k_dim
        heads = (c.k_heads, c.k_dim)
        return (conv[..., :kd].unflatten(-1, heads), conv[..., kd:2 * kd].unflatten(-1, heads),
                conv[..., 2 * kd:].unflatten(-1, (c.v_heads, c.v_dim)))

    def _attn(self, i: int, L: dict, x: torch.Tensor, s: Step, cos, sin, q8: bool) -> torch.Tensor:
        c, k, T = self.cfg, self.kernels, s.total
        kk, v = self.stash["ak"][i, :T], self.stash["av"][i, :T]
        q, gate = self.glue.attn_prep(L["qkv"](x, k, q8), cos, sin, L["q_norm1"], L["k_norm1"],
                                      (c.q_heads, c.kv_heads, c.head_dim, c.rotary_dim), c.eps, kk, v)
        o = tree_attn.run(s.attn, q, self.k_cache[i], self.v_cache[i], k_new=kk, v_new=v)
        return L["o_proj"](self.glue.attn_gate(o, gate), k, q8)

    # ---- commit ---------------------------------------------------------------------------
    def commit(self, s: Step, accepted: torch.Tensor, accepted_len: torch.Tensor) -> None:
        """Advance request b's caches by the nodes accepted[b, :accepted_len[b]] (local indices, a root path,
        root first) of the last forward pass. Device work only: no host sync."""
        T, st = s.total, self.stash
        _, k, v = self._qkv(st["conv"][:, :T])
        gdn.commit(self.state, self.conv_state, s.rows, s.tree, accepted, accepted_len, k, v, st["g"][:, :T],
                   st["beta"][:, :T], st["proj"][:, :T, :self.cfg.conv_dim], use_qk_l2norm=True, validate=False,
                   variant=self.kernels.commit)
        M = accepted.shape[1]
        m = torch.arange(M, device=self.device)
        valid = m[None, :] < accepted_len[:, None].to(m.dtype)
        src = s.tree.cu_seqlens[:-1, None].long() + accepted.long().clamp(min=0)
        dst = torch.where(valid, s.kv_next[:, None] + m[None, :], torch.full_like(src, self.kv_slots - 1))
        src, dst = src.flatten(), dst.flatten()
        self.k_cache.index_copy_(1, dst, st["ak"].index_select(1, src))
        self.v_cache.index_copy_(1, dst, st["av"].index_select(1, src))

    def commit_accepted(self, s: Step, accepted: torch.Tensor, accepted_len: torch.Tensor) -> None:
        """Commit the roots (the pending tokens, node 0 of each pass tree) and the draft paths `greedy_accept`
        found: accepted [B, max_depth] indexes the draft nodes, which sit one past their index in the pass."""
        path = torch.where(accepted >= 0, accepted + 1, accepted)
        root = torch.zeros(accepted.shape[0], 1, dtype=path.dtype, device=path.device)
        self.commit(s, torch.cat([root, path], 1), accepted_len + 1)

    def consume(self, row: int, done: int, tokens: list[int], *, chunk: int = MAX_STEP_NODES, q8: bool = False,
                logits: bool = False, hidden: bool = False) -> torch.Tensor | None:
        """Run `tokens` into cache row `row` (which holds `done` tokens) as chains of `chunk`, committing each;
        with `logits`, the fp32 logits after every token ([len(tokens), vocab]); with `hidden` (and not
        `logits`), the final-normed hidden states of every token ([len(tokens), hidden], BF16)."""
        out = []
        for a in range(0, len(tokens), chunk):
            part = tokens[a:a + chunk]
            step = self.plan([row], [done + a], [part], [list(range(-1, len(part) - 1))])
            h = self.forward(step, q8=q8)
            if logits:
                out.append(self.logits(h, q8=q8))
            elif hidden:
                out.append(h)
            self.commit(step, torch.arange(len(part), dtype=torch.int32, device=self.device)[None],
                        torch.tensor([len(part)], dtype=torch.int32, device=self.device))
        return torch.cat(out) if (logits or hidden) and out else None

    # ---- head -----------------------------------------------------------------------------
    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head.argmax(hidden)

    def logits(self, hidden: torch.Tensor, q8: bool = False) -> torch.Tensor:
        """fp32 logits: the certified head's exact ones, or (q8) the W12 8-bit view's."""
        if q8:
            return self.head_linear(hidden, self.kernels, q8=True).float()
        return self.head.logits(hidden)
