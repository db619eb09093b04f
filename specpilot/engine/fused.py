"""Fused Triton kernels for the element-wise work between the engine's operators.

Eagerly, the glue of a 64-layer `hybrid-27b` step is about 3,000 kernels of one or two microseconds each
(4.4 ms of a 19.4 ms BF16 autoregressive step on the H200, docs/engine.md). These kernels do each glue
block in one launch, rounding to BF16 where the torch functions of `specpilot.engine.model` round (every
BF16 op's result), so they compute the same values up to the order of the fp32 sums in the norms:

| kernel | replaces (model.py) | grid |
| --- | --- | --- |
| `engine_add_rmsnorm_kernel` | `add_norm`, `rms_norm` | one program per row |
| `engine_gated_rmsnorm_kernel` | `gated_rms_norm` | one program per (token, value head) |
| `engine_swiglu_kernel` | `swiglu` | (row, column block) |
| `engine_gdn_gates_kernel` | `gdn_gates` (beta and g) | one program per token |
| `engine_attn_prep_kernel` | `attn_prep` (per-head RMSNorm, rotary, k and v written) | (token, q head + kv head) |
| `engine_sigmoid_mul_kernel` | `attn_gate` | (row, column block) |

`FusedGlue` has the signatures of the torch functions; the engine uses it on CUDA by default
(`Engine.from_pretrained(fused_glue=None)`). The GDN conv input needs no copy: the forward pass writes the in-projection
into the step's stash and convolves a view of it.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from autotune.hardware import has_pdl

__all__ = ["FusedGlue"]


@triton.jit
def _pdl_start(PDL: tl.constexpr):
    # programmatic dependent launch (FusedGlue's `pdl`): every program waits for the previous grid (its stores
    # visible) before its first load. PDL == 1 lets the next grid launch after that wait, PDL == 2 before it.
    if PDL == 1:
        gdc_wait()
        gdc_launch_dependents()
    if PDL == 2:
        gdc_launch_dependents()
        gdc_wait()


@triton.jit
def _rms(x, w1, n, eps):
    # [BLOCK] fp32 row (zeros past n) -> x * rsqrt(mean(x^2) + eps) * w1, fp32
    return x * (1.0 / tl.sqrt(tl.sum(x * x, 0) / n + eps)) * w1


@triton.jit
def engine_add_rmsnorm_kernel(h_ptr, y_ptr, w1_ptr, h_out, x_out, N, eps, HAS_Y: tl.constexpr, BLOCK: tl.constexpr,
                              PDL: tl.constexpr = 0):
    _pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    h = tl.load(h_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_Y:
        h = (h + tl.load(y_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)).to(tl.bfloat16).to(tl.float32)
        tl.store(h_out + row * N + offs, h.to(tl.bfloat16), mask=m)
    w1 = tl.load(w1_ptr + offs, mask=m, other=0.0)
    tl.store(x_out + row * N + offs, _rms(h, w1, N, eps).to(tl.bfloat16), mask=m)


@triton.jit
def engine_gated_rmsnorm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, V, HV, z_stride, eps, BLOCK: tl.constexpr,
                                PDL: tl.constexpr = 0):
    _pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)  # token * HV + head
    t, h = row // HV, row % HV
    offs = tl.arange(0, BLOCK)
    m = offs < V
    x = tl.load(o_ptr + row * V + offs, mask=m, other=0.0).to(tl.float32)
    y = (x * (1.0 / tl.sqrt(tl.sum(x * x, 0) / V + eps))).to(tl.bfloat16).to(tl.float32)
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    wy = (w * y).to(tl.bfloat16).to(tl.float32)
    z = tl.load(z_ptr + t * z_stride + h * V + offs, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * V + offs, (wy * (z * tl.sigmoid(z))).to(tl.bfloat16), mask=m)


@triton.jit
def engine_swiglu_kernel(gu_ptr, out_ptr, F, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    _pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < F
    g = tl.load(gu_ptr + row * 2 * F + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(gu_ptr + row * 2 * F + F + offs, mask=m, other=0.0).to(tl.float32)
    s = (g * tl.sigmoid(g)).to(tl.bfloat16).to(tl.float32)
    tl.store(out_ptr + row * F + offs, (s * u).to(tl.bfloat16), mask=m)


@triton.jit
def engine_sigmoid_mul_kernel(o_ptr, g_ptr, out_ptr, N, g_stride, g_head_stride, HEAD: tl.constexpr,
                              BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    # the gate's column n is at (n // HEAD) * g_head_stride + n % HEAD of its row: a [T, H, HEAD] view with any
    # head stride (attn_prep's, inside the projection's row), or a [T, N] row with HEAD = N
    _pdl_start(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < N
    o = tl.load(o_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    g_at = row * g_stride + (offs // HEAD).to(tl.int64) * g_head_stride + offs % HEAD
    g = tl.load(g_ptr + g_at, mask=m, other=0.0).to(tl.float32)
    s = tl.sigmoid(g).to(tl.bfloat16).to(tl.float32)
    tl.store(out_ptr + row * N + offs, (o * s).to(tl.bfloat16), mask=m)


@triton.jit
def engine_gdn_gates_kernel(p_ptr, nega_ptr, dtb_ptr, g_out, beta_out, HV, p_stride, off_b, BLOCK: tl.constexpr,
                            PDL: tl.constexpr = 0):
    _pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    m = offs < HV
    b = tl.load(p_ptr + t * p_stride + off_b + offs, mask=m, other=0.0).to(tl.float32)
    a = tl.load(p_ptr + t * p_stride + off_b + HV + offs, mask=m, other=0.0).to(tl.float32)
    x = a + tl.load(dtb_ptr + offs, mask=m, other=0.0).to(tl.float32)
    sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))  # torch's softplus, threshold 20
    tl.store(beta_out + t * HV + offs, tl.sigmoid(b).to(tl.bfloat16), mask=m)
    tl.store(g_out + t * HV + offs, tl.load(nega_ptr + offs, mask=m, other=0.0) * sp, mask=m)


@triton.jit
def engine_attn_prep_kernel(qkv_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, q_out, k_out, v_out, H, HKV, W, eps,
                            D: tl.constexpr, R: tl.constexpr, PDL: tl.constexpr = 0):
    _pdl_start(PDL)
    t = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs = tl.arange(0, D)
    half = R // 2
    # rotate_half over the first R dims: i < R/2 takes -x[i + R/2], R/2 <= i < R takes x[i - R/2]
    part = tl.where(offs < half, offs + half, tl.where(offs < R, offs - half, offs))
    sign = tl.where(offs < half, -1.0, 1.0)
    rot = offs < R
    is_q = head < H
    kh = head - H
    if is_q:
        row = qkv_ptr + t * W + head * 2 * D  # q: the first half of the head's [q | gate] chunk
        w = tl.load(qw_ptr + offs)
        wp = tl.load(qw_ptr + part)
    else:
        row = qkv_ptr + t * W + 2 * H * D + kh * D
        w = tl.load(kw_ptr + offs)
        wp = tl.load(kw_ptr + part)
    x = tl.load(row + offs).to(tl.float32)
    xp = tl.load(row + part).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, 0) / D + eps)
    xn = (x * r * w).to(tl.bfloat16).to(tl.float32)
    xpn = (xp * r * wp).to(tl.bfloat16).to(tl.float32)
    c = tl.load(cos_ptr + t * R + offs, mask=rot, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * R + offs, mask=rot, other=0.0).to(tl.float32)
    a = (xn * c).to(tl.bfloat16).to(tl.float32)
    b = (sign * xpn * s).to(tl.bfloat16).to(tl.float32)
    y = tl.where(rot, (a + b).to(tl.bfloat16), xn.to(tl.bfloat16))
    if is_q:
        tl.store(q_out + (t * H + head) * D + offs, y)
    else:
        tl.store(k_out + (t * HKV + kh) * D + offs, y)
        v = tl.load(qkv_ptr + t * W + 2 * H * D + HKV * D + kh * D + offs)
        tl.store(v_out + (t * HKV + kh) * D + offs, v)


def _pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


class FusedGlue:
    """The glue functions of `specpilot.engine.model` as single Triton launches (module docstring); same
    signatures, BF16 in and out.

    `pdl`: programmatic dependent launch of every glue kernel: False (plain launches), "after" or "early"; None
    picks "after" where `autotune.hardware.has_pdl` holds, or what SPECPILOT_GLUE_PDL says (0, after, early). Each
    program waits on the previous grid (griddepcontrol.wait) before its first load, so a glue kernel's launch
    overlaps the tail of the grid before it. "after" lets the next grid launch once every program has passed that
    wait: a W12 flow kernel after a norm requests its first weight tiles while the norm runs, and a grid that
    launches early then reads, before its own wait, only what grids already finished wrote. "early" lets it launch
    before the wait, while the grid before the glue kernel may still run: the next grid must then read nothing
    before its own wait but data no kernel of the step writes (a weight; the flow kernel reads only its layout)."""

    _MODES = {False: 0, "after": 1, "early": 2}

    def __init__(self, pdl: bool | str | None = None):
        if pdl is True:
            pdl = "after"
        if pdl is not None and pdl not in self._MODES:
            raise ValueError(f"FusedGlue: pdl must be None, False, True, 'after' or 'early', got {pdl!r}")
        self.pdl = pdl

    def _extra(self, x: torch.Tensor) -> dict:
        mode = self.pdl
        if mode is None:
            env = os.environ.get("SPECPILOT_GLUE_PDL", "after")
            if env not in ("0", "after", "early"):
                raise ValueError(f"SPECPILOT_GLUE_PDL must be 0, after or early, got {env!r}")
            mode = False if env == "0" or not has_pdl(x.device) else env
        return {"PDL": self._MODES[mode], "launch_pdl": True} if mode else {}

    def rms_norm(self, x, w1, eps):
        x = x.contiguous()
        out = torch.empty_like(x)
        N = x.shape[-1]
        engine_add_rmsnorm_kernel[(x.numel() // N,)](x, x, w1, x, out, N, eps, HAS_Y=False, BLOCK=_pow2(N),
                                                     **self._extra(x))
        return out

    def add_norm(self, h, y, w1, eps):
        N = h.shape[-1]
        h_new, x = torch.empty_like(h), torch.empty_like(h)
        engine_add_rmsnorm_kernel[(h.numel() // N,)](h, y.contiguous(), w1, h_new, x, N, eps, HAS_Y=True,
                                                     BLOCK=_pow2(N), **self._extra(h))
        return h_new, x

    def swiglu(self, gate_up):
        T, F2 = gate_up.shape
        out = gate_up.new_empty(T, F2 // 2)
        engine_swiglu_kernel[(T, triton.cdiv(F2 // 2, 1024))](gate_up, out, F2 // 2, BLOCK=1024,
                                                             **self._extra(gate_up))
        return out

    def gdn_gates(self, proj, neg_a, dt_bias, split, g_out, beta_out):
        conv, vd, hv, _ = split
        T = proj.shape[0]
        engine_gdn_gates_kernel[(T,)](proj, neg_a, dt_bias, g_out, beta_out, hv, proj.stride(0), conv + vd,
                                      BLOCK=_pow2(hv), **self._extra(proj))
        return proj[:, conv:conv + vd]

    def gated_rms_norm(self, x, gate, w, eps):
        T, HV, V = x.shape
        out = torch.empty(T, HV * V, dtype=x.dtype, device=x.device)
        engine_gated_rmsnorm_kernel[(T * HV,)](x.contiguous(), gate, w, out, V, HV, gate.stride(0), eps,
                                               BLOCK=_pow2(V), **self._extra(x))
        return out

    def attn_prep(self, qkv, cos, sin, q_w1, k_w1, heads, eps, k_out, v_out):
        H, Hkv, D, r = heads
        T = qkv.shape[0]
        q = torch.empty(T, H, D, dtype=qkv.dtype, device=qkv.device)
        engine_attn_prep_kernel[(T, H + Hkv)](qkv, cos.reshape(T, r).contiguous(), sin.reshape(T, r).contiguous(),
                                              q_w1, k_w1, q, k_out, v_out, H, Hkv, qkv.stride(0), eps, D=D, R=r,
                                              **self._extra(qkv))
        # the gate stays a [T, H, D] view of the projection (attn_gate reads its strides): no copy kernel
        return q, qkv[:, :2 * H * D].unflatten(1, (H, 2 * D))[..., D:]

    def attn_gate(self, o, gate):
        """o * sigmoid(gate) as [T, N]: gate [T, N] with unit column stride, or [T, H, D] with unit stride in D."""
        if gate.stride(-1) != 1:
            gate = gate.contiguous()
        T = gate.shape[0]
        if gate.dim() == 3:
            N, head, head_stride = gate.shape[1] * gate.shape[2], gate.shape[2], gate.stride(1)
        else:
            N, head, head_stride = gate.shape[1], gate.shape[1], 0
        out = torch.empty(T, N, dtype=o.dtype, device=o.device)
        engine_sigmoid_mul_kernel[(T, triton.cdiv(N, 1024))](o.contiguous(), gate, out, N, gate.stride(0), head_stride,
                                                             HEAD=head, BLOCK=1024, **self._extra(o))
        return out
