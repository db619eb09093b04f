"""Plain-torch oracles for the certified head: fp64 logits, their argmax, and the screen's bound terms
computed the slow, obvious way (`docs/lmhead.md` derives the bound)."""

from __future__ import annotations

import torch

__all__ = ["exact_logits_reference", "argmax_reference", "dense_weight", "int8_screen_reference", "round_up_bf16",
           "early_fallback_reference"]


def dense_weight(weight) -> torch.Tensor:
    """The head's exact BF16 rows `[V, H]` (decoded from a W12 record when given one)."""
    if isinstance(weight, torch.Tensor):
        return weight
    import w12

    return w12.unpack(weight)


def exact_logits_reference(hidden: torch.Tensor, weight) -> torch.Tensor:
    """fp64 `hidden @ W.T` `[M, V]`: every product and sum exact to fp64's rounding."""
    w = dense_weight(weight)
    return hidden.reshape(-1, hidden.shape[-1]).double() @ w.double().to(hidden.device).T


def argmax_reference(hidden: torch.Tensor, weight) -> torch.Tensor:
    """Argmax of the fp64 logits per row, ties to the lowest token id (torch.argmax keeps the first); -1 (the
    head's NAN_ID) for a row whose logits hold a NaN."""
    z = exact_logits_reference(hidden, weight)
    return torch.where(torch.isnan(z).any(dim=-1), -1, z.argmax(dim=-1))


def round_up_bf16(x: torch.Tensor) -> torch.Tensor:
    """The least BF16 value >= x, for x >= 0 finite (fp32 or fp64 in; BF16 out)."""
    y = x.float()
    y = torch.where(y.double() < x.double(), torch.nextafter(y, torch.full_like(y, float("inf"))), y)  # fp32 >= x
    bits = y.view(torch.int32)
    up = (bits & 0xFFFF) != 0
    hi = (bits >> 16) + up.int()  # truncate to BF16, then one BF16 step up where bits were dropped
    return (hi << 16).view(torch.float32).to(torch.bfloat16)


def int8_screen_reference(weight: torch.Tensor, group: int = 128):
    """(q int8 [V, H], scale BF16 [V, G], err fp64 [V, G]): per row and group of `group` columns,
    scale = max|w| / 127 rounded up to BF16 (1 for an all-zero group), q = round(w / scale) in [-127, 127],
    err = max |w - scale * q| (exact: every term is exact in fp64)."""
    w = weight.double()
    V, H = w.shape
    G = -(-H // group)
    pad = torch.zeros(V, G * group, dtype=torch.float64, device=w.device)
    pad[:, :H] = w
    g = pad.view(V, G, group)
    amax = g.abs().amax(-1)
    scale = round_up_bf16(amax / 127)
    scale = torch.where(amax == 0, torch.ones_like(scale), scale)
    q = torch.round(g / scale.double()[..., None]).clamp(-127, 127)
    err = (g - q * scale.double()[..., None]).abs().amax(-1)
    return q.view(V, G * group)[:, :H].to(torch.int8), scale, err


def early_fallback_reference(overflows, max_skip: int = 64) -> list[bool]:
    """The early fallback's decisions for a series of calls with one row count: True where a call skips the
    screen. `overflows[i]`: whether a screen of call i would leave a row over capacity (read only where the
    call screens). A screened call that overflows skips the next `run` calls and doubles `run` (1, 2, 4, ...,
    at most `max_skip`); one that does not resets `run` to 1."""
    skips, left, run = [], 0, 1
    for over in overflows:
        skip = left > 0
        skips.append(skip)
        if skip:
            left -= 1
        elif over:
            left, run = run, min(2 * run, max_skip)
        else:
            run = 1
    return skips
