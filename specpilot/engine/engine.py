"""`Engine`: greedy decoding of a Qwen3.5 hybrid, autoregressive or speculative with draft trees.

A request's context is c_0 .. c_{n-1}. The caches hold c_0 .. c_{n-2}; the last token c_{n-1} is
*pending*: every pass processes it as the root of its tree. An autoregressive step is the pending
token alone. A speculative step drafts `positions` positions of `topk` candidates below it, keeps the
best `tree_nodes - 1` of them as a tree (`specpilot.tree.build_tree`), and verifies root and tree in
one pass: the target's argmax after the root and after every node gives `greedy_accept` the longest
path the target itself would have produced, then the bonus token. The caches advance by the root and
that path (`HybridModel.commit`); the bonus becomes the pending token. Every emitted token is the
target's argmax after a prefix of exactly the tokens emitted before it: the output is greedy decoding's.

Prefill runs the prompt but its last token as chains of up to 64 nodes through the same pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..accept import greedy_accept
from ..tree import DraftTree, _bit, build_tree
from .loader import load_config, load_tensors
from .graphs import GraphedStep, pass_tree
from .model import MAX_STEP_NODES, HybridModel, Kernels

__all__ = ["Engine", "SelfDrafter", "StepRecord", "LosslessReport", "check_lossless", "NEAR_TIE"]


@dataclass
class StepRecord:
    kind: str  # "prefill", "ar", "verify"
    nodes: int  # nodes in the pass (root included)
    emitted: int  # tokens the step emitted
    seconds: float


@dataclass
class _Stats:
    steps: list[StepRecord] = field(default_factory=list)
    q_agree: int = 0  # two-level verification: Q-pass choices the exact pass confirmed
    q_total: int = 0

    def summary(self) -> dict:
        out = {}
        for kind in ("ar", "verify", "batch"):
            rec = [s for s in self.steps if s.kind == kind]
            if not rec:
                continue
            secs = sorted(s.seconds for s in rec)
            emitted = sum(s.emitted for s in rec)
            out[kind] = {"steps": len(rec), "tokens": emitted, "tau": emitted / len(rec),
                         "mean_nodes": sum(s.nodes for s in rec) / len(rec),
                         "median_step_ms": 1e3 * secs[len(secs) // 2], "total_s": sum(secs)}
        if self.q_total:
            out["q_pass"] = {"agreement": self.q_agree / self.q_total, "compared": self.q_total}
        pre = [s for s in self.steps if s.kind == "prefill"]
        if pre:
            out["prefill"] = {"tokens": sum(s.nodes for s in pre), "total_s": sum(s.seconds for s in pre)}
        return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    """Greedy decoding: `generate` serves one request, `generate_batch` several under one node budget
    (`specpilot.engine.batch`); see the module docstring.

    `drafter`: "ngram" (`specpilot.drafters.NGramDrafter`), "self" (`SelfDrafter`: the target on its W12
    8-bit view), None, or any object with `propose(context, positions, k)`.
    `tree_nodes`: rows of a verify pass, the pending token included (32 keeps the GEMMs at M = 32).
    `two_level`: before each exact pass, a Q pass on the W12 8-bit view marks a path, the drafter drafts again
    from its end, and the exact pass verifies both (docs/engine.md); off by default: whether it pays depends
    on the regime's measured costs.
    `positions`, `topk`: what the drafter proposes per step. `kernels`: see `Kernels.choose`. `graphs`
    (default: on a GPU): run each step as one CUDA graph (`GraphedStep`)."""

    ROW = 0  # the target's cache row

    def __init__(self, model: HybridModel, drafter=None, *, tree_nodes: int = 32, positions: int = 16,
                 topk: int = 4, graphs: bool | None = None, two_level: bool = False):
        if not 2 <= tree_nodes <= MAX_STEP_NODES:
            raise ValueError(f"specpilot.engine.Engine: tree_nodes={tree_nodes}; pass 2..{MAX_STEP_NODES} (the "
                             "pending token plus at least one draft node)")
        self.model = model
        self.tree_nodes, self.positions, self.topk = int(tree_nodes), int(positions), int(topk)
        if drafter == "self":
            drafter = SelfDrafter(model)
        elif drafter == "ngram":
            from ..drafters import NGramDrafter

            drafter = NGramDrafter(vocab_size=model.cfg.vocab)
        self.drafter = drafter
        self.two_level = bool(two_level)
        # the deepest accepted path a verify pass can hold: a two-level tree chains the Q path above the second tree
        self.max_depth = self.tree_nodes - 1 if self.two_level else self.positions
        self._stats = _Stats()
        self.graphs = model.device.type == "cuda" if graphs is None else bool(graphs)
        if self.graphs and model.device.type != "cuda":
            raise ValueError("specpilot.engine.Engine: graphs=True needs a CUDA device")
        self._graphs: dict[int, GraphedStep] = {}

    @classmethod
    def from_pretrained(cls, path, device=None, weights: str = "bf16", drafter="ngram", *, max_len: int = 4096,
                        kernels: str = "auto", head_screen: str = "auto", rows: int | None = None,
                        fused_glue: bool = False, **kw) -> "Engine":
        """Load `path` (config.json and BF16 or W12 safetensors) onto `device` (default: CUDA when present).
        `rows`: cache rows (requests decoded at once by `generate_batch`; the self-drafter needs 3).
        `fused_glue`: the element-wise work between operators as fused Triton kernels (`engine.fused`)."""
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        cfg, _ = load_config(path)
        tensors, _ = load_tensors(path)
        if rows is None:
            rows = 3 if drafter == "self" or isinstance(drafter, SelfDrafter) else 1
        model = HybridModel(cfg, tensors, device=device, fmt=weights, kernels=Kernels.choose(device, kernels),
                            rows=rows, max_len=max_len, head_screen=head_screen, fused_glue=fused_glue)
        return cls(model, drafter, **kw)

    # ---- public ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Per kind of step ("ar", "verify"): steps, tokens emitted, τ (tokens per step), the median step
        time; and the prefill's tokens and time. Counts since the last `reset_stats`."""
        return self._stats.summary()

    def reset_stats(self) -> None:
        self._stats = _Stats()

    def generate(self, prompt_ids, max_new_tokens: int, speculative: bool = True, *, callback=None) -> list[int]:
        """The greedy continuation of `prompt_ids` (at most `max_new_tokens` new tokens; it stops after the
        end-of-sequence token when the config names one). `callback(tokens)` sees each step's new tokens."""
        prompt = [int(t) for t in (prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else prompt_ids)]
        if not prompt:
            raise ValueError("specpilot.engine.Engine.generate: the prompt is empty; pass at least one token id")
        V = self.model.cfg.vocab
        if min(prompt) < 0 or max(prompt) >= V:
            raise ValueError(f"specpilot.engine.Engine.generate: the prompt holds ids outside [0, {V}); pass ids of "
                             "this model's vocabulary")
        if speculative and self.drafter is None:
            raise ValueError("specpilot.engine.Engine.generate: speculative=True needs a drafter; build the engine "
                             "with drafter='ngram' or 'self', or pass speculative=False")
        ctx = self._start(prompt)
        out: list[int] = []
        eos = self.model.cfg.eos_token_id
        while len(out) < max_new_tokens:
            new = self._step(ctx, speculative)
            if callback is not None:
                callback(new[:max_new_tokens - len(out)])
            for t in new:
                out.append(t)
                if t == eos or len(out) == max_new_tokens:
                    return out
            ctx.extend(new)
        return out

    def score(self, ids, chunk: int = MAX_STEP_NODES) -> torch.Tensor:
        """Teacher forcing: fp32 logits [len(ids), vocab] of the next token after every prefix of `ids`,
        computed in passes of `chunk` tokens (chunk=1 is the autoregressive decode path)."""
        ids = [int(t) for t in ids]
        self.model.reset_rows([self.ROW])
        if not ids:
            return torch.zeros(0, self.model.cfg.vocab, device=self.model.device)
        return self.model.consume(self.ROW, 0, ids, chunk=chunk, logits=True)

    # ---- steps ----------------------------------------------------------------------------
    def _commit_all(self, step, n: int) -> None:
        dev = self.model.device
        self.model.commit(step, torch.arange(n, dtype=torch.int32, device=dev)[None],
                          torch.tensor([n], dtype=torch.int32, device=dev))

    def capture(self) -> None:
        """Capture the autoregressive and the verify step (once; `generate` calls it)."""
        if self._graphs:
            return
        for nodes in (1, self.tree_nodes):
            g = GraphedStep(self.model, nodes, self.max_depth, row=self.ROW)
            g.capture()
            self._graphs[nodes] = g
        self.model.reset_rows([self.ROW])

    def _start(self, prompt: list[int]) -> list[int]:
        if self.graphs:
            self.capture()
        return self._prefill_row(self.ROW, prompt)

    def _prefill_row(self, row: int, prompt: list[int]) -> list[int]:
        """Reset cache row `row` and run the prompt but its last token into it; returns the context."""
        m = self.model
        m.reset_rows([row])
        t0 = time.perf_counter()
        body = prompt[:-1]
        m.consume(row, 0, body)
        _sync(m.device)
        if body:
            self._stats.steps.append(StepRecord("prefill", len(body), 0, time.perf_counter() - t0))
        return list(prompt)

    def generate_batch(self, prompts, max_new_tokens: int, *, budget: int | None = None) -> list[list[int]]:
        """Greedy continuations of several prompts, verified together under one node budget per step
        (`specpilot.engine.batch`; default 8 nodes per request). Needs a model with a cache row per prompt."""
        from .batch import generate_batch

        return generate_batch(self, prompts, max_new_tokens, budget=budget)

    def _draft(self, ctx: list[int], budget: int | None = None):
        tokens, scores = self.drafter.propose(ctx, self.positions, self.topk)
        return build_tree(tokens.cpu(), scores.cpu(), budget=self.tree_nodes - 1 if budget is None else budget)

    def _accept(self, tree, target: torch.Tensor, max_depth: int):
        """greedy_accept of one draft tree against the target's choices after the root and each node."""
        dev = self.model.device
        return greedy_accept(tree.tokens[None].to(dev), tree.parents[None].to(dev), tree.depths[None].to(dev),
                             torch.tensor([tree.n], dtype=torch.int32, device=dev), target[None], max_depth=max_depth)

    @staticmethod
    def _emitted(tree, accepted, accepted_len, bonus) -> list[int]:
        """The accepted path's tokens and the bonus token: the one host read of a step."""
        got = torch.cat([accepted_len.long(), accepted[0].long(), bonus.long()]).tolist()
        return [int(tree.tokens[i]) for i in got[1:1 + got[0]]] + [got[-1]]

    def _q_pass(self, ctx: list[int], tree) -> list[int]:
        """The first level of two-level verification: the target on its W12 8-bit view over the draft tree,
        caches untouched. Returns the path it accepts and its bonus token."""
        m = self.model
        toks, parents = pass_tree(ctx[-1], tree)
        step = m.plan([self.ROW], [len(ctx) - 1], [toks], [parents])
        target = m.logits(m.forward(step, q8=True), q8=True).argmax(-1)
        return self._emitted(tree, *self._accept(tree, target, self.positions))

    def _two_level_tree(self, ctx: list[int]):
        """Draft, run the Q pass, draft again from the end of its path: the exact pass verifies the Q path as a
        chain with the second tree below it."""
        first = self._draft(ctx)
        if first.n == 0:
            return first, 0
        chain = self._q_pass(ctx, first)[:self.tree_nodes - 1]
        room = self.tree_nodes - 1 - len(chain)
        second = self._draft(ctx + chain, budget=room) if room > 0 else None
        c, extra = len(chain), (second.n if second is not None else 0)
        tokens = chain + (second.tokens.tolist() if extra else [])
        parents = list(range(-1, c - 1)) + ([p + c if p >= 0 else c - 1 for p in second.parents.tolist()]
                                            if extra else [])
        depths = list(range(c)) + ([d + c for d in second.depths.tolist()] if extra else [])
        anc: list[int] = []
        for i, p in enumerate(parents):
            anc.append((anc[p] if p >= 0 else 0) | _bit(i))
        tree = DraftTree(tokens=torch.tensor(tokens, dtype=torch.int64),
                         parents=torch.tensor(parents, dtype=torch.int32),
                         depths=torch.tensor(depths, dtype=torch.int32),
                         scores=torch.zeros(len(tokens), dtype=torch.float64),
                         anc=torch.tensor(anc, dtype=torch.int64))
        return tree, c

    def _step(self, ctx: list[int], speculative: bool) -> list[int]:
        m, dev = self.model, self.model.device
        t0 = time.perf_counter()
        q_chain = 0
        if speculative and self.two_level:
            tree, q_chain = self._two_level_tree(ctx)
        else:
            tree = self._draft(ctx) if speculative else None
        n = tree.n if tree is not None else 0
        if self.graphs:
            g = self._graphs[self.tree_nodes if speculative else 1]
            g.load(len(ctx) - 1, ctx[-1], tree)
            target, accepted, accepted_len, bonus = g.replay()
            rows = g.nodes
        else:
            toks, parents = pass_tree(ctx[-1], tree)
            step = m.plan([self.ROW], [len(ctx) - 1], [toks], [parents])
            target = m.argmax(m.forward(step))  # [1 + n]: the target's choice after the root and after each node
            rows = len(toks)
            if n:
                accepted, accepted_len, bonus = self._accept(tree, target, self.max_depth)
                m.commit_accepted(step, accepted, accepted_len)
            else:
                self._commit_all(step, 1)
        if speculative and (n or self.graphs):
            new = self._emitted(tree, accepted, accepted_len, bonus)
        else:
            new = [int(target[0])]
        if q_chain:
            # Q pass against the exact pass where both judged the same prefix: the root and the Q path's nodes
            exact = target[:q_chain].tolist()
            want = tree.tokens[:q_chain].tolist()
            self._stats.q_agree += sum(int(a == b) for a, b in zip(exact, want))
            self._stats.q_total += q_chain
        _sync(dev)
        self._stats.steps.append(StepRecord("verify" if speculative else "ar", rows, len(new),
                                            time.perf_counter() - t0))
        return new


class SelfDrafter:
    """The target drafting for itself on its W12 8-bit view (`w12.matmul_q8`): `positions` greedy
    autoregressive steps, each proposing its top-k tokens with their log-probabilities.

    It keeps its own cache rows in the target's model: row 1 holds the context it has caught up with
    (all but the pending token), row 2 is the scratch copy it drafts on; the drafted tokens' keys and
    values go to row 1's slots past its context and are overwritten as the context grows. The scores
    are conditioned on the greedy draft path above them: the tree builder treats them as marginal, an
    approximation that only affects which nodes are drafted, never what is accepted."""

    COMMITTED, SCRATCH = 1, 2

    def __init__(self, model: HybridModel):
        if model.rows < 3:
            raise ValueError("specpilot.engine.SelfDrafter: the model needs 3 cache rows (target, drafter, "
                             "scratch); build it with rows=3")
        self.model = model
        self.seen: list[int] = []

    def _catch_up(self, ctx: list[int]) -> None:
        m = self.model
        body = ctx[:-1]
        if body[:len(self.seen)] != self.seen:
            m.reset_rows([self.COMMITTED])
            self.seen = []
        m.consume(self.COMMITTED, len(self.seen), body[len(self.seen):], q8=True)
        self.seen = list(body)

    def propose(self, context, positions: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        ctx = [int(t) for t in (context.tolist() if isinstance(context, torch.Tensor) else context)]
        tokens = torch.zeros(positions, k, dtype=torch.int64)
        scores = torch.full((positions, k), float("-inf"), dtype=torch.float32)
        if not ctx:
            return tokens, scores
        m = self.model
        self._catch_up(ctx)
        m.copy_row(self.COMMITTED, self.SCRATCH)
        dev, base = m.device, len(ctx) - 1
        tok = ctx[-1]
        k = min(k, m.cfg.vocab)
        for d in range(positions):
            if base + d + 1 > m.max_len:
                break
            step = m.plan([self.SCRATCH], [base + d], [[tok]], [[-1]], kv_rows=[self.COMMITTED])
            logp = torch.log_softmax(m.logits(m.forward(step, q8=True))[0], -1)
            m.commit(step, torch.zeros(1, 1, dtype=torch.int32, device=dev),
                     torch.ones(1, dtype=torch.int32, device=dev))
            v, i = torch.topk(logp, k)
            tokens[d, :k], scores[d, :k] = i.cpu(), v.float().cpu()
            tok = int(i[0])
        return tokens, scores


# The widest top-2 logit margin at which the speculative and the autoregressive outputs may part: the two
# passes reduce in different orders (other GEMM shapes, other split-KV schedules, WY versus sequential state
# updates), so logits that differ in their last bits can swap a near-tie. The SpecPilot paper measured at
# most 0.232 nats between stock and autoregressive log-probabilities at the first divergence.
NEAR_TIE = 0.25


@dataclass
class LosslessReport:
    """Speculative versus autoregressive greedy output of one prompt (`check_lossless`)."""

    autoregressive: list[int]
    speculative: list[int]
    divergence: int | None  # index of the first differing token, None when identical
    margin: float | None  # the autoregressive top-2 logit margin there
    tau: float  # tokens per verify step of the speculative run

    @property
    def ok(self) -> bool:
        """Identical, or parted first at a near-tie (margin < NEAR_TIE)."""
        return self.divergence is None or (self.margin is not None and self.margin < NEAR_TIE)


def check_lossless(engine: Engine, prompt, max_new_tokens: int) -> LosslessReport:
    """Decode `prompt` autoregressively and speculatively and compare token for token. At a divergence,
    the autoregressive logits there are recomputed on the autoregressive path (`score(chunk=1)`) and their
    top-2 margin reported."""
    prompt = [int(t) for t in prompt]
    ar = engine.generate(prompt, max_new_tokens, speculative=False)
    engine.reset_stats()
    sp = engine.generate(prompt, max_new_tokens, speculative=True)
    tau = engine.stats().get("verify", {}).get("tau", float("nan"))
    div = next((i for i, (a, b) in enumerate(zip(ar, sp)) if a != b), None)
    if div is None and len(ar) != len(sp):
        div = min(len(ar), len(sp))
    margin = None
    if div is not None:
        logits = engine.score(prompt + ar[:div], chunk=1)[-1]
        top = logits.topk(2).values
        margin = float(top[0] - top[1])
    return LosslessReport(ar, sp, div, margin, tau)
