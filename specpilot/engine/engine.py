"""`Engine`: greedy decoding of a Qwen3.5 hybrid, autoregressive or speculative with draft trees.

A request's context is c_0 .. c_{n-1}. The caches hold c_0 .. c_{n-2}; the last token c_{n-1} is
*pending*: every pass processes it as the root of its tree. An autoregressive step is the pending
token alone. A speculative step drafts `positions` positions of `topk` candidates below it, keeps the
best `tree_nodes - 1` of them as a tree (`specpilot.engine.spec.tree.build_tree`), and verifies root and tree in
one pass: the target's argmax after the root and after every node gives `greedy_accept` the longest
path the target itself would have produced, then the bonus token. The caches advance by the root and
that path (`HybridModel.commit`); the bonus becomes the pending token. Every emitted token is the
target's argmax after a prefix of exactly the tokens emitted before it: the output is greedy decoding's.

Prefill runs the prompt but its last token as chains of up to 64 nodes through the same pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import torch

from . import inputs
from .batch import generate_batch
from .graphs import GraphedStep, pass_tree
from .loader import load_config, load_tensors
from .model import MAX_STEP_NODES, HybridModel, Kernels
from .records import StepRecord, _Stats, nan_logits_error
from .self_draft import GraphedDraft, SelfDrafter
from .spec.accept import greedy_accept
from .spec.tree import DraftTree, _bit, build_tree

__all__ = ["Engine", "SelfDrafter", "LosslessReport", "check_lossless", "NEAR_TIE", "shipped_heads"]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Engine:
    """Greedy decoding: `generate` serves one request, `generate_batch` several under one node budget
    (`specpilot.engine.batch`); see the module docstring.

    `drafter`: "ngram" (`specpilot.engine.spec.drafters.NGramDrafter`), "self" (`SelfDrafter`: the target on its W12
    8-bit view), "heads" (`from_pretrained` only: `specpilot.engine.spec.heads.HeadsDrafter`, trained heads on the
    target's last hidden state), "heads-markov" (`from_pretrained` only: their Markov variant, whose rows also read
    the draft token above; it grows its own tree), None, or any object with `propose(context, positions, k)`; one with
    `needs_hidden = True` is also passed `hidden=`, the target's final-normed hidden state of the token before the
    pending one.
    `tree_nodes`: rows of a verify pass, the pending token included (32 keeps the GEMMs at M = 32).
    `two_level`: before each exact pass, a Q pass on the W12 8-bit view marks a path, the drafter drafts again
    from its end, and the exact pass verifies both (docs/engine.md); off by default: whether it pays depends
    on the regime's measured costs.
    `positions`, `topk`: what the drafter proposes per step. `kernels`: see `Kernels.choose`. `graphs`
    (default: on a GPU, unless a layer kind runs a reference path: `HybridModel.paths`): run each step as one CUDA
    graph (`GraphedStep`), and the self-drafter's drafting as CUDA graphs (`GraphedDraft`; the eager
    `SelfDrafter.propose` otherwise).

    Prompts are token ids, or a str where the model has a text codec (`encode`): its checkpoint's tokenizer, or
    bytes for a byte-level model such as the shipped `specpilot.models.tiny_stdlib_path()`. Every public method
    checks its arguments and raises TypeError / ValueError "specpilot.engine.<fn>: what is wrong; how to fix"
    before any work."""

    ROW = 0  # the target's cache row

    def __init__(self, model: HybridModel, drafter=None, *, tree_nodes: int = 32, positions: int = 16,
                 topk: int = 4, graphs: bool | None = None, two_level: bool = False):
        fn = "specpilot.engine.Engine"
        if not isinstance(model, HybridModel):
            raise TypeError(f"{fn}: model is a {type(model).__name__}; pass a HybridModel, or load a checkpoint with "
                            "Engine.from_pretrained(path)")
        drafter = inputs.drafter(fn, drafter)
        tree_nodes = inputs.count(fn, "tree_nodes", tree_nodes, 2, MAX_STEP_NODES)
        positions = inputs.count(fn, "positions", positions)
        topk = inputs.count(fn, "topk", topk)
        graphs = inputs.flag(fn, "graphs", graphs, none_ok=True)
        two_level = inputs.flag(fn, "two_level", two_level)
        if drafter in ("heads", "heads-markov"):
            raise ValueError(f"{fn}: drafter={drafter!r} loads the heads trained for a checkpoint; use "
                             f"Engine.from_pretrained(path, drafter={drafter!r}), or pass "
                             "specpilot.engine.spec.heads.HeadsDrafter.load(file)")
        if drafter == "self" and model.rows < 3:
            raise ValueError(f"{fn}: drafter='self' needs 3 cache rows (target, drafter, scratch) but the model has "
                             f"{model.rows}; build it with rows=3 (Engine.from_pretrained does when drafter='self')")
        self.model = model
        self.codec = inputs.text_codec(model.cfg.vocab)  # from_pretrained: the checkpoint's tokenizer where it has one
        self.tree_nodes, self.positions, self.topk = int(tree_nodes), int(positions), int(topk)
        if drafter == "self":
            drafter = SelfDrafter(model)
        elif drafter == "ngram":
            from .spec.drafters import NGramDrafter

            drafter = NGramDrafter(vocab_size=model.cfg.vocab)
        self.drafter = drafter
        self.two_level = bool(two_level)
        # a drafter that reads the target's hidden state (needs_hidden): the final-normed state of the token before
        # the pending one, kept from the last pass (prefill or step); None before any pass or after a 1-token prompt
        self.needs_hidden = bool(getattr(drafter, "needs_hidden", False))
        self._hidden: torch.Tensor | None = None
        if self.needs_hidden:
            width = getattr(getattr(drafter, "dims", None), "hidden", model.cfg.hidden)
            if width != model.cfg.hidden:
                raise ValueError(f"{fn}: the drafter reads hidden states of {width} elements but the model's hidden "
                                 f"size is {model.cfg.hidden}; pass heads trained for this model")
            if two_level:
                raise ValueError(f"{fn}: two_level=True redrafts from the Q pass's path, whose exact hidden state a "
                                 f"hidden-state drafter ({type(drafter).__name__}) does not get; pass two_level=False "
                                 "or drafter='ngram'")
        # the deepest accepted path a verify pass can hold: a two-level tree chains the Q path above the second tree
        self.max_depth = self.tree_nodes - 1 if self.two_level else self.positions
        self._stats = _Stats()
        uncapturable = model.paths.host_syncs  # a reference path chosen when the model was built (Paths.decide)
        self.graphs = model.device.type == "cuda" and uncapturable is None if graphs is None else bool(graphs)
        if self.graphs and model.device.type != "cuda":
            raise ValueError("specpilot.engine.Engine: graphs=True needs a CUDA device; pass graphs=None or False on "
                             "the CPU")
        if self.graphs and uncapturable is not None:
            raise ValueError(f"specpilot.engine.Engine: graphs=True cannot capture this model's steps: {uncapturable}; "
                             "pass graphs=None or False (eager steps)")
        self._graphs: dict[int, GraphedStep] = {}
        self._draft_graph: GraphedDraft | None = None  # captured with the steps when the drafter is the self-drafter
        self._batch_graphs: dict = {}  # (rows, budget) -> GraphedBatchStep, captured by generate_batch(graphs=True)

    @classmethod
    def from_pretrained(cls, path, device=None, weights: str = "bf16", drafter="ngram", *, max_len: int = 4096,
                        kernels: str = "auto", head_screen: str = "auto", rows: int | None = None,
                        fused_glue: bool | None = None, **kw) -> "Engine":
        """Load `path` (config.json and BF16 or W12 safetensors) onto `device` (default: CUDA when present).
        `rows`: cache rows (requests decoded at once by `generate_batch`; the self-drafter needs 3).
        `fused_glue`: the element-wise work between operators as fused Triton kernels (`engine.fused`); None (the
        default): on a GPU with the operators' kernels (`kernels` "auto" or "kernels"), and the torch glue, the
        reference path, elsewhere.
        `**kw`: the constructor's `tree_nodes`, `positions`, `topk`, `graphs`, `two_level`."""
        import lmhead

        fn = "specpilot.engine.Engine.from_pretrained"
        if not isinstance(path, (str, Path)) and not hasattr(path, "__fspath__"):
            raise TypeError(f"{fn}: path={path!r} is a {type(path).__name__}; pass a checkpoint folder (str or "
                            "pathlib.Path), e.g. specpilot.models.tiny_stdlib_path()")
        if not Path(path).is_dir():
            raise FileNotFoundError(f"{fn}: {path} is not a folder; pass a checkpoint folder (config.json and "
                                    "safetensors), e.g. specpilot.models.tiny_stdlib_path() for the shipped tiny model")
        device = inputs.device(fn, device)
        if weights not in ("bf16", "w12"):
            raise ValueError(f"{fn}: weights={weights!r}; pass 'bf16' or 'w12'")
        drafter = inputs.drafter(fn, drafter)
        max_len = inputs.count(fn, "max_len", max_len, 2)
        if kernels not in ("auto", "reference", "kernels"):
            raise ValueError(f"{fn}: kernels={kernels!r}; pass 'auto', 'reference' or 'kernels'")
        if head_screen not in ("auto", *lmhead.SCREENS):
            raise ValueError(f"{fn}: head_screen={head_screen!r}; pass 'auto' or one of {', '.join(lmhead.SCREENS)}")
        if head_screen == "w12" and weights != "w12":
            raise ValueError(f"{fn}: head_screen='w12' screens with the W12 head's 8-bit view but weights={weights!r}; "
                             "pass weights='w12', or head_screen='auto' or 'int8'")
        if rows is not None:
            rows = inputs.count(fn, "rows", rows)
        fused_glue = inputs.flag(fn, "fused_glue", fused_glue, none_ok=True)
        if fused_glue is None:
            fused_glue = device.type == "cuda" and kernels != "reference"
        unknown = sorted(set(kw) - {"tree_nodes", "positions", "topk", "graphs", "two_level"})
        if unknown:
            raise TypeError(f"{fn}: unknown keyword argument(s) {', '.join(unknown)}; pass tree_nodes, positions, "
                            "topk, graphs or two_level (Engine's own) besides the loader's")
        selfish = drafter == "self" or isinstance(drafter, SelfDrafter)
        if rows is None:
            rows = 3 if selfish else 1
        elif selfish and rows < 3:
            raise ValueError(f"{fn}: drafter='self' needs rows >= 3 (target, drafter, scratch), got rows={rows}; "
                             "pass rows=3 or leave rows=None")
        cfg, _ = load_config(path)
        tensors, _ = load_tensors(path)
        model = HybridModel(cfg, tensors, device=device, fmt=weights, kernels=Kernels.choose(device, kernels),
                            rows=rows, max_len=max_len, head_screen=head_screen, fused_glue=fused_glue)
        if drafter in ("heads", "heads-markov"):
            drafter = shipped_heads(fn, model, path, markov=drafter == "heads-markov")
        eng = cls(model, drafter, **kw)
        eng.codec = inputs.text_codec(cfg.vocab, path)
        return eng

    # ---- public ---------------------------------------------------------------------------
    def stats(self) -> dict:
        """Per kind of step ("ar", "verify", "batch"): steps, tokens (what `generate` returned), τ (tokens per
        step), the median and the mean step time, tokens per second (tokens / total time, so it equals
        τ / mean step time); and the prefill's tokens and time. Counts since the last `reset_stats`."""
        return self._stats.summary()

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`: the checkpoint's tokenizer, or UTF-8 bytes for a byte-level model (vocabulary of
        256, as the shipped tiny model)."""
        if not isinstance(text, str):
            raise TypeError(f"specpilot.engine.Engine.encode: text is a {type(text).__name__}; pass a str")
        return inputs.token_ids("specpilot.engine.Engine.encode", text, self.model.cfg.vocab,
                                self.codec.encode if self.codec is not None else None, what="text", empty_ok=True)

    def decode(self, ids) -> str:
        """The text of token ids (the inverse of `encode`; bytes that are not UTF-8 decode as U+FFFD)."""
        fn = "specpilot.engine.Engine.decode"
        ids = inputs.token_ids(fn, ids, self.model.cfg.vocab, what="ids", empty_ok=True)
        if self.codec is None:
            raise ValueError(f"{fn}: this model has no text codec (no tokenizer files beside its config, and a "
                             "vocabulary larger than bytes); decode with the model's own tokenizer")
        return self.codec.decode(ids)

    def _prompt(self, fn: str, prompt, what: str = "the prompt", empty_ok: bool = False) -> list[int]:
        return inputs.token_ids(fn, prompt, self.model.cfg.vocab, self.codec.encode if self.codec else None,
                                what=what, empty_ok=empty_ok)

    def reset_stats(self) -> None:
        self._stats = _Stats()

    def generate(self, prompt_ids, max_new_tokens: int, speculative: bool = True, *, callback=None) -> list[int]:
        """The greedy continuation of `prompt_ids` (at most `max_new_tokens` new tokens; it stops after the
        end-of-sequence token when the config names one). `prompt_ids`: token ids (a list or a 1-D integer
        tensor), or a str for a model with a text codec (`encode`). `callback(tokens)` sees each step's new
        tokens, exactly those returned."""
        fn = "specpilot.engine.Engine.generate"
        prompt = self._prompt(fn, prompt_ids)
        max_new_tokens = inputs.count(fn, "max_new_tokens", max_new_tokens, 0)
        speculative = inputs.flag(fn, "speculative", speculative)
        if callback is not None and not callable(callback):
            raise TypeError(f"{fn}: callback={callback!r} is not callable; pass a function of the new tokens, or None")
        if speculative and self.drafter is None:
            raise ValueError(f"{fn}: speculative=True needs a drafter; build the engine with drafter='ngram', "
                             "'self' or 'heads', or pass speculative=False")
        self._check_room(fn, len(prompt), max_new_tokens, speculative)
        ctx = self._start(prompt)
        out: list[int] = []
        eos = self.model.cfg.eos_token_id
        while len(out) < max_new_tokens:
            new = self._step(ctx, speculative)
            if any(t < 0 for t in new):  # lmhead.NAN_ID: a NaN logit; the step's next input is not a token
                raise nan_logits_error(fn, f"at new token {len(out) + new.index(min(new))}")
            kept = new[:max_new_tokens - len(out)]
            if eos in kept:
                kept = kept[:kept.index(eos) + 1]
            self._stats.steps[-1].emitted = len(kept)  # what is returned: the step may have accepted more
            if callback is not None:
                callback(kept)
            out.extend(kept)
            if len(kept) < len(new) or (kept and kept[-1] == eos):
                break
            ctx.extend(new)
        return out

    def _check_room(self, fn: str, prompt_len: int, max_new_tokens: int, speculative: bool) -> None:
        """The caches hold max_len tokens per request: the prompt, the new tokens but the last, and a verify pass's
        draft nodes below the pending token."""
        need = prompt_len + max(max_new_tokens - 1, 0) + (self.tree_nodes - 1 if speculative else 0)
        if need > self.model.max_len:
            raise ValueError(f"{fn}: a {prompt_len}-token prompt plus {max_new_tokens} new tokens"
                             + (f" and a {self.tree_nodes}-row verify pass" if speculative else "")
                             + f" needs {need} cache slots but max_len={self.model.max_len}; pass fewer tokens, or "
                             f"load with Engine.from_pretrained(..., max_len={need})")

    def score(self, ids, chunk: int = MAX_STEP_NODES) -> torch.Tensor:
        """Teacher forcing: fp32 logits [len(ids), vocab] of the next token after every prefix of `ids`,
        computed in passes of `chunk` tokens (chunk=1 is the autoregressive decode path)."""
        fn = "specpilot.engine.Engine.score"
        ids = self._prompt(fn, ids, what="ids", empty_ok=True)
        chunk = inputs.count(fn, "chunk", chunk, 1, MAX_STEP_NODES)
        if len(ids) > self.model.max_len:
            raise ValueError(f"{fn}: {len(ids)} ids but max_len={self.model.max_len}; score fewer, or load with "
                             f"Engine.from_pretrained(..., max_len={len(ids)})")
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
        """Capture the autoregressive and the verify step, and the self-drafter's passes when it drafts (once;
        `generate` calls it)."""
        if not self.graphs:
            raise ValueError("specpilot.engine.Engine.capture: this engine runs its steps eagerly (graphs=False, or "
                             "a CPU model); build it on a CUDA device with graphs=None or True to capture")
        if self._graphs:
            return
        for nodes in (1, self.tree_nodes):
            g = GraphedStep(self.model, nodes, self.max_depth, row=self.ROW)
            g.capture()
            self._graphs[nodes] = g
        self.model.reset_rows([self.ROW])
        if isinstance(self.drafter, SelfDrafter):
            # a verify step adds its deepest accepted path and the bonus token: the longest catch-up after a draft
            dg = GraphedDraft(self.drafter, self.positions, self.topk,
                              catch_up=min(self.max_depth + 1, MAX_STEP_NODES))
            dg.capture()
            self._draft_graph = dg

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
        hidden = m.consume(row, 0, body, hidden=self.needs_hidden and row == self.ROW)
        if row == self.ROW:
            self._hidden = hidden[-1].clone() if hidden is not None and len(hidden) else None
        _sync(m.device)
        if body:
            self._stats.steps.append(StepRecord("prefill", len(body), 0, time.perf_counter() - t0))
        return list(prompt)

    def generate_batch(self, prompts, max_new_tokens: int, *, budget=None,
                       max_rows: int | None = None, graphs: bool | None = None) -> list[list[int]]:
        """Greedy continuations of several prompts, verified together under one node budget per step
        (`specpilot.engine.batch`; default 8 nodes per running request; `budget="auto"` or a sequence of budgets: each
        step's budget picked among the candidates by their measured step costs). At most `max_rows` requests run at
        once, one cache row each (default: the model's `rows`); the other prompts wait and each takes the row of a
        request that finished. `prompts`: a list of prompts, each as `generate` takes one. `graphs`: each step one CUDA
        graph (`specpilot.engine.batch.generate_batch`)."""
        return generate_batch(self, prompts, max_new_tokens, budget=budget, max_rows=max_rows, graphs=graphs)

    def _draft(self, ctx: list[int], budget: int | None = None):
        nodes = self.tree_nodes - 1 if budget is None else budget
        if getattr(self.drafter, "conditional", False):  # candidates that depend on their parent: its own tree
            kw = {"hidden": self._hidden} if self.needs_hidden else {}
            return self.drafter.propose_tree(ctx, self.positions, self.topk, nodes, **kw)
        if self._draft_graph is not None:
            tokens, scores = self._draft_graph.propose(ctx)
        elif self.needs_hidden:
            tokens, scores = self.drafter.propose(ctx, self.positions, self.topk, hidden=self._hidden)
        else:
            tokens, scores = self.drafter.propose(ctx, self.positions, self.topk)
        return build_tree(tokens.cpu(), scores.cpu(), budget=nodes)

    def _accept(self, tree, target: torch.Tensor, max_depth: int):
        """greedy_accept of one draft tree against the target's choices after the root and each node."""
        dev = self.model.device
        return greedy_accept(tree.tokens[None].to(dev), tree.parents[None].to(dev), tree.depths[None].to(dev),
                             torch.tensor([tree.n], dtype=torch.int32, device=dev), target[None], max_depth=max_depth)

    @staticmethod
    def _read(tree, accepted, accepted_len, bonus) -> tuple[list[int], int]:
        """The accepted path's tokens and the bonus token (the one host read of a step), and the pass row of the
        last accepted node (0, the root, when none was accepted): the node whose argmax is the bonus."""
        got = torch.cat([accepted_len.long(), accepted[0].long(), bonus.long()]).tolist()
        path = got[1:1 + got[0]]
        return [int(tree.tokens[i]) for i in path] + [got[-1]], (path[-1] + 1 if path else 0)

    def _q_pass(self, ctx: list[int], tree) -> list[int]:
        """The first level of two-level verification: the target on its W12 8-bit view over the draft tree,
        caches untouched. Returns the path it accepts and its bonus token."""
        m = self.model
        toks, parents = pass_tree(ctx[-1], tree)
        step = m.plan([self.ROW], [len(ctx) - 1], [toks], [parents])
        target = m.logits(m.forward(step, q8=True), q8=True).argmax(-1)
        return self._read(tree, *self._accept(tree, target, self.positions))[0]

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
            target, accepted, accepted_len, bonus, hidden = g.replay()
            rows = g.nodes
        else:
            toks, parents = pass_tree(ctx[-1], tree)
            step = m.plan([self.ROW], [len(ctx) - 1], [toks], [parents])
            hidden = m.forward(step)
            target = m.argmax(hidden)  # [1 + n]: the target's choice after the root and after each node
            rows = len(toks)
            if n:
                accepted, accepted_len, bonus = self._accept(tree, target, self.max_depth)
                m.commit_accepted(step, accepted, accepted_len)
            else:
                self._commit_all(step, 1)
        last = 0  # the pass row whose argmax is the bonus token
        if speculative and (n or self.graphs):
            new, last = self._read(tree, accepted, accepted_len, bonus)
        else:
            new = [int(target[0])]
        if self.needs_hidden:
            self._hidden = hidden[last].clone()
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


def shipped_heads(fn: str, model: HybridModel, path, markov: bool = False):
    """The shipped trained heads (`specpilot.models.tiny_stdlib_heads_path()`) for `model`, which must be the
    model they were trained for: the SHA-256 of its BF16 embedding matrix equals the one the weights file records
    (a repacked copy of the shipped checkpoint passes; any other model is refused with the fix)."""
    from ..models import HEADS_FILE, tiny_stdlib_heads_path
    from .spec.heads import HeadsDrafter, embed_sha256

    file = tiny_stdlib_heads_path(markov) / HEADS_FILE
    drafter = HeadsDrafter.load(file)
    if drafter.target_embed_sha256 != embed_sha256(model.embed):
        raise ValueError(f"{fn}: drafter={'heads-markov' if markov else 'heads'!r} has trained heads for the shipped "
                         f"tiny model only ({file}) and {path} "
                         "holds another model (its embedding differs); train heads for it with python -m "
                         "specpilot.models.train_heads --target PATH --out DIR and pass "
                         "drafter=HeadsDrafter.load('DIR/heads.safetensors')")
    return drafter


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
    fn = "specpilot.engine.check_lossless"
    if not isinstance(engine, Engine):
        raise TypeError(f"{fn}: engine is a {type(engine).__name__}; pass an Engine (Engine.from_pretrained(path))")
    prompt = engine._prompt(fn, prompt)
    max_new_tokens = inputs.count(fn, "max_new_tokens", max_new_tokens)
    if engine.drafter is None:
        raise ValueError(f"{fn}: the engine has no drafter, so there is no speculative output to compare; build it "
                         "with drafter='ngram' or 'self'")
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
