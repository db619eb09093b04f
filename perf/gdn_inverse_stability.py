"""How accurate are the WY kernel's doubling inverses in fp32? A CPU sweep, torch only.

    python3 perf/gdn_inverse_stability.py            # ~10 s

For chains of n nodes (the deepest trees) with keys k_t = rho * shared + noise (L2-normalised, K=128),
beta in [beta/2, beta] and gates near 0, it builds A as the kernel does and inverts I + A three ways in
fp32: repeated squaring ("square": (I - A)(I + A^2)(I + A^4)...), forward substitution (torch's
triangular solve: what "levels" and torch's WY form do), against fp64. It prints the relative error of
each and max |A^(2^i)|, the quantity the kernel's guard (gdn/kernels/wy.py, GROWTH_MAX) checks, then the
worst error ratio seen below each candidate threshold: the data behind GROWTH_MAX = 1.
"""

from __future__ import annotations

import math

import torch


def case(n: int, rho: float, beta: float, seed: int, K: int = 128):
    gen = torch.Generator().manual_seed(seed)
    f64 = torch.float64
    shared = torch.randn(K, dtype=f64, generator=gen)
    k = rho * shared + math.sqrt(1 - rho ** 2) * torch.randn(n, K, dtype=f64, generator=gen)
    k = k / k.norm(dim=1, keepdim=True)
    b = beta * torch.rand(n, dtype=f64, generator=gen).clamp(min=0.5)
    G = torch.cumsum(-0.05 * torch.rand(n, dtype=f64, generator=gen), 0)
    A = (b[:, None] * (k @ k.T) * torch.exp((G[:, None] - G[None, :]).tril())).tril(-1)
    eye = torch.eye(n, dtype=f64)
    exact = torch.linalg.inv(eye + A)
    a32, e32 = A.float(), eye.float()
    T, P, grow, i = e32 - a32, a32, a32.abs().max().item(), 1
    while (1 << i) <= n - 1:
        P = P @ P
        T = T + T @ P
        grow = max(grow, P.abs().max().item())
        i += 1
    solve = torch.linalg.solve_triangular(e32 + a32, e32, upper=False, unitriangular=True)
    norm = exact.norm()
    err_sq = ((T.double() - exact).norm() / norm).item()
    err_solve = ((solve.double() - exact).norm() / norm).item()
    return grow, err_sq, err_solve


def main():
    rows = []
    for n in (8, 16, 32, 64):
        for rho in (0.0, 0.3, 0.5, 0.6, 0.7, 0.8, 0.9):
            for beta in (0.3, 0.6, 1.0):
                for seed in range(3):
                    grow, e_sq, e_solve = case(n, rho, beta, seed)
                    rows.append((grow, e_sq / e_solve, n, rho, beta, e_sq, e_solve))
    print(f"{'n':>3} {'rho':>4} {'beta':>4} {'max|P|':>10} {'square err':>11} {'solve err':>10} {'ratio':>9}")
    for grow, ratio, n, rho, beta, e_sq, e_solve in rows[::3]:  # first seed of each setting
        print(f"{n:3d} {rho:4.1f} {beta:4.1f} {grow:10.3g} {e_sq:11.2e} {e_solve:10.2e} {ratio:9.3g}")
    print("\nthreshold on max|P| -> worst square/solve error ratio at or below it, cases above it (guarded)")
    for th in (0.25, 0.5, 1.0, 2.0, 4.0, 16.0):
        below = [r for g, r, *_ in rows if g <= th]
        print(f"  {th:5.2f}: worst ratio {max(below):7.3g}, {sum(g > th for g, *_ in rows)} of {len(rows)} above")


if __name__ == "__main__":
    main()
