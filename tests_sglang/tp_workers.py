"""Two-process tensor-parallel checks over torch.distributed, shared by the CPU tests (gloo) and the two-GPU
script (perf/sglang_tp2.sh: NCCL). They use only torch, w12, lmhead and specpilot.sglang's sharding and head
modules (no SGLang). `python -m tests_sglang.tp_workers --backend nccl` runs both checks and prints JSON."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A free TCP port on the loopback interface, for a process group's rendezvous."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def _device(backend: str, rank: int) -> torch.device:
    if backend == "nccl":
        torch.cuda.set_device(rank)
        return torch.device("cuda", rank)
    return torch.device("cpu")


def _weight(N, K, seed, device):
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(N, K, generator=g) * 0.02).to(torch.bfloat16)
    w.view(-1)[::113] = 3.0e4  # escapes
    return w.to(device)


def _pinned(device: torch.device):
    """One W12 kernel configuration for every shape on CUDA, so that an output row is computed in the same order
    whether the weight is whole or sharded (the automatic plan may pick another split of K for another N). The
    CPU runs the PyTorch path, which has one order already."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    import autotune
    from w12.configs import MmaConfig

    return autotune.force("w12.matmul", config=MmaConfig())


def check_linears(rank: int, world: int, device: torch.device, sizes=(1, 4, 16)) -> dict:
    """N sharding (column parallel, all-gather) and K sharding (row parallel, all-reduce of the partial products)
    of one W12 weight. Strict: `n_equal` (the gathered output equals the whole weight's output, bit for bit, under
    one kernel configuration) and `k_equal_split` (the all-reduced output equals the same shards' partials summed
    in one process). `k_close`: the K-sharded output is within the rounding of the BF16 partials of the unsplit
    output. `n_equal_auto`: whether the automatic plans also agree bit for bit (reported, not required)."""
    import w12

    from specpilot.sglang import sharding

    N, K = 384, 512
    w = _weight(N, K, 11, device)
    p = w12.pack(w, layout="planes")
    ws = w12.unpack(p)
    out = {"n_equal": True, "k_equal_split": True, "k_close": True, "n_equal_auto": True, "n_max_diff_auto": 0.0,
           "k_max_diff": 0.0}
    for M in sizes:
        x = torch.randn(M, K, generator=torch.Generator().manual_seed(M)).to(torch.bfloat16).to(device)
        for pinned in (True, False):
            with _pinned(device) if pinned else contextlib.nullcontext():
                full = w12.matmul(x, p)  # the single-device output
                yn = w12.matmul(x, sharding.shard_n(p, rank, world))
            parts = [torch.empty_like(yn) for _ in range(world)]
            dist.all_gather(parts, yn)
            yn = torch.cat(parts, dim=-1)
            if pinned:
                out["n_equal"] &= bool(torch.equal(yn, full))
            else:
                out["n_equal_auto"] &= bool(torch.equal(yn, full))
                out["n_max_diff_auto"] = max(out["n_max_diff_auto"], float((yn.float() - full.float()).abs().max()))
        # row parallel: this rank's columns of x and W; the BF16 partials summed in fp32 over the ranks, rounded once
        with _pinned(device):
            a, b = sharding.tp_range(K, rank, world)
            yk = w12.matmul(x[:, a:b].contiguous(), sharding.shard_k(p, rank, world))
            acc = yk.float()
            dist.all_reduce(acc)
            yk = acc.to(torch.bfloat16)
            ref = torch.zeros(M, N, dtype=torch.float32, device=device)
            for r in range(world):  # every rank's partial, in one process
                ra, rb = sharding.tp_range(K, r, world)
                ref += w12.matmul(x[:, ra:rb].contiguous(), sharding.shard_k(p, r, world)).float()
            full = w12.matmul(x, p)
        out["k_equal_split"] &= bool(torch.equal(yk, ref.to(torch.bfloat16)))
        diff = (yk.float() - full.float()).abs()
        # the partials' roundings to BF16 (2^-8 relative each, one per rank) plus the two final roundings
        bound = (world + 2) * 2.0**-8 * (x.float().abs() @ ws.float().abs().T) + 1e-30
        out["k_close"] &= bool((diff <= bound).all())
        out["k_max_diff"] = max(out["k_max_diff"], float(diff.max()))
    return out


def check_argmax(rank: int, world: int, device: torch.device, V: int = 1000, H: int = 256, M: int = 24) -> dict:
    from specpilot.sglang.head import ShardedCertifiedHead

    g = torch.Generator().manual_seed(5)
    W = (torch.randn(V, H, generator=g) * 0.05).to(torch.bfloat16)
    h = torch.randn(M, H, generator=g).to(torch.bfloat16)
    # exact ties across the shards: rows 700 and 200 equal 100 and a row of 'h' that picks them
    W[700] = W[100]
    W[200] = W[100]
    h[0] = (W[100].float() * 40).to(torch.bfloat16)
    W, h = W.to(device), h.to(device)
    bounds = [0, 400, V] if world == 2 else [V * r // world for r in range(world + 1)]
    a, b = bounds[rank], bounds[rank + 1]
    ids = ShardedCertifiedHead(W[a:b], a).argmax(h)
    single = ShardedCertifiedHead(W)
    want = single.head.logits(h).argmax(-1)  # torch.argmax over the exact logits the certified head is defined on
    fp64 = (h.double() @ W.double().T).argmax(-1)
    return {"equal": bool(torch.equal(ids, want)) and bool(torch.equal(ids, single.argmax(h))),
            "ties_to_lowest": int(ids[0]) == 100, "matches_fp64": bool(torch.equal(ids, fp64)),
            "ids_head": ids[:6].tolist()}


def _worker(rank: int, world: int, backend: str, port: int, what: str, result_dir: str) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        device = _device(backend, rank)
        res = {}
        if what in ("linears", "all"):
            res.update({f"{k}" if what == "linears" else f"linears.{k}": v
                        for k, v in check_linears(rank, world, device).items()})
        if what in ("argmax", "all"):
            res.update({f"{k}" if what == "argmax" else f"argmax.{k}": v
                        for k, v in check_argmax(rank, world, device).items()})
        with open(os.path.join(result_dir, f"rank{rank}.json"), "w") as f:
            json.dump(res, f)
    finally:
        dist.destroy_process_group()


def run_two_ranks(what: str, backend: str = "gloo", world: int = 2) -> dict:
    """Spawn `world` processes, run the check on each, return rank 0's result (all ranks must agree)."""
    with tempfile.TemporaryDirectory() as d:
        mp.spawn(_worker, args=(world, backend, free_port(), what, d), nprocs=world, join=True)
        results = [json.load(open(os.path.join(d, f"rank{r}.json"))) for r in range(world)]
    for r in results[1:]:
        for k, v in r.items():
            if isinstance(v, bool):
                results[0][k] = results[0][k] and v
    return results[0]


if __name__ == "__main__":
    import argparse

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--backend", default="nccl", choices=("nccl", "gloo"))
    ap.add_argument("--world", type=int, default=2)
    args = ap.parse_args()
    res = run_two_ranks("all", args.backend, args.world)
    print(json.dumps(res, indent=1))
    sys.exit(0 if all(v for v in res.values() if isinstance(v, bool)) else 1)
