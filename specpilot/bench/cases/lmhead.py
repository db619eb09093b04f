"""The certified greedy LM head (`lmhead.CertifiedHead.argmax`) beside the exact cuBLAS head + argmax.

Registered as "lmhead.argmax". Op "lm_head" throughout, dims {M, V, K} (V x K = `shapes.lm_head`; hybrid-27b:
248320 x 5120, tiny: 500 x 64), BF16 weights drawn like linear.py's (`linear._weights`, the same seed, so
the same W as its "cublas" case: N(0, 1/K), outputs O(1)). Variants:
  * "cublas"          `F.linear(h, W).argmax(-1)` (the baseline of every group)
  * "certified-int8"  `CertifiedHead(W, screen="int8").argmax(h)`: INT8 screen (per 128-column group scales),
                      bound, exact recompute of the survivors
  * "certified-int4"  `CertifiedHead(W, screen="int4").argmax(h)`: INT4 screen (codes in [-7, 7], two to a byte,
                      the same group scales and bound): half the INT8 screen's bytes, more survivors
  * "certified-w12"   `CertifiedHead(P, screen="w12").argmax(h)`, P = `w12.pack(W, layout="planes")` (the head
                      slices the planes' rows): the W12 record's 8-bit view as the screen, exact rows decoded
                      from the record
  * "certified-w12-int8"  `CertifiedHead(P, screen="int8").argmax(h)`: a W12 head screened by an INT8
                      copy (one more byte a weight), survivors decoded from the W12 record
  * "w12"             `w12.matmul(h, P).argmax(-1)`: the exact head read at 12 bits a weight (the w12
                      provider has the projection alone as layer "lm_head.linear", no argmax)

Groups (baseline "cublas"):
  * `lm_head-M<m>`, M in {1, 2, 4, 8, 16, 32}: the same groups as linear.py's "lm_head" cases, so the ratios
    stand beside them; the "cublas" case here is linear.py's own `_lm_head_case` (emitted by this provider too,
    so `--ops lmhead.argmax` alone has its baseline; `collect` keeps one copy when "linear" is selected as well).
    Its hidden states are N(0, 1), which does not change cuBLAS's time; the other variants get the "moderate"
    regime below.
  * `lm_head-<regime>-M<m>`, M in {1, 8}, regime in peaked / moderate / flat: how the screen's survivors, and so
    the certified head's time, depend on how decided the next token is. The "cublas" case of these groups runs
    on the regime's own hidden states.

Regimes (hidden states h, per row m a target token t_m, distinct, seeded): h = bf16(noise + c_m W[t_m]) with
noise ~ N(0, 1) per feature and c_m solved (bisection on the fp32 logits) so that t_m's logit exceeds the largest
other logit by `margin` times sigma, the std of the row's noise logits: "peaked" 8 sigma, "moderate" 1.5 sigma.
"flat": h ~ N(0, 1), no planted winner (the top two logits of V Gaussians: a gap of a fraction of sigma). The
gap reached (after rounding h to bf16) is measured in setup. Real heads and hidden states are not Gaussian;
these regimes bracket the screen's work, they do not predict a model's survivors.

flops = 2 M V K. bytes = the exact BF16 head's floor for every variant, 2 (V K + M K) + 8 M (as linear.py's
lm_head): not what the screen reads (INT8: V K + 2 V ceil(K/128) 2-byte scale and error entries + the
survivors' BF16 rows; W12: ~1 byte a weight), so `over_floor` compares each variant against reading the exact
BF16 head once, and a certified variant can go below 1.

Checks (same run as the timing): a certified argmax must equal `head.logits(h).argmax(-1)` exactly (the exact
kernel's fp32 logits, ties to the lowest id) and pass `linear.check_argmax` against the BF16 W (within the
rounding of an fp32 recompute); "cublas" and "w12" pass `check_argmax`.

Survivors: the row's `extra["measured"]` (a dict shared with the JSON row, which the runner copies from
`Case.extra` before setup) is filled in the same run: in setup the regime's reached gap (`gap_sigma_min`,
`gap_sigma_mean`); for the certified variants, in check, `head.stats()` of the checked call (`survivors` per row,
capped at `capacity` as stats() reports them, `survivors_mean`, `survivors_max`, `fallbacks`, `screen`), and in
teardown, after the timing, `fallbacks_after_timing` (stats()' cumulative count then; the timed inputs are the
checked ones). Each certified check also prints one "survivors" line (in the bench log of perf/gpu_check.sh).

Memory: no rotated input sets on a GPU at hybrid-27b (`rotations` gives 1: the head is far larger than L2).
The BF16 head, its INT8 head, the W12 record and the W12 head (2.5 + ~1.3 + ~1.9 GB at hybrid-27b) are built
once and shared by this provider's cases (`_Heads`), dropped after the last one (or when another shape needs
them). On a CPU only the "tiny" shape set yields cases, fewer of them: `lm_head-M1`, `lm_head-M4`,
`lm_head-peaked-M1`, `lm_head-flat-M1`; the baseline is "torch" there (the CPU matmul), and the heads run their
torch paths, or their Triton kernels under the interpreter (seconds a call) when TRITON_INTERPRET=1.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..registry import Case, Prepared, register, rotations
from ..shapes import ModelShapes
from . import linear as _linear

M_VALUES = (1, 2, 4, 8, 16, 32)
REGIME_M = (1, 8)
REGIMES = {"peaked": 8.0, "moderate": 1.5, "flat": None}  # margin over the runner-up, in sigma (None: no plant)
CPU_M = (1, 4)  # under the interpreter a certified or W12 call takes seconds
CPU_REGIMES = {"peaked": (1,), "flat": (1,)}  # "moderate" is the lm_head-M<m> groups' regime already
MAIN_REGIME = "moderate"
# variant -> (head kind built by _Heads, the screen it reads)
CERTIFIED = {"certified-int8": ("int8", "int8"), "certified-int4": ("int4", "int4"), "certified-w12": ("w12", "w12"),
             "certified-w12-int8": ("w12int8", "int8")}
VARIANTS = ("cublas", *CERTIFIED, "w12")
_SEED = 9173
_CHUNK = 16384  # weight rows per fp32 product in setup


def _bytes(v: int, k: int, m: int) -> float:
    return float(2 * (v * k + m * k) + 8 * m)  # linear._lm_head_case's: the BF16 head once, h, the indices


class _Heads:
    """The BF16 head sets and what is built from them, for one (V, K, sets, device); kinds built on first use."""

    _key = None
    _val: dict = {}

    @classmethod
    def get(cls, v: int, k: int, sets: int, device: torch.device, kind: str) -> list:
        key = (v, k, sets, str(device))
        if cls._key != key:
            cls.release()
            cls._key = key
            cls._val = {"bf16": _linear._weights(v, k, sets, device, _linear._SEED + v)}
        val = cls._val
        if kind not in val:
            import lmhead
            import w12

            if kind == "w12pack":
                val[kind] = [w12.pack(w, layout="planes") for w in val["bf16"]]  # CertifiedHead slices rows
            elif kind in ("int8", "int4"):
                val[kind] = [lmhead.CertifiedHead(w, screen=kind) for w in val["bf16"]]
            elif kind == "w12":
                val[kind] = [lmhead.CertifiedHead(p, screen="w12") for p in cls.get(v, k, sets, device, "w12pack")]
            elif kind == "w12int8":  # a W12 head screened by an INT8 copy; survivors decoded from the W12 record
                val[kind] = [lmhead.CertifiedHead(p, screen="int8") for p in cls.get(v, k, sets, device, "w12pack")]
            else:
                raise KeyError(kind)
        return val[kind]

    @classmethod
    def release(cls) -> None:
        cls._key, cls._val = None, {}
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _logits32(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """fp32 x @ w.T [M, V], w's rows converted a chunk at a time (the BF16 head is not copied whole)."""
    xf = x.float()
    return torch.cat([xf @ w[s:s + _CHUNK].float().T for s in range(0, w.shape[0], _CHUNK)], dim=1)


def _gap(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """z[m, t_m] minus the largest other logit of row m."""
    zt = z.gather(1, t[:, None])[:, 0]
    return zt - z.scatter(1, t[:, None], -float("inf")).amax(1)


def _hidden(w: torch.Tensor, m: int, regime: str, seed: int) -> tuple[torch.Tensor, dict]:
    """[M, K] bf16 hidden states of `regime` for head w; and the gap reached, in sigma."""
    v, k = w.shape
    dev = w.device
    g = torch.Generator(device=dev).manual_seed(seed)
    noise = torch.randn(m, k, device=dev, generator=g)
    base = _logits32(noise, w)  # [M, V]
    sigma = base.std(dim=1)
    margin = REGIMES[regime]
    if margin is None:
        h = noise.to(torch.bfloat16)
        z = _logits32(h, w)
        top2 = z.topk(2, dim=1).values
        gap = (top2[:, 0] - top2[:, 1]) / sigma
    else:
        t = torch.randperm(v, generator=torch.Generator().manual_seed(seed))[:m].to(dev)
        wt = w[t].float()
        cross = _logits32(wt, w)  # W_u . W_t
        target = margin * sigma

        def gap_at(c):
            return _gap(base + c[:, None] * cross, t)

        lo = torch.zeros(m, device=dev)
        hi = torch.ones(m, device=dev) * (target / cross.gather(1, t[:, None])[:, 0].clamp_min(1e-30))
        for _ in range(64):  # grow hi until the gap is reached (it rises with c: ||W_t||^2 > W_u . W_t)
            short = gap_at(hi) < target
            if not bool(short.any()):
                break
            hi = torch.where(short, 2 * hi, hi)
        for _ in range(50):
            mid = (lo + hi) / 2
            up = gap_at(mid) < target
            lo, hi = torch.where(up, mid, lo), torch.where(up, hi, mid)
        h = (noise + hi[:, None] * wt).to(torch.bfloat16)
        z = _logits32(h, w)
        gap = _gap(z, t) / sigma
        if not bool((z.argmax(1) == t).all()):
            raise AssertionError(f"lm_head {regime} M{m}: the planted token is not the argmax after rounding h")
    return h, {"gap_sigma_min": round(float(gap.min()), 3), "gap_sigma_mean": round(float(gap.mean()), 3)}


def _case(v: int, k: int, m: int, regime: str, variant: str, group: str, device: torch.device,
          last: list) -> Case:
    nbytes = _bytes(v, k, m)
    measured: dict = {}

    def setup() -> Prepared:
        import w12

        sets = rotations(nbytes, device)
        ws = _Heads.get(v, k, sets, device, "bf16")
        hs = []
        for i, w in enumerate(ws):
            h, gap = _hidden(w, m, regime, _SEED + 1000 * i + 17 * m + sum(map(ord, regime)))
            hs.append(h)
            if i == 0:
                measured.update(gap)
        heads = None
        if variant in ("cublas", "torch"):
            fns = [(lambda h=h, w=w: F.linear(h, w).argmax(-1)) for h, w in zip(hs, ws)]
        elif variant == "w12":
            packs = _Heads.get(v, k, sets, device, "w12pack")
            fns = [(lambda h=h, p=p: w12.matmul(h, p).argmax(-1)) for h, p in zip(hs, packs)]
        else:
            heads = _Heads.get(v, k, sets, device, CERTIFIED[variant][0])
            fns = [(lambda h=h, hd=hd: hd.argmax(h)) for h, hd in zip(hs, heads)]

        def check() -> None:
            h, w = hs[0], ws[0]
            if heads is not None:
                heads[0].reset_stats()
            got = fns[0]()
            if heads is not None:
                st = heads[0].stats()
                exact = heads[0].logits(h).argmax(-1)
                if not torch.equal(got, exact):
                    bad = int((got != exact).nonzero()[0, 0]) if got.shape == exact.shape else 0
                    raise AssertionError(f"{variant} {group}: row {bad} picked {int(got.reshape(-1)[bad])}, "
                                         f"the exact logits' argmax is {int(exact[bad])}")
                surv = [int(s) for s in st["survivors"]]
                measured.update(screen=st["screen"], survivors=surv, survivors_mean=float(st["survivors_mean"]),
                                survivors_max=max(surv) if surv else 0, fallbacks=int(st["fallbacks"]),
                                capacity=int(st.get("capacity", 0)))
                if st["screen"] != CERTIFIED[variant][1]:
                    raise AssertionError(f"{variant} {group}: head screens with {st['screen']!r}")
                print(f"  lm_head/{variant} {group}: survivors mean {measured['survivors_mean']:.2f} "
                      f"max {measured['survivors_max']}, fallbacks {measured['fallbacks']}, "
                      f"gap {measured['gap_sigma_min']:.2f} sigma", flush=True)
            _linear.check_argmax(got, h, w)

        def teardown() -> None:
            if heads is not None and "fallbacks" in measured:
                try:
                    measured["fallbacks_after_timing"] = int(heads[0].stats()["fallbacks"])
                except Exception as e:  # a failed call must not hide the results
                    measured["fallbacks_after_timing"] = f"{type(e).__name__}: {e}"
            hs.clear()
            fns.clear()
            if last and last[0] is case:
                _Heads.release()

        return Prepared(fns=fns, check=check, graph_safe=True, teardown=teardown)

    extra = {"regime": regime, "margin_sigma": REGIMES[regime], "measured": measured}
    if variant in CERTIFIED:
        extra["screen"] = CERTIFIED[variant][1]
    case = Case(op="lm_head", variant=variant, shape=group, dims={"M": m, "V": v, "K": k}, flops=2.0 * m * v * k,
                bytes=nbytes, setup=setup, group=group, baseline=_linear.baseline_variant(device), extra=extra)
    return case


@register("lmhead.argmax", ops=("lm_head",))
def cases(shapes: ModelShapes, device: torch.device) -> list[Case]:
    device = torch.device(device)
    if device.type != "cuda" and shapes.name != "tiny":
        return []
    v, k = shapes.lm_head
    cuda = device.type == "cuda"
    regimes = {r: REGIME_M for r in REGIMES} if cuda else CPU_REGIMES
    last: list = []
    out: list[Case] = []
    for m in M_VALUES if cuda else CPU_M:
        out.append(_linear._lm_head_case(v, k, m, device))  # the baseline, as the "linear" provider has it
        out += [_case(v, k, m, MAIN_REGIME, var, f"lm_head-M{m}", device, last) for var in VARIANTS[1:]]
    base = _linear.baseline_variant(device)  # "cublas", or "torch" on a CPU
    for regime, ms in regimes.items():
        for m in ms:
            out += [_case(v, k, m, regime, var, f"lm_head-{regime}-M{m}", device, last)
                    for var in (base, *VARIANTS[1:])]
    last.append(out[-1])  # its teardown drops the shared heads: the last group of this provider to run
    return out
