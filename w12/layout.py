"""The W12 runtime layout: the version-1 planes rearranged into tiles stored in the order the flow kernel
(csrc/w12_flow.cu) streams them (docs/w12-format.md, "Runtime layout").

The file format (version 1) does not change: `tile(packed)` builds this layout from a `W12Weight`, and
`untile(tiled)` gives the version-1 planes back, bit for bit. The two differ only in where the `hi` bytes and
`lo` nibbles sit; `e0` and the escape list (CSR) are the same tensors.

Geometry of a weight [N, K]:

    KF = K // 64   full column groups        kr = K % 64   columns of the masked last group (0: none)
    NF = N // 16   full row blocks           nr = N % 16   rows of the partial last row block (0: none)
    R(b) = 16 for row block b < NF, nr for b = NF
    TB = kr + ceil(kr / 2)   tail bytes per row        SB = 1536 KF + 16 TB   bytes per full row block

`tiles` is one uint8 buffer. Row block b starts at byte b * SB (the partial block, if any, at NF * SB) and holds
its KF tiles, tile c at 96 R c from the block start, then its tail at 96 R KF. No row is padded to 16 rows and no
row to a multiple of 64 columns: the buffer holds `N * (96 KF + TB)` bytes, 12 bits per weight plus at most
4 bits per row (the last nibble of an odd kr).

A tile: R rows x 64 columns (columns 64 c .. 64 c + 63), 96 R bytes.

    [0, 64 R)        hi: byte 64 r + j = hi of (row r, column 64 c + j)          (the version-1 hi byte, code >> 4)
    [64 R, 96 R)     lo: byte 64 R + 32 r + 8 p + j = lo4(16 p + j) | lo4(16 p + j + 8) << 4
                     for p in 0..3, j in 0..7, columns relative to 64 c          (lo4: the code's low nibble)

In fragment terms (mma.sync m16n8k16, weights as the A operand, lane = 4 g + p of a warp): the lane's rows are
g and g + 8 and its columns 16 p .. 16 p + 15. Its hi bytes of row r are the 16 bytes at 64 r + 16 p, one 16-byte
load (k-step s of the 64 columns takes their word s: columns 16 p + 4 s .. + 3, which fill the k slots
2 p, 2 p + 1, 2 p + 8, 2 p + 9 of the step, the same permutation on x); its lo nibbles of row r are the 8 bytes at
64 R + 32 r + 8 p, one 8-byte load: byte j holds column 16 p + j in its low nibble and 16 p + j + 8 in its high
nibble, so k-steps 0 and 1 read the low nibbles of words 0 and 1 and k-steps 2 and 3 the high ones. With R = 16
lane l's 16 hi bytes of row g sit at 16 l, those of row g + 8 at 512 + 16 l, its lo bytes at 1024 + 8 l and
1280 + 8 l: the three 512-byte pieces of a tile are lane-ordered, so one warp copies a tile with three 16-byte
copies per lane over contiguous bytes and reads each piece back without bank conflicts. The first 64 R bytes of a
tile are the 8-bit view alone.

The tail (the masked last group, columns 64 KF .. K - 1), R TB bytes:

    [0, R kr)        hi, row-major: byte kr r + j = hi of (row r, column 64 KF + j)
    [R kr, R TB)     lo nibbles in column order, ceil(kr / 2) bytes per row: byte ceil(kr / 2) r + i =
                     lo4(64 KF + 2 i) | lo4(64 KF + 2 i + 1) << 4 (a last odd nibble is 0)

Every tile starts 16-byte aligned (1536, 96 and 16 TB are multiples of 16).
"""

from __future__ import annotations

import torch

from .format import GROUP, W12Weight, _bool_arg, padded_k

__all__ = ["TILE_ROWS", "TILE_COLS", "TILE_BYTES", "TENSORS", "Geometry", "TiledW12", "tile", "untile"]

TILE_ROWS = 16
TILE_COLS = 64
TILE_BYTES = TILE_ROWS * TILE_COLS * 3 // 2  # 1536
TENSORS = ("tiles", "e0", "esc_rowptr", "esc_col", "esc_val")  # a TiledW12's tensors, in its constructor's order
_CHUNK_BLOCKS = 1 << 14  # row blocks per step of tile / untile (bounds the temporaries to ~16M weights at K = 64)


class Geometry:
    """Sizes and offsets of the runtime layout of a weight [N, K] (module doc)."""

    __slots__ = ("N", "K", "KF", "kr", "NF", "nr", "TB", "SB")

    def __init__(self, N: int, K: int):
        if N < 1 or K < 1:
            raise ValueError(f"w12.layout.Geometry: N and K must be >= 1, got N={N}, K={K}")
        self.N, self.K = int(N), int(K)
        self.KF, self.kr = divmod(self.K, TILE_COLS)
        self.NF, self.nr = divmod(self.N, TILE_ROWS)
        self.TB = self.kr + (self.kr + 1) // 2
        self.SB = TILE_BYTES * self.KF + TILE_ROWS * self.TB

    @property
    def row_blocks(self) -> int:
        return self.NF + (self.nr > 0)

    def rows(self, b: int) -> int:
        return TILE_ROWS if b < self.NF else self.nr

    def block_offset(self, b: int) -> int:
        return b * self.SB

    def tile_offset(self, b: int, c: int) -> int:
        return b * self.SB + 96 * self.rows(b) * c

    def tail_offset(self, b: int) -> int:
        return b * self.SB + 96 * self.rows(b) * self.KF

    @property
    def nbytes(self) -> int:
        """Bytes of the tile buffer: N (96 KF + TB)."""
        return self.N * (96 * self.KF + self.TB)

    def __repr__(self) -> str:
        return f"Geometry(N={self.N}, K={self.K}, KF={self.KF}, kr={self.kr}, NF={self.NF}, nr={self.nr})"


class TiledW12:
    """A W12 weight in the runtime layout: `tiles` (uint8 [Geometry(N, K).nbytes]) plus the version-1 `e0` and
    escape list (`esc_rowptr`, `esc_col`, `esc_val`), shared with the `W12Weight` it was built from.
    Build one with `w12.pack(weight)` or `w12.load_file(path)` (the runtime layout is their default) or
    `w12.layout.tile(packed)`; `untile` gives the `W12Weight` back. `w12.unpack`, `w12.decode_q8`,
    `w12.matmul`, `w12.matmul_q8` and `w12.save_file` take it as they take a `W12Weight`."""

    __slots__ = ("tiles", "e0", "esc_rowptr", "esc_col", "esc_val", "N", "K", "_launched")

    def __init__(self, tiles, e0, esc_rowptr, esc_col, esc_val, N: int, K: int):
        self.tiles, self.e0, self.esc_rowptr, self.esc_col, self.esc_val = tiles, e0, esc_rowptr, esc_col, esc_val
        self.N, self.K = int(N), int(K)
        self._launched = None  # the tensors' version counters at the last kernel launch (w12.flow.launch_tiled)
        want = Geometry(self.N, self.K).nbytes
        if not isinstance(tiles, torch.Tensor) or tiles.dtype != torch.uint8 or tiles.dim() != 1 \
                or tiles.numel() != want or not tiles.is_contiguous():
            got = f"{tiles.dtype} {tuple(tiles.shape)}" if isinstance(tiles, torch.Tensor) else type(tiles).__name__
            raise ValueError(f"w12.layout.TiledW12: tiles must be a contiguous uint8 tensor of {want} bytes for "
                             f"[N={self.N}, K={self.K}], got {got}; build it with w12.layout.tile(packed)")
        if e0.shape != (self.N,) or esc_rowptr.shape != (self.N + 1,):
            raise ValueError(f"w12.layout.TiledW12: e0 {tuple(e0.shape)} and esc_rowptr {tuple(esc_rowptr.shape)} "
                             f"do not fit N={self.N}; build it with w12.layout.tile(packed)")
        if any(t.device != tiles.device for t in (e0, esc_rowptr, esc_col, esc_val)):
            raise ValueError("w12.layout.TiledW12: every tensor must be on the tiles' device; move the W12Weight "
                             "before tiling it")

    def __getattr__(self, name: str):
        # only for attributes the class does not have: the version-1 planes' own say where they are
        if name in ("hi", "lo", "Kp"):
            raise AttributeError(f"w12.layout.TiledW12 has no {name!r}: it holds the runtime layout (`tiles`), the "
                                 "default form of w12.pack / load_file / convert; pass layout=\"planes\" there for a "
                                 "W12Weight with hi and lo, or call w12.layout.untile(tiled)")
        raise AttributeError(f"'TiledW12' object has no attribute {name!r}")

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.N, self.K))

    @property
    def dtype(self) -> torch.dtype:
        """The dtype `w12.unpack` returns."""
        return torch.bfloat16

    def to(self, device, non_blocking: bool = False) -> "TiledW12":
        """The layout on `device`: all five tensors moved (`self` where every one is already there)."""
        _bool_arg("w12.layout.TiledW12.to", "non_blocking", non_blocking)
        device = torch.device(device)
        old = self.tensors()
        moved = tuple(t.to(device, non_blocking=non_blocking) for t in old)
        if all(a is b for a, b in zip(moved, old)):
            return self
        return TiledW12(*moved, self.N, self.K)

    def cpu(self) -> "TiledW12":
        return self.to("cpu")

    def cuda(self, device=None) -> "TiledW12":
        if isinstance(device, int):
            device = torch.device("cuda", device)
        return self.to("cuda" if device is None else device)

    def unpack(self) -> torch.Tensor:
        """The exact BF16 weight [N, K] (`w12.unpack`)."""
        from .format import unpack

        return unpack(self)

    def __reduce__(self):
        # Rebuilt from tensors and ints, so torch.load(weights_only=True) takes it once the class is an allowed
        # global (w12/__init__.py registers it); the launch bookkeeping (`_launched`) starts afresh.
        return (TiledW12, (*self.tensors(), self.N, self.K))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The five tensors, in `TENSORS` order."""
        return (self.tiles, self.e0, self.esc_rowptr, self.esc_col, self.esc_val)

    def versions(self) -> tuple[int, ...]:
        """The torch version counters of the five tensors: they change with every in-place write."""
        return tuple(t._version for t in self.tensors())

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.N, self.K)

    @property
    def device(self) -> torch.device:
        return self.tiles.device

    @property
    def num_escapes(self) -> int:
        return self.esc_col.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of everything a GEMM reads: tiles, e0, the escape list."""
        return sum(t.nbytes for t in self.tensors())

    @property
    def bits_per_weight(self) -> float:
        return 8.0 * self.nbytes / (self.N * self.K)

    def __repr__(self) -> str:
        return (f"TiledW12(shape=({self.N}, {self.K}), escapes={self.num_escapes}, "
                f"bits_per_weight={self.bits_per_weight:.3f}, device={self.device})")


def _nibbles(lo: torch.Tensor, Kp: int) -> torch.Tensor:
    """Version-1 `lo` [n, Kp / 2] -> the low nibble of every column, uint8 [n, Kp] (the 64-column interleave undone)."""
    g = lo.view(lo.shape[0], Kp // GROUP, 1, 32)
    return torch.cat((g & 0xF, g >> 4), dim=2).reshape(lo.shape[0], Kp)


def _pairs(nib: torch.Tensor) -> torch.Tensor:
    """uint8 nibbles [n, k] -> bytes [n, ceil(k / 2)]: column 2 i in the low nibble, 2 i + 1 in the high one."""
    n, k = nib.shape
    if k % 2:
        nib = torch.nn.functional.pad(nib, (0, 1))
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def _unpairs(b: torch.Tensor, k: int) -> torch.Tensor:
    """The inverse of `_pairs`: bytes [n, ceil(k / 2)] -> nibbles [n, k]."""
    return torch.stack((b & 0xF, b >> 4), dim=2).reshape(b.shape[0], -1)[:, :k]


def _tile_rows(hi: torch.Tensor, nib: torch.Tensor, R: int, KF: int) -> torch.Tensor:
    """Rows of `nb` row blocks of R rows each (hi, nib uint8 [nb R, 64 KF]) -> their tiles, uint8 [nb, KF 96 R]."""
    nb = hi.shape[0] // R
    h = hi.reshape(nb, R, KF, 64).permute(0, 2, 1, 3).reshape(nb, KF, 64 * R)
    n = nib.reshape(nb, R, KF, 4, 2, 8)
    lo = (n[..., 0, :] | (n[..., 1, :] << 4)).permute(0, 2, 1, 3, 4).reshape(nb, KF, 32 * R)
    return torch.cat((h, lo), dim=2).reshape(nb, KF * 96 * R)


def _untile_rows(t: torch.Tensor, R: int, KF: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `_tile_rows`: uint8 [nb, KF 96 R] -> (hi, nib) uint8 [nb R, 64 KF]."""
    nb = t.shape[0]
    t = t.reshape(nb, KF, 96 * R)
    hi = t[:, :, : 64 * R].reshape(nb, KF, R, 64).permute(0, 2, 1, 3).reshape(nb * R, KF * 64)
    lo = t[:, :, 64 * R:].reshape(nb, KF, R, 4, 8).permute(0, 2, 1, 3, 4)  # [nb, R, KF, 4, 8]
    nib = torch.stack((lo & 0xF, lo >> 4), dim=4)  # [nb, R, KF, 4, 2, 8]: j, then j + 8
    return hi, nib.reshape(nb * R, KF * 64)


def _blocks(hi: torch.Tensor, nib: torch.Tensor, R: int, geo: Geometry) -> torch.Tensor:
    """Whole row blocks of R rows (hi, nib uint8 [nb R, K]) -> their bytes, uint8 [nb, 96 R KF + R TB]."""
    nb, KF, kr = hi.shape[0] // R, geo.KF, geo.kr
    parts = [_tile_rows(hi[:, : 64 * KF], nib[:, : 64 * KF], R, KF)] if KF else []
    if kr:
        parts.append(hi[:, 64 * KF:].reshape(nb, R * kr))
        parts.append(_pairs(nib[:, 64 * KF:]).reshape(nb, R * ((kr + 1) // 2)))
    return torch.cat(parts, dim=1)


def _unblocks(t: torch.Tensor, R: int, geo: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of `_blocks`: uint8 [nb, 96 R KF + R TB] -> (hi, nib) uint8 [nb R, K]."""
    nb, KF, kr = t.shape[0], geo.KF, geo.kr
    his, nibs = [], []
    if KF:
        h, n = _untile_rows(t[:, : 96 * R * KF], R, KF)
        his.append(h)
        nibs.append(n)
    if kr:
        tail = t[:, 96 * R * KF:]
        his.append(tail[:, : R * kr].reshape(nb * R, kr))
        nibs.append(_unpairs(tail[:, R * kr:].reshape(nb * R, (kr + 1) // 2), kr))
    return torch.cat(his, dim=1), torch.cat(nibs, dim=1)


def tile(packed: W12Weight) -> TiledW12:
    """The runtime layout of `packed` (module doc), on its device; `e0` and the escape list are shared, not copied.
    Plain torch indexing, no host sync."""
    if not isinstance(packed, W12Weight):
        raise TypeError(f"w12.layout.tile: expected a W12Weight (from w12.pack(weight, layout=\"planes\")), got "
                        f"{type(packed).__name__}; "
                        + ("it is already the runtime layout (w12.pack returns a TiledW12)"
                           if isinstance(packed, TiledW12) else "pass w12.pack(weight, layout=\"planes\")"))
    N, K, Kp = packed.N, packed.K, packed.Kp
    geo = Geometry(N, K)
    out = torch.empty(geo.nbytes, dtype=torch.uint8, device=packed.device)
    step = TILE_ROWS * max(1, _CHUNK_BLOCKS // max(1, Kp // GROUP))
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        hi = packed.hi[r0:r1, :K]
        nib = _nibbles(packed.lo[r0:r1], Kp)[:, :K]
        full = (r1 - r0) // TILE_ROWS * TILE_ROWS  # whole blocks of this chunk; a remainder is the partial block
        o = r0 // TILE_ROWS * geo.SB
        if full:
            b = _blocks(hi[:full], nib[:full], TILE_ROWS, geo).reshape(-1)
            out[o:o + b.numel()] = b
            o += b.numel()
        if full < r1 - r0:
            b = _blocks(hi[full:], nib[full:], r1 - r0 - full, geo).reshape(-1)
            out[o:o + b.numel()] = b
    return TiledW12(out, packed.e0, packed.esc_rowptr, packed.esc_col, packed.esc_val, N, K)


def untile(tiled: TiledW12) -> W12Weight:
    """The exact inverse of `tile`: the version-1 `W12Weight` (planes padded to Kp columns, padding codes 0)."""
    if not isinstance(tiled, TiledW12):
        raise TypeError(f"w12.layout.untile: expected a TiledW12 (from w12.layout.tile), got {type(tiled).__name__}")
    N, K = tiled.N, tiled.K
    geo = Geometry(N, K)
    Kp = padded_k(K)
    dev = tiled.device
    hi = torch.zeros(N, Kp, dtype=torch.uint8, device=dev)
    lo = torch.empty(N, Kp // 2, dtype=torch.uint8, device=dev)
    step = TILE_ROWS * max(1, _CHUNK_BLOCKS // max(1, Kp // GROUP))
    for r0 in range(0, N, step):
        r1 = min(N, r0 + step)
        full = (r1 - r0) // TILE_ROWS * TILE_ROWS
        o = r0 // TILE_ROWS * geo.SB
        hs, ns = [], []
        if full:
            nbytes = full // TILE_ROWS * geo.SB
            h, n = _unblocks(tiled.tiles[o:o + nbytes].view(full // TILE_ROWS, geo.SB), TILE_ROWS, geo)
            hs.append(h)
            ns.append(n)
            o += nbytes
        if full < r1 - r0:
            R = r1 - r0 - full
            h, n = _unblocks(tiled.tiles[o:o + R * (96 * geo.KF + geo.TB)].view(1, -1), R, geo)
            hs.append(h)
            ns.append(n)
        hi[r0:r1, :K] = torch.cat(hs)
        nib = torch.zeros(r1 - r0, Kp, dtype=torch.uint8, device=dev)
        nib[:, :K] = torch.cat(ns)
        g = nib.view(r1 - r0, Kp // GROUP, 2, 32)
        lo[r0:r1] = (g[:, :, 0] | (g[:, :, 1] << 4)).reshape(r1 - r0, Kp // 2)
    return W12Weight(hi, lo, tiled.e0, tiled.esc_rowptr, tiled.esc_col, tiled.esc_val, K)
