"""A trained parallel drafter: heads on the target's last hidden state that propose every position in one pass.

Inputs of one proposal: `hidden`, the target's final-normed hidden state [hidden_size] of the token before the
pending one (the state whose argmax the pending token is, after a verify or autoregressive step), and the pending
token itself (the context's last token). Medusa heads read the hidden state alone; adding the pending token's
embedding is what EAGLE / DFlash feed their drafters, and it tells the heads which token the target has just
chosen without their having to re-derive it from the state.

Network (`HeadsNet`, fp32 compute, BF16 weights on disk):

    z    = W_in [rms(hidden); E[pending]]                 # [D]
    u_d  = z + pos[d]                                     # one row per predicted position d = 0 .. P-1
    u_d += W2 silu(W1 rms(u_d))   (n_blocks times, the blocks shared by all positions)
    logits_d = W_out rms(u_d)                             # [vocab]

Row d predicts the token at depth d below the pending token (the token d + 2 after the one whose hidden state
is read). Every row depends on (hidden, pending) only, not on the other rows' tokens: a marginal drafter, as
the tree builder's path sums assume (`specpilot.engine.spec.tree`). `propose` returns each row's top-k with
its log-softmax scores; rows past the trained `positions` are empty (-inf).

The Markov variant (`HeadsDims.markov`, DSpark style) also reads the token of the row above: row d adds
`prev[t]` to u_d, where t is the draft token at depth d - 1 (the pending token for row 0), so that its
distribution is the next token's given its parent. It is trained with the true tokens there (teacher forcing).
`propose_tree` grows the tree best-first (`tree.build_tree_conditional`): each selected node's children are
one row of the network given that node's token, and a child's edge score is its log-probability given the
parent; on a GPU the rows come `EXPAND_BATCH` per host read, and a chain (k = 1) is read once. `propose` of a Markov net gives the rows along the top-1 chain (row d given row d - 1's top-1 token).

The weights file (`save` / `load`): safetensors, tensors in BF16, its metadata holding the network's sizes
(`dims`, JSON) and the SHA-256 of the target's BF16 embedding matrix (`target_embed_sha256`), which a loader
compares with the target it drafts for.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from .drafters import _as_context, _check_count

__all__ = ["HeadsDims", "HeadsNet", "HeadsDrafter", "embed_sha256"]

_WHERE = "specpilot.engine.spec.heads"
# rows a Markov net's tree computes per host read on a GPU (`HeadsDrafter.propose_tree`); on a CPU, where a read is
# free and every row costs its arithmetic, one at a time
EXPAND_BATCH = 8


def _expand_batch(device: torch.device) -> int:
    return EXPAND_BATCH if device.type == "cuda" else 1


@dataclass(frozen=True)
class HeadsDims:
    """Sizes of a `HeadsNet`: the target's hidden size and vocabulary, the width D, the MLP width F, the
    number of shared blocks and the positions predicted."""

    hidden: int
    vocab: int
    width: int = 192
    ffn: int = 384
    blocks: int = 2
    positions: int = 16
    embed: int = 128
    markov: bool = False


def _rms(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class HeadsNet(torch.nn.Module):
    """The heads (module docstring). forward(hidden [B, H] float, pending [B] int64) -> logits [B, P, vocab]."""

    def __init__(self, dims: HeadsDims):
        super().__init__()
        self.dims = dims
        D = dims.width
        self.embed = torch.nn.Embedding(dims.vocab, dims.embed)
        self.w_in = torch.nn.Linear(dims.hidden + dims.embed, D, bias=False)
        self.pos = torch.nn.Parameter(torch.zeros(dims.positions, D))
        self.w1 = torch.nn.ModuleList(torch.nn.Linear(D, dims.ffn, bias=False) for _ in range(dims.blocks))
        self.w2 = torch.nn.ModuleList(torch.nn.Linear(dims.ffn, D, bias=False) for _ in range(dims.blocks))
        self.w_out = torch.nn.Linear(D, dims.vocab, bias=False)
        torch.nn.init.normal_(self.pos, std=0.02)
        torch.nn.init.normal_(self.embed.weight, std=0.02)
        if dims.markov:
            self.prev = torch.nn.Embedding(dims.vocab, D)
            torch.nn.init.normal_(self.prev.weight, std=0.02)

    def start(self, hidden: torch.Tensor, pending: torch.Tensor) -> torch.Tensor:
        """z [B, D] of (hidden [B, H], pending [B])."""
        return self.w_in(torch.cat([_rms(hidden.float()), self.embed(pending)], -1))

    def _finish(self, u: torch.Tensor, prev: torch.Tensor | None) -> torch.Tensor:
        if self.dims.markov:
            if prev is None:
                raise ValueError("specpilot.engine.spec.heads.HeadsNet: a Markov net's rows read the token above "
                                 "them; pass prev")
            u = u + self.prev(prev)
        for w1, w2 in zip(self.w1, self.w2):
            u = u + w2(F.silu(w1(_rms(u))))
        return self.w_out(_rms(u))

    def rows(self, z: torch.Tensor, depth: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [R, vocab] of rows `depth` [R] (int64) on one request's z [D], given the tokens `prev` [R] of the
        rows above (Markov nets only)."""
        return self._finish(z[None, :] + self.pos[depth], prev)

    def forward(self, hidden: torch.Tensor, pending: torch.Tensor, prev: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, P, vocab]; a Markov net reads `prev` [B, P], the token above each row (row 0: the pending
        token)."""
        z = self.start(hidden, pending)  # [B, D]
        return self._finish(z[:, None, :] + self.pos[None], prev)  # [B, P, vocab]


def embed_sha256(embed: torch.Tensor) -> str:
    """SHA-256 of a target's embedding matrix as BF16 bytes: the identity a weights file records."""
    t = embed.detach().to(device="cpu", dtype=torch.bfloat16).contiguous()
    return hashlib.sha256(t.view(torch.int16).numpy().tobytes()).hexdigest()


class HeadsDrafter:
    """`Drafter` over a `HeadsNet`. `needs_hidden = True`: the engine passes `hidden=`, the target's final-normed
    hidden state of the token before the pending one (docs/engine.md, "Drafters").

    A Markov net (`dims.markov`) is `conditional`: the engine asks it for the tree, `propose_tree(context,
    positions, k, budget, hidden=...)`.

    `propose(context, positions, k, hidden=...)` -> (tokens int64 [positions, k], scores float32 [positions, k])
    on the CPU (the heads run on hidden's device): row d the top-k of head d by log-probability; rows past the
    trained positions, and every row when `hidden` is None (a one-token prompt: the target has processed nothing
    yet) or the context is empty, are token 0 at -inf."""

    needs_hidden = True

    def __init__(self, net: HeadsNet, target_embed_sha256: str | None = None):
        if not isinstance(net, HeadsNet):
            raise TypeError(f"{_WHERE}.HeadsDrafter: net is a {type(net).__name__}; pass a HeadsNet, or load a weights "
                            "file with HeadsDrafter.load(path)")
        self.net = net.eval()
        self.dims = net.dims
        self.target_embed_sha256 = target_embed_sha256
        # a Markov net's candidates depend on their parent: the engine asks it for the tree (`propose_tree`)
        self.conditional = bool(net.dims.markov)

    def __repr__(self) -> str:
        return f"HeadsDrafter({self.dims})"

    @classmethod
    def load(cls, path) -> "HeadsDrafter":
        """The drafter of a weights file written by `save` (BF16 tensors; computed in fp32)."""
        from safetensors import safe_open

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"{_WHERE}.HeadsDrafter.load: {path} is not a file; pass a heads weights file "
                                    "(python -m specpilot.models.train_heads --out FILE writes one)")
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if "dims" not in meta:
                raise ValueError(f"{_WHERE}.HeadsDrafter.load: {path} has no 'dims' metadata, so it is not a heads "
                                 "file; pass a file written by HeadsDrafter.save "
                                 "(python -m specpilot.models.train_heads)")
            state = {k: f.get_tensor(k) for k in f.keys()}
        net = HeadsNet(HeadsDims(**json.loads(meta["dims"])))
        net.load_state_dict({k: v.float() for k, v in state.items()}, strict=True)
        return cls(net, meta.get("target_embed_sha256"))

    def save(self, path, extra: dict[str, str] | None = None) -> None:
        """Write the weights as BF16 safetensors with the sizes and the target's embedding digest as metadata."""
        from safetensors.torch import save_file

        meta = {"dims": json.dumps(asdict(self.dims)), "format": "pt", **(extra or {})}
        if self.target_embed_sha256 is not None:
            meta["target_embed_sha256"] = self.target_embed_sha256
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.net.state_dict().items()}
        save_file(state, str(path), metadata=meta)

    def _start(self, hidden: torch.Tensor, pending: int) -> torch.Tensor:
        dev = hidden.device
        if self.net.w_out.weight.device != dev:
            self.net.to(dev)
        h = hidden.detach().to(dtype=torch.float32).reshape(1, -1)
        return self.net.start(h, torch.tensor([pending], dtype=torch.int64, device=dev))[0]

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor, pending: int) -> torch.Tensor:
        """fp32 logits [positions, vocab] of the heads for one (hidden, pending token), computed on hidden's device
        (the network moves there at its first call on it); a Markov net's along its top-1 chain (row d given row
        d - 1's argmax)."""
        z = self._start(hidden, pending)
        if not self.dims.markov:
            return self.net.rows(z, torch.arange(self.dims.positions, device=z.device))
        out, prev = [], torch.tensor([pending], dtype=torch.int64, device=z.device)
        for d in range(self.dims.positions):
            row = self.net.rows(z, torch.tensor([d], device=z.device), prev)
            out.append(row[0])
            prev = row.argmax(-1)
        return torch.stack(out)

    def _check_hidden(self, fn: str, hidden) -> None:
        if not isinstance(hidden, torch.Tensor) or hidden.numel() != self.dims.hidden \
                or not hidden.dtype.is_floating_point:
            got = f"a {hidden.dtype} tensor of shape {tuple(hidden.shape)}" if isinstance(hidden, torch.Tensor) \
                else f"a {type(hidden).__name__}"
            raise ValueError(f"{_WHERE}.{fn}: hidden is {got}; pass the target's final-normed hidden state, a "
                             f"floating tensor of {self.dims.hidden} elements")

    @torch.no_grad()
    def propose_tree(self, context: Sequence[int] | torch.Tensor, positions: int, k: int, budget: int, *,
                     hidden: torch.Tensor | None = None):
        """The draft tree (`tree.DraftTree`, at most `budget` nodes, depth < min(positions, trained positions)),
        grown best-first (`tree.build_tree_conditional`): the children of a node at depth d holding token t are the
        top-k of row d + 1 given t (row 0 given the pending token), each scored by its log-probability given its
        parent. On a GPU the rows are computed `EXPAND_BATCH` at a time (the one the selection needs and those of
        the best frontier candidates), so it reads back once per batch; with k = 1 the chain runs on the device, row d
        given row d - 1's top token, and is read back once. No hidden state or an empty context: an empty tree."""
        from .tree import build_tree_conditional

        fn = "HeadsDrafter.propose_tree"
        _check_count(fn, "positions", positions, _WHERE)
        _check_count(fn, "k", k, _WHERE)
        ctx = _as_context(fn, context, self.dims.vocab, _WHERE)
        P = min(positions, self.dims.positions)
        if hidden is None or ctx.numel() == 0:
            return build_tree_conditional(lambda d, t: ([], []), budget, 0)
        self._check_hidden(fn, hidden)
        pending = int(ctx[-1])
        z = self._start(hidden, pending)
        kk = min(k, self.dims.vocab)

        def expand_many(pairs):
            depth = torch.tensor([d for d, _ in pairs], dtype=torch.int64, device=z.device)
            prev = torch.tensor([pending if d == 0 else t for d, t in pairs], dtype=torch.int64, device=z.device)
            v, i = torch.topk(torch.log_softmax(self.net.rows(z, depth, prev), -1), kk, dim=-1)
            return list(zip(i.tolist(), v.tolist()))  # one host read for the batch

        if kk == 1 and P:
            # the chain: row d given row d - 1's top token, on the device; one host read at the end
            chain, prev = [], torch.tensor([pending], dtype=torch.int64, device=z.device)
            for d in range(P):
                v, i = torch.topk(torch.log_softmax(self.net.rows(z, torch.tensor([d], device=z.device), prev), -1),
                                  1, dim=-1)
                chain.append((i[0], v[0]))
                prev = i[0]
            rows = list(zip(torch.stack([c[0] for c in chain]).tolist(), torch.stack([c[1] for c in chain]).tolist()))
            # k = 1: the builder asks depth d for the one node above it, which holds row d - 1's token
            return build_tree_conditional(lambda d, _token: rows[d], budget, P)
        return build_tree_conditional(lambda d, t: expand_many([(d, t)])[0], budget, P, expand_many=expand_many,
                                      batch=_expand_batch(z.device))

    def propose(self, context: Sequence[int] | torch.Tensor, positions: int, k: int, *,
                hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        fn = "HeadsDrafter.propose"
        _check_count(fn, "positions", positions, _WHERE)
        _check_count(fn, "k", k, _WHERE)
        ctx = _as_context(fn, context, self.dims.vocab, _WHERE)
        tokens = torch.zeros(positions, k, dtype=torch.int64)
        scores = torch.full((positions, k), float("-inf"), dtype=torch.float32)
        if hidden is None or ctx.numel() == 0:
            return tokens, scores
        self._check_hidden(fn, hidden)
        P, kk = min(positions, self.dims.positions), min(k, self.dims.vocab)
        logp = torch.log_softmax(self.logits(hidden, int(ctx[-1]))[:P], -1)
        v, i = torch.topk(logp, kk, dim=-1)
        tokens[:P, :kk], scores[:P, :kk] = i.cpu(), v.cpu()  # the one host read: the tree is built on the host
        return tokens, scores
