"""W12 storage format: `W12Weight` and the vectorised torch `pack` / `unpack` (docs/w12-format.md).

Everything here runs on the weight's own device (CPU or CUDA) with plain torch ops. `pack` is an
offline step and may sync the host; `unpack` and `W12Weight.validate(deep=False)` do not.

One reading of the spec to note: with `e0 == 240` the window `[240, 255]` contains the exponent
255 of +-Inf and NaN. The spec lists +-Inf and NaN among the escapes unconditionally, and the
8-bit view would turn a dense Inf into a NaN, so here exponent 255 is *always* an escape. The
window choice still counts them, exactly as the spec's formula says.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .errors import W12FormatError, W12VerificationError

if TYPE_CHECKING:
    from .layout import TiledW12

__all__ = ["W12Weight", "pack", "unpack", "FORMAT_VERSION", "GROUP", "WINDOW", "E0_MAX", "compact_planes",
           "from_compact_planes", "compact_nbytes", "LAYOUTS"]

FORMAT_VERSION = 1
GROUP = 64  # K is padded to a multiple of this; `lo` interleaves the two halves of a group
WINDOW = 16  # exponent bins per row
E0_MAX = 256 - WINDOW  # 240
_CHUNK_ELEMS = 1 << 24  # rows are packed in chunks of about this many elements (bounds temporaries)

PLANES = ("hi", "lo", "e0", "esc_rowptr", "esc_col", "esc_val")
PLANE_DTYPES = {
    "hi": torch.uint8,
    "lo": torch.uint8,
    "e0": torch.uint8,
    "esc_rowptr": torch.int32,
    "esc_col": torch.int32,
    "esc_val": torch.int16,
}


class SizeStats:
    """Escape rate and bits per weight of a set of packed weights, from its `num_weights`, `escapes` and
    `packed_bytes` (what conversion and checkpoint reports share)."""

    @property
    def escape_rate(self) -> float:
        n = self.num_weights
        return self.escapes / n if n else 0.0

    @property
    def bits_per_weight(self) -> float:
        n = self.num_weights
        return 8.0 * self.packed_bytes / n if n else 0.0


def padded_k(K: int) -> int:
    return -(-K // GROUP) * GROUP


class W12Weight:
    """A BF16 weight `[N, K]` packed losslessly into W12 planes.

    Attributes: the planes `hi`, `lo`, `e0`, `esc_rowptr`, `esc_col`, `esc_val` (see the spec),
    and the ints `N`, `K`, `Kp`. Build one with `w12.pack(weight, layout="planes")`; the constructor only checks
    shapes, dtypes and devices (`validate(deep=False)`).
    """

    __slots__ = PLANES + ("K",)

    def __init__(self, hi, lo, e0, esc_rowptr, esc_col, esc_val, K: int):
        self.hi = hi
        self.lo = lo
        self.e0 = e0
        self.esc_rowptr = esc_rowptr
        self.esc_col = esc_col
        self.esc_val = esc_val
        self.K = int(K)
        self.validate(deep=False)

    # --- shape and size -------------------------------------------------------------------
    @property
    def N(self) -> int:
        return self.e0.shape[0]

    @property
    def Kp(self) -> int:
        return self.hi.shape[1]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.N, self.K))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype `unpack` returns."""
        return torch.bfloat16

    @property
    def device(self) -> torch.device:
        return self.hi.device

    @property
    def num_escapes(self) -> int:
        return self.esc_col.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of all planes: `N*Kp*1.5 + N*5 + 4 + 6*E`."""
        return sum(getattr(self, p).nbytes for p in PLANES)

    @property
    def escape_rate(self) -> float:
        """Escapes per weight (padding not counted)."""
        n = self.N * self.K
        return self.num_escapes / n if n else 0.0

    @property
    def bits_per_weight(self) -> float:
        """All stored bits (planes, metadata, escapes) per original weight."""
        n = self.N * self.K
        return 8.0 * self.nbytes / n if n else 0.0

    def planes(self) -> dict[str, torch.Tensor]:
        return {p: getattr(self, p) for p in PLANES}

    # --- conversion -----------------------------------------------------------------------
    def to(self, device, non_blocking: bool = False) -> "W12Weight":
        """A copy on `device` (or `self` if already there)."""
        _bool_arg("w12.W12Weight.to", "non_blocking", non_blocking)
        device = torch.device(device)
        moved = {p: t.to(device, non_blocking=non_blocking) for p, t in self.planes().items()}
        return W12Weight(**moved, K=self.K)

    def cpu(self) -> "W12Weight":
        return self.to("cpu")

    def cuda(self, device=None) -> "W12Weight":
        return self.to("cuda" if device is None else torch.device("cuda", device) if isinstance(device, int) else device)

    def unpack(self) -> torch.Tensor:
        return unpack(self)

    def rows(self, start: int, end: int) -> "W12Weight":
        """Rows `[start, end)` as a `W12Weight`, exact (no decode, no re-pack): views of the planes and of the rows'
        escapes, with the row pointers rebased; reads the escapes' range on the host. The range is the caller's to
        check (0 <= start < end <= N)."""
        ptr = self.esc_rowptr
        e_lo, e_hi = int(ptr[start]), int(ptr[end])
        return W12Weight(self.hi[start:end], self.lo[start:end], self.e0[start:end], ptr[start : end + 1] - e_lo,
                         self.esc_col[e_lo:e_hi], self.esc_val[e_lo:e_hi], self.K)

    def __reduce__(self):
        # Reconstructible from tensors + an int, so torch.load(weights_only=True) accepts it once
        # the class is an allowed global (done in w12/__init__.py).
        return (W12Weight, (self.hi, self.lo, self.e0, self.esc_rowptr, self.esc_col, self.esc_val, self.K))

    def __repr__(self) -> str:
        return (
            f"W12Weight(shape=({self.N}, {self.K}), Kp={self.Kp}, escapes={self.num_escapes}, "
            f"bits_per_weight={self.bits_per_weight:.3f}, device={self.device})"
        )

    # --- checks ---------------------------------------------------------------------------
    def validate(self, deep: bool = False) -> "W12Weight":
        """Check the planes against the spec; raise `W12FormatError` saying what is wrong.

        `deep=False`: dtypes, shapes, devices, contiguity (host-side metadata only, no sync).
        `deep=True`: also the content: `esc_rowptr` starts at 0, is monotone and ends at E;
        escape columns are in `[0, K)` and strictly increasing within a row; `e0 <= 240`;
        every escape position has dense code 0; padding codes are 0. This syncs the host.
        """
        _bool_arg("w12.W12Weight.validate", "deep", deep)
        fix = "re-pack the BF16 weight with w12.pack"
        for p in PLANES:
            t = getattr(self, p)
            if not isinstance(t, torch.Tensor):
                raise W12FormatError(f"w12.W12Weight: {p} is {type(t).__name__}, expected a torch.Tensor; {fix}")
            if t.dtype != PLANE_DTYPES[p]:
                raise W12FormatError(f"w12.W12Weight: {p} has dtype {t.dtype}, expected {PLANE_DTYPES[p]}; {fix}")
            if not t.is_contiguous():
                raise W12FormatError(f"w12.W12Weight: {p} is not contiguous; call .contiguous() on it or {fix}")
            if t.device != self.hi.device:
                raise W12FormatError(
                    f"w12.W12Weight: {p} is on {t.device} but hi is on {self.hi.device}; move the whole weight "
                    f"with W12Weight.to(device), not plane by plane"
                )
        if self.hi.dim() != 2 or self.e0.dim() != 1:
            raise W12FormatError(f"w12.W12Weight: hi must be 2-D and e0 1-D, got {tuple(self.hi.shape)} and {tuple(self.e0.shape)}; {fix}")
        N, Kp, K = self.e0.shape[0], self.hi.shape[1], self.K
        if K < 1 or Kp != padded_k(K):
            raise W12FormatError(f"w12.W12Weight: hi has {Kp} columns but K={K} pads to {padded_k(K)} (multiple of {GROUP}); {fix}")
        if self.hi.shape[0] != N or N < 1:
            raise W12FormatError(f"w12.W12Weight: hi has {self.hi.shape[0]} rows, e0 has {N}; they must agree and be >= 1; {fix}")
        if tuple(self.lo.shape) != (N, Kp // 2):
            raise W12FormatError(f"w12.W12Weight: lo has shape {tuple(self.lo.shape)}, expected {(N, Kp // 2)}; {fix}")
        if tuple(self.esc_rowptr.shape) != (N + 1,):
            raise W12FormatError(f"w12.W12Weight: esc_rowptr has shape {tuple(self.esc_rowptr.shape)}, expected {(N + 1,)}; {fix}")
        if self.esc_col.dim() != 1 or self.esc_val.dim() != 1 or self.esc_col.shape != self.esc_val.shape:
            raise W12FormatError(
                f"w12.W12Weight: esc_col {tuple(self.esc_col.shape)} and esc_val {tuple(self.esc_val.shape)} must be 1-D of equal length; {fix}"
            )
        if self.esc_col.shape[0] >= 2**31:
            raise W12FormatError("w12.W12Weight: 2^31 or more escapes cannot be indexed by int32 esc_rowptr; split the weight")
        if deep:
            self._validate_content(fix)
        return self

    def _validate_content(self, fix: str) -> None:
        N, K, E = self.N, self.K, self.num_escapes
        rp = self.esc_rowptr.long()
        if int(rp[0]) != 0 or int(rp[-1]) != E:
            raise W12FormatError(f"w12.W12Weight: esc_rowptr must start at 0 and end at E={E}, got {int(rp[0])}..{int(rp[-1])}; {fix}")
        cnt = rp[1:] - rp[:-1]
        if bool((cnt < 0).any()):
            r = int((cnt < 0).nonzero()[0])
            raise W12FormatError(f"w12.W12Weight: esc_rowptr decreases at row {r}; it must be monotone non-decreasing; {fix}")
        if bool((self.e0 > E0_MAX).any()):
            r = int((self.e0 > E0_MAX).nonzero()[0])
            raise W12FormatError(f"w12.W12Weight: e0[{r}] = {int(self.e0[r])} > {E0_MAX}; {fix}")
        if E:
            col = self.esc_col.long()
            if bool(((col < 0) | (col >= K)).any()):
                i = int(((col < 0) | (col >= K)).nonzero()[0])
                raise W12FormatError(f"w12.W12Weight: esc_col[{i}] = {int(col[i])} is outside [0, {K}); {fix}")
            row = _escape_rows(self.esc_rowptr, E)
            same_row = row[1:] == row[:-1]
            bad = same_row & (col[1:] <= col[:-1])
            if bool(bad.any()):
                i = int(bad.nonzero()[0]) + 1
                raise W12FormatError(
                    f"w12.W12Weight: esc_col is not strictly increasing within row {int(row[i])} (entry {i}); columns must be "
                    f"sorted and unique per row; {fix}"
                )
            code = _codes(self.hi, self.lo)
            nz = code[row, col] != 0
            if bool(nz.any()):
                i = int(nz.nonzero()[0])
                raise W12FormatError(
                    f"w12.W12Weight: escape {i} at ({int(row[i])}, {int(col[i])}) has a non-zero dense code; escape positions "
                    f"must hold code 0; {fix}"
                )
        else:
            code = None
        if self.Kp > K:
            code = _codes(self.hi, self.lo) if code is None else code
            if bool((code[:, K:] != 0).any()):
                raise W12FormatError(f"w12.W12Weight: padding columns [{K}, {self.Kp}) must hold code 0; {fix}")


# --- helpers shared with reference.py and the kernels' tests ---------------------------------

def _escape_rows(esc_rowptr: torch.Tensor, E: int) -> torch.Tensor:
    """Row of each escape (int64 [E]) from the CSR pointers, without a host sync."""
    N = esc_rowptr.shape[0] - 1
    cnt = (esc_rowptr[1:] - esc_rowptr[:-1]).long()
    rows = torch.arange(N, device=esc_rowptr.device)
    return torch.repeat_interleave(rows, cnt, output_size=E)


def _lo_nibbles(lo: torch.Tensor) -> torch.Tensor:
    """`lo` [N, Kp/2] -> low nibble of each column, int32 [N, Kp], undoing the 64-column interleave."""
    N, half = lo.shape
    g = lo.view(N, half // 32, 1, 32).int()
    return torch.cat((g & 0xF, g >> 4), dim=2).reshape(N, 2 * half)


def _codes(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """12-bit codes, int32 [N, Kp]."""
    return (hi.int() << 4) | _lo_nibbles(lo)


def _to_int16(bits: torch.Tensor) -> torch.Tensor:
    """int32 holding 0..65535 -> int16 with the same low 16 bits (explicit wrap, no UB)."""
    return (bits - ((bits & 0x8000) << 1)).to(torch.int16)


def _decode(packed: W12Weight) -> torch.Tensor:
    """Dense decode + escapes -> BF16 [N, K]. Module-level so tests can patch it."""
    code = _codes(packed.hi, packed.lo)[:, : packed.K]
    e0 = packed.e0.int().unsqueeze(1)
    bits = ((code & 0x7FF) + (e0 << 7)) | ((code & 0x800) << 4)
    bits = torch.where(code == 0, torch.zeros_like(bits), bits)
    out = _to_int16(bits)
    E = packed.num_escapes
    if E:
        rows = _escape_rows(packed.esc_rowptr, E)
        out[rows, packed.esc_col.long()] = packed.esc_val
    return out.view(torch.bfloat16)


def unpack(packed: "W12Weight | TiledW12") -> torch.Tensor:
    """Decode a `W12Weight` or a `TiledW12` (the runtime layout) to its exact BF16 `[N, K]` tensor, on the weight's
    device. No host sync. A `TiledW12` on a GPU is decoded tile by tile (`w12.ops.decode_tiled`, the same bits);
    elsewhere through its version-1 planes (`w12.layout.untile`), built for the call."""
    if isinstance(packed, W12Weight):
        return _decode(packed)
    from .layout import TiledW12, untile

    if isinstance(packed, TiledW12):
        if packed.device.type == "cuda":
            from .ops import decode_tiled

            return decode_tiled(packed)
        return _decode(untile(packed))
    raise TypeError(f"w12.unpack: expected a W12Weight or TiledW12 (from w12.pack), got {type(packed).__name__}; "
                    "pass w12.pack(weight) (a plain tensor needs no unpacking)")


def check_pack_input(weight) -> None:
    """Raise TypeError / ValueError with a fix for anything `pack` cannot take."""
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"w12.pack: expected a torch.Tensor, got {type(weight).__name__}; wrap it with torch.as_tensor(...)")
    if weight.dtype != torch.bfloat16:
        raise TypeError(
            f"w12.pack: expected a bfloat16 weight, got {weight.dtype}; convert with .to(torch.bfloat16) "
            f"(W12 is lossless only for BF16 input)"
        )
    if weight.dim() != 2:
        raise ValueError(
            f"w12.pack: expected a 2-D [N, K] weight (nn.Linear layout), got shape {tuple(weight.shape)}; "
            f"reshape it, e.g. weight.reshape(weight.shape[0], -1)"
        )
    if weight.numel() == 0:
        raise ValueError(f"w12.pack: got an empty weight of shape {tuple(weight.shape)}; N and K must both be >= 1")
    if weight.is_complex() or weight.is_sparse or weight.is_meta:
        raise ValueError(f"w12.pack: needs a dense, materialised tensor, got layout {weight.layout} on {weight.device}")


def choose_e0(e: torch.Tensor) -> torch.Tensor:
    """Window bases (int64 [N]) for biased exponents `e` (int64 [N, K]): the e0 in [0, 240] with
    the most elements in `[e0, e0 + 15]`, ties to the smallest e0."""
    N = e.shape[0]
    idx = e + 256 * torch.arange(N, device=e.device).unsqueeze(1)
    hist = torch.bincount(idx.reshape(-1), minlength=256 * N).view(N, 256)
    cs = torch.nn.functional.pad(hist.cumsum(1), (1, 0))  # cs[:, j] = count of e < j
    in_win = cs[:, WINDOW : WINDOW + E0_MAX + 1] - cs[:, : E0_MAX + 1]  # [N, 241]
    return in_win.argmax(dim=1)  # first maximum = smallest e0


def _pack_rows(bits: torch.Tensor, Kp: int):
    """Pack int32 bit patterns [n, K] -> (code [n, Kp] int32, e0 [n], escape mask [n, K])."""
    n, K = bits.shape
    e = (bits >> 7) & 0xFF
    e0 = choose_e0(e.long())
    off = e - e0.int().unsqueeze(1)
    code = ((bits >> 4) & 0x800) | (off << 7) | (bits & 0x7F)
    dense = (off >= 0) & (off < WINDOW) & (e != 0xFF) & ((code != 0) | (e0 == 0).unsqueeze(1))
    code = torch.where(dense, code, torch.zeros_like(code))
    if Kp > K:
        code = torch.nn.functional.pad(code, (0, Kp - K))
    return code, e0, ~dense


def pack(weight: torch.Tensor, verify: bool = True, *, layout: str = "runtime") -> "TiledW12 | W12Weight":
    """Pack a BF16 `[N, K]` weight into a `TiledW12` (the runtime layout; with `layout="planes"`, a `W12Weight`) on
    the same device.

    With `verify=True` (default) the result is decoded on the same device and compared bit for
    bit; a mismatch raises `W12VerificationError`. Syncs the host (escape count); offline use only.

    `layout`: "runtime" (default) returns `w12.layout.tile` of the version-1 planes, a `TiledW12`, and frees the
    planes; it is the default because it is what the flow kernel streams: tile-contiguous and unpadded, about 12.1
    bits per weight at model sizes (12 bits plus row metadata and escapes). "planes" returns the `W12Weight`
    (version-1 planes, rows padded to a multiple of 64 columns), the form that `variant=` and kernel selection,
    row sharding and the older kernels (mma, tc, gemv) read. Verification, if asked, runs on the planes before they
    are tiled; `tile` is exact (`w12.layout.untile` gives the planes back).
    """
    check_pack_input(weight)
    _bool_arg("w12.pack", "verify", verify)
    check_layout_arg("w12.pack", layout)
    if layout == "runtime":
        from .layout import tile

        # the W12Weight lives only for the call; the caller gets the tiles
        return tile(pack(weight, verify, layout="planes"))
    w = weight.detach().contiguous()
    N, K = w.shape
    Kp = padded_k(K)
    dev = w.device
    hi = torch.zeros(N, Kp, dtype=torch.uint8, device=dev)
    lo = torch.zeros(N, Kp // 2, dtype=torch.uint8, device=dev)
    e0 = torch.zeros(N, dtype=torch.uint8, device=dev)
    counts = torch.zeros(N, dtype=torch.int64, device=dev)
    cols, vals = [], []
    step = max(1, _CHUNK_ELEMS // Kp)
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        bits = w[r0:r1].view(torch.int16).int() & 0xFFFF
        code, e0c, esc = _pack_rows(bits, Kp)
        hi[r0:r1] = (code >> 4).to(torch.uint8)
        nib = (code & 0xF).view(r1 - r0, Kp // GROUP, 2, 32)
        lo[r0:r1] = (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(r1 - r0, Kp // 2).to(torch.uint8)
        e0[r0:r1] = e0c.to(torch.uint8)
        counts[r0:r1] = esc.sum(1)
        rc = esc.nonzero()  # row-major: columns sorted within a row
        cols.append(rc[:, 1].to(torch.int32))
        vals.append(_to_int16(bits[rc[:, 0], rc[:, 1]]))
    rowptr = torch.nn.functional.pad(counts.cumsum(0), (1, 0))
    if int(rowptr[-1]) >= 2**31:
        raise ValueError(f"w12.pack: {int(rowptr[-1])} escapes overflow int32 esc_rowptr; split the weight into row blocks")
    packed = W12Weight(hi, lo, e0, rowptr.to(torch.int32), torch.cat(cols), torch.cat(vals), K)
    if verify:
        verify_packed(packed, w)
    return packed


# --- compact storage (files) -------------------------------------------------------------------
# Files store the planes without the kernels' row padding: `hi` as [N, K] and `lo` as [N, ceil(K/2)]
# with the low nibbles in column order (byte j = lo4(2j) | lo4(2j+1) << 4), and `esc_rowptr`
# without its leading 0 ([N] row ends). That is 12 bits per weight for any K plus 40 bits per row
# (the padded in-memory layout takes 12 * Kp / K: 17.7 for K = 130); loading re-pads and
# re-interleaves. The escape lists and e0 are stored as they are.


def compact_nbytes(N: int, K: int, escapes: int = 0) -> int:
    """Bytes of a W12 weight [N, K] in compact (file) form."""
    return N * K + N * ((K + 1) // 2) + N + 4 * N + 6 * escapes


def compact_planes(packed: W12Weight) -> dict[str, torch.Tensor]:
    """The planes of `packed` in compact (file) form, on its device (uint8 temporaries, row chunks)."""
    N, K, Kp = packed.N, packed.K, packed.Kp
    lo = torch.empty(N, (K + 1) // 2, dtype=torch.uint8, device=packed.device)
    step = max(1, _CHUNK_ELEMS // Kp)
    for r0 in range(0, N, step):
        g = packed.lo[r0 : r0 + step].view(-1, Kp // GROUP, 1, 32)
        nib = torch.cat((g & 0xF, g >> 4), dim=2).reshape(-1, Kp)[:, :K]  # column order
        if K % 2:
            nib = torch.nn.functional.pad(nib, (0, 1))
        lo[r0 : r0 + step] = nib[:, 0::2] | (nib[:, 1::2] << 4)
    out = packed.planes()
    out["hi"] = packed.hi[:, :K].contiguous()
    out["lo"] = lo
    out["esc_rowptr"] = packed.esc_rowptr[1:].contiguous()
    return out


def from_compact_planes(planes: dict[str, torch.Tensor], K: int) -> W12Weight:
    """Rebuild a `W12Weight` (the kernels' padded layout) from compact planes; raises
    `W12FormatError` if their shapes or dtypes do not fit K (content is checked by `validate(deep=True)`)."""
    hi_c, lo_c = planes["hi"], planes["lo"]
    K = int(K)
    for name, t in (("hi", hi_c), ("lo", lo_c)):
        if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
            raise W12FormatError(f"w12.W12Weight: compact plane {name} must be a 2-D uint8 tensor, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} {tuple(getattr(t, 'shape', ()))}")
    N = hi_c.shape[0]
    if K < 1 or tuple(hi_c.shape) != (N, K) or tuple(lo_c.shape) != (N, (K + 1) // 2):
        raise W12FormatError(f"w12.W12Weight: compact planes hi {tuple(hi_c.shape)} and lo {tuple(lo_c.shape)} do not fit K={K}: "
                             f"expected [N, {K}] and [N, {(K + 1) // 2}]")
    if K % 2 and N and bool((lo_c[:, -1] >> 4).any()):
        raise W12FormatError(f"w12.W12Weight: compact lo: the padding nibble after column {K - 1} must be 0")
    Kp = padded_k(K)
    dev = hi_c.device
    hi = torch.zeros(N, Kp, dtype=torch.uint8, device=dev)
    hi[:, :K] = hi_c
    lo = torch.empty(N, Kp // 2, dtype=torch.uint8, device=dev)
    step = max(1, _CHUNK_ELEMS // Kp)
    for r0 in range(0, N, step):
        part = lo_c[r0 : r0 + step]
        n = part.shape[0]
        nib = torch.zeros(n, Kp, dtype=torch.uint8, device=dev)
        nib[:, :K] = torch.stack((part & 0xF, part >> 4), dim=2).reshape(n, -1)[:, :K]
        g = nib.view(n, Kp // GROUP, 2, 32)
        lo[r0 : r0 + step] = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(n, Kp // 2)
    ends = planes["esc_rowptr"]
    if not isinstance(ends, torch.Tensor) or ends.dtype != torch.int32 or tuple(ends.shape) != (N,):
        raise W12FormatError(f"w12.W12Weight: compact esc_rowptr must be int32 [N={N}] (row ends), got "
                             f"{getattr(ends, 'dtype', type(ends).__name__)} {tuple(getattr(ends, 'shape', ()))}")
    rowptr = torch.cat((torch.zeros(1, dtype=torch.int32, device=ends.device), ends))
    return W12Weight(hi, lo, planes["e0"], rowptr, planes["esc_col"], planes["esc_val"], K=K)


def verify_packed(packed: W12Weight, weight: torch.Tensor) -> None:
    """Decode `packed` on its device and compare with `weight` bit for bit, in row chunks of about 2^24 weights,
    so that the check's temporaries stay bounded (a whole 248320 x 5120 head would take 5 GB of int32 codes)."""
    want = weight.view(torch.int16)
    if tuple(want.shape) != (packed.N, packed.K):
        raise W12VerificationError(f"decoded shape {(packed.N, packed.K)} != input shape {tuple(want.shape)}")
    step = max(1, _CHUNK_ELEMS // packed.Kp)
    n_bad, first = 0, None
    for r0 in range(0, packed.N, step):
        r1 = min(packed.N, r0 + step)
        part = packed if (r0, r1) == (0, packed.N) else packed.rows(r0, r1)
        got = _decode(part).view(torch.int16)
        if torch.equal(got, want[r0:r1]):
            continue
        bad = (got != want[r0:r1]).nonzero()
        n_bad += bad.shape[0]
        if first is None:
            r, c = (int(v) for v in bad[0])
            first = (r0 + r, c, int(got[r, c]) & 0xFFFF, int(want[r0 + r, c]) & 0xFFFF)
    if first is not None:
        r, c, g, x = first
        raise W12VerificationError(
            f"W12 round trip is not bit-exact: {n_bad} of {want.numel()} elements differ, first at "
            f"({r}, {c}): got 0x{g:04x}, expected 0x{x:04x}. "
            f"This is a bug in w12 (pack or decode on {packed.device}); please report it with the weight."
        )


LAYOUTS = ("planes", "runtime")  # the in-memory forms `pack` / `load_file` / `convert` return (`layout=`)


def check_layout_arg(fn: str, layout) -> None:
    """Refuse a `layout=` value other than those of `LAYOUTS`."""
    if not isinstance(layout, str) or layout not in LAYOUTS:
        raise ValueError(f"{fn}: layout must be one of {', '.join(map(repr, LAYOUTS))}, got {layout!r}; \"planes\" "
                         "gives a W12Weight (the version-1 planes), \"runtime\" a w12.layout.TiledW12 (the flow "
                         "kernel's layout)")


def _bool_arg(fn: str, name: str, value) -> None:
    """Refuse a non-bool flag (a string such as "false" would read as true)."""
    if not isinstance(value, bool):
        raise TypeError(f"{fn}: {name} must be a bool, got {type(value).__name__} {value!r}; pass True or False")
