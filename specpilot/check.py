"""Token forcing (`specpilot check`): does a configuration still produce the stock path's greedy tokens?

The *stock path* is autoregressive BF16 with an fp32 head: `Engine(weights="bf16")`, its logits from
`Engine.score(ids, chunk=1)`, one token per pass (the engine's head gives fp32 logits). A *candidate* is
any callable `ids -> fp32 logits [len(ids), vocab]` under teacher forcing; `engine_path`, `stock_path`,
`w12_path`, `tree_path`, `kernels_path` and `planted_fault` build the configurations a user checks.

For each prompt the stock path's own greedy continuation (`Engine.generate(prompt, n, speculative=False)`)
is the *reference stream*. `prompt + stream` is forced through the stock path and through the candidate;
at each of the n generated positions j (the logits row len(prompt) - 1 + j, which predicts stream[j]):

* mismatch: the row's argmax is not the forced reference token;
* margin: the row's top logit minus its logit for the reference token (0 where the reference wins);
* large-margin event: margin > `large_margin` (default `LARGE_MARGIN` = `specpilot.engine.NEAR_TIE`,
  0.25). NEAR_TIE is the widest top-2 margin at which a different reduction order may swap the argmax
  (the SpecPilot paper measured at most 0.232 nats between stock and autoregressive log-probabilities
  at the first divergence), so a configuration that prefers another token by more than that disagrees
  beyond rounding. Every large-margin event is also a mismatch.

The rule (`decide`, the paper's): reject when the candidate's mismatch rate is more than `POINTS` (0.5)
percentage points above the stock path's, or when it has more large-margin events than the stock path.
Exactly +0.5 points, or equal counts, accept.

Beside it, a task-accuracy-style metric on the same prompts: the held-out text that follows each prompt
is forced through both, and the next-byte accuracy of each one's greedy prediction against that text
(not against the reference stream) is compared, with paired bootstrap 95% intervals of the difference
(candidate - stock; fixed seed), resampling prompts (the independent units, as tasks are in a task
benchmark) and, for comparison, resampling positions. The paper's point is that such an interval can
cover 0 for a fault that token forcing rejects; `CheckReport.accuracy` says whether it does here.

The oracle against `transformers` (`transformers_logits`, `torch_reference_path`): a transformers model's logits on
transformers' own torch code, with or without fla and causal-conv1d installed, on the CPU and on the GPU; the engine
tests compare the stock path with it (tests/engine/test_oracle.py).
"""

from __future__ import annotations

import contextlib
import inspect
import json
import math
import sys
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Callable

import torch

from .engine import NEAR_TIE, Engine
from .engine.model import MAX_STEP_NODES

__all__ = ["POINTS", "LARGE_MARGIN", "STOCK_CHUNK", "TREE_CHUNK", "CANDIDATES", "EngineCandidate", "PlantedFault",
           "engine_path", "stock_path", "w12_path", "tree_path", "kernels_path", "planted_fault", "make_candidate",
           "heldout_prompts", "Reference", "reference", "Tally", "PromptResult", "Accuracy", "CheckReport", "decide",
           "run", "bootstrap_interval", "ReferencePath", "torch_reference_path", "TransformersLogits",
           "transformers_logits"]

POINTS = 0.5  # the paper's tolerance: percentage points of mismatch rate above the stock path's
LARGE_MARGIN = NEAR_TIE  # logits; see the module docstring
STOCK_CHUNK = 1  # the stock path: one token per pass (the autoregressive decode path)
TREE_CHUNK = MAX_STEP_NODES  # the prefill / tree path: the pass a speculative verify step runs
RESAMPLES = 10_000
CANDIDATES = ("stock", "w12", "tree", "reference-kernels", "planted-fault")

Candidate = Callable[[list], torch.Tensor]


def _err(fn: str, what: str, fix: str) -> ValueError:
    return ValueError(f"specpilot.check.{fn}: {what}; {fix}")


# ---- candidates --------------------------------------------------------------------------------------


class EngineCandidate:
    """Teacher forcing through an `Engine`: `score(ids, chunk)`. `chunk=1` is the autoregressive decode
    path, `chunk=TREE_CHUNK` the prefill / tree path."""

    def __init__(self, engine: Engine, chunk: int = STOCK_CHUNK, name: str | None = None):
        if not isinstance(engine, Engine):
            raise TypeError(f"specpilot.check.EngineCandidate: engine is a {type(engine).__name__}; pass a "
                            "specpilot.engine.Engine (Engine.from_pretrained)")
        if not 1 <= int(chunk) <= MAX_STEP_NODES:
            raise _err("EngineCandidate", f"chunk={chunk}", f"pass 1..{MAX_STEP_NODES} tokens per pass")
        self.engine, self.chunk = engine, int(chunk)
        m = engine.model
        self.name = name or f"{m.fmt}-chunk{self.chunk}"
        self.describe = (f"Engine(weights={m.fmt!r}, kernels={m.kernels}) on {m.device}, score(chunk={self.chunk})")

    def __call__(self, ids) -> torch.Tensor:
        return self.engine.score(ids, chunk=self.chunk)


class PlantedFault:
    """`candidate`'s logits plus `bias` on the vocabulary ids 0, every, 2 * every, ... (every id i with
    i % every == 0). The paper's planted fault is bias=2 on every 7th id: 0, 7, 14, ..., 252 of a
    256-byte vocabulary (37 ids)."""

    def __init__(self, candidate: Candidate, bias: float = 2.0, every: int = 7):
        if not callable(candidate):
            raise TypeError(f"specpilot.check.planted_fault: candidate is a {type(candidate).__name__}; pass a "
                            "callable ids -> fp32 logits [len(ids), vocab]")
        if not math.isfinite(float(bias)):
            raise _err("planted_fault", f"bias={bias}", "pass a finite logit offset (the paper's is 2.0)")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise _err("planted_fault", f"every={every!r}", "pass an int >= 1 (the paper's is 7: ids 0, 7, 14, ...)")
        self.candidate, self.bias, self.every = candidate, float(bias), every
        base = getattr(candidate, "name", "candidate")
        self.name = f"planted-fault({base}, bias={self.bias:g}, every={every})"
        self.describe = (f"{getattr(candidate, 'describe', base)}, plus {self.bias:g} on the logits of vocabulary ids "
                         f"0, {every}, {2 * every}, ... (id % {every} == 0)")

    def ids(self, vocab: int) -> list[int]:
        """The biased vocabulary ids."""
        return list(range(0, vocab, self.every))

    def __call__(self, ids) -> torch.Tensor:
        logits = self.candidate(ids).clone()
        logits[:, ::self.every] += self.bias
        return logits


def planted_fault(candidate: Candidate, bias: float = 2.0, every: int = 7) -> PlantedFault:
    """`candidate` with `bias` added to the logits of vocabulary ids 0, every, 2 * every, ... (`PlantedFault`)."""
    return PlantedFault(candidate, bias, every)


def _model_path(path):
    if path is None:
        from .models import tiny_stdlib_path

        return tiny_stdlib_path()
    return Path(path)


def engine_path(path=None, *, device=None, weights: str = "bf16", kernels: str = "auto", chunk: int = STOCK_CHUNK,
                name: str | None = None) -> EngineCandidate:
    """A candidate on a fresh engine of checkpoint `path` (default: the shipped tiny model)."""
    if weights not in ("bf16", "w12"):
        raise _err("engine_path", f"weights={weights!r}", "pass 'bf16' or 'w12'")
    if kernels not in ("auto", "reference", "kernels"):
        raise _err("engine_path", f"kernels={kernels!r}", "pass 'auto', 'reference' or 'kernels'")
    eng = Engine.from_pretrained(_model_path(path), device=device, weights=weights, drafter=None, kernels=kernels)
    return EngineCandidate(eng, chunk, name)


def stock_path(path=None, *, device=None, kernels: str = "auto") -> EngineCandidate:
    """The stock path: BF16 weights, fp32 head, one token per pass."""
    return engine_path(path, device=device, weights="bf16", kernels=kernels, chunk=STOCK_CHUNK, name="stock")


def w12_path(path=None, *, device=None, kernels: str = "auto") -> EngineCandidate:
    """W12 weights (lossless BF16 in 12 bits, `w12.matmul`), one token per pass."""
    return engine_path(path, device=device, weights="w12", kernels=kernels, chunk=STOCK_CHUNK, name="w12")


def tree_path(stock: EngineCandidate) -> EngineCandidate:
    """The stock engine forced TREE_CHUNK tokens per pass: the pass that prefill and speculative
    verification run (chains of up to 64 nodes through the tree kernels)."""
    if not isinstance(stock, EngineCandidate):
        raise TypeError(f"specpilot.check.tree_path: stock is a {type(stock).__name__}; pass the stock "
                        "EngineCandidate (stock_path)")
    return EngineCandidate(stock.engine, TREE_CHUNK, "tree")


def kernels_path(kernels: str, path=None, *, device=None, weights: str = "bf16") -> EngineCandidate:
    """The stock path with `kernels=` ('reference': the torch references; 'kernels': the operators' own
    choice, on the CPU the Triton interpreter, slow)."""
    return engine_path(path, device=device, weights=weights, kernels=kernels, chunk=STOCK_CHUNK,
                       name=f"{kernels}-kernels")


def make_candidate(kind: str, stock: EngineCandidate, path=None, *, device=None) -> Candidate:
    """The candidate named `kind` (one of CANDIDATES) for checkpoint `path`; `stock` is reused where the
    candidate is the stock engine in another mode."""
    if kind == "stock":
        return EngineCandidate(stock.engine, STOCK_CHUNK, "stock")
    if kind == "w12":
        return w12_path(path, device=device)
    if kind == "tree":
        return tree_path(stock)
    if kind == "reference-kernels":
        return kernels_path("reference", path, device=device)
    if kind == "planted-fault":
        return planted_fault(EngineCandidate(stock.engine, STOCK_CHUNK, "stock"))
    raise _err("make_candidate", f"kind={kind!r}", "pass one of " + ", ".join(CANDIDATES))


# ---- prompts and the reference stream ---------------------------------------------------------------


def heldout_prompts(n: int, prompt_bytes: int = 64, tokens: int = 128, text=None) -> tuple[list, list]:
    """(prompts, continuations) as byte token ids (the tiny model's vocabulary: id = byte value): n windows
    of the text file `text` (default: the shipped tiny model's held-out text, `heldout.txt`), evenly
    spaced, each starting at a line start; a prompt is `prompt_bytes` bytes, its continuation the `tokens`
    bytes of text that follow it. Models with another vocabulary pass their own token ids to `reference`."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise _err("heldout_prompts", f"n={n!r}", "pass an int >= 1")
    if prompt_bytes < 1 or tokens < 1:
        raise _err("heldout_prompts", f"prompt_bytes={prompt_bytes}, tokens={tokens}", "pass both >= 1")
    if text is None:
        from .models import HELDOUT_FILE, tiny_stdlib_path

        text = tiny_stdlib_path() / HELDOUT_FILE
    f = Path(text)
    if not f.is_file():
        raise _err("heldout_prompts", f"{f} is not a file", "pass a text file, or build the prompts yourself "
                   "and pass them to reference()")
    text = f.read_bytes()
    span = prompt_bytes + tokens
    last = len(text) - span
    if last < 0:
        raise _err("heldout_prompts", f"{f} has {len(text)} bytes, fewer than prompt_bytes + tokens "
                   f"= {span}", "pass fewer bytes")
    starts = []
    for i in range(n):
        s = i * last // max(n - 1, 1) if n > 1 else 0
        nl = text.rfind(b"\n", 0, s)  # back to the start of the line
        starts.append(0 if nl < 0 else nl + 1)
    prompts = [list(text[s:s + prompt_bytes]) for s in starts]
    conts = [list(text[s + prompt_bytes:s + span]) for s in starts]
    return prompts, conts


@dataclass
class _Forced:
    """One forcing of a stream, per position: the argmax, whether it differs from the forced target, and
    the margin (top logit - logit of the target)."""

    argmax: list[int]
    mismatch: list[bool]
    margin: list[float]


def _force(candidate: Candidate, prompt: list[int], target: list[int], vocab: int | None, fn: str) -> _Forced:
    ids = prompt + target[:-1]  # the row after the last target token predicts nothing forced
    logits = candidate(ids)
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] != len(ids) \
            or (vocab is not None and logits.shape[1] != vocab):
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise _err(fn, f"the candidate returned {shape} for {len(ids)} ids", f"return fp32 logits [len(ids), "
                   f"{vocab if vocab is not None else 'vocab'}], one row per prefix (teacher forcing)")
    if logits.dtype != torch.float32:
        raise _err(fn, f"the candidate returned {logits.dtype} logits", "return fp32 logits (the stock path's "
                   "head is fp32; compare like with like)")
    rows = logits[len(prompt) - 1:].float().cpu()
    ref = torch.tensor(target, dtype=torch.long)
    top = rows.max(-1)
    at = rows.gather(1, ref[:, None])[:, 0]
    margin = (top.values - at).clamp(min=0)
    arg = rows.argmax(-1)
    return _Forced(arg.tolist(), (arg != ref).tolist(), margin.tolist())


@dataclass
class Reference:
    """The stock path's side of a check, computed once for any number of candidates (`reference`)."""

    stock_name: str
    vocab: int
    prompts: list[list[int]]
    streams: list[list[int]]  # the stock path's greedy continuation of each prompt
    texts: list[list[int]]  # the held-out text after each prompt (the accuracy metric's target)
    stock: list[_Forced]  # the streams forced through the stock path
    stock_text: list[_Forced]  # the texts forced through the stock path

    def take(self, n: int, texts: bool = True) -> "Reference":
        """The first n prompts; without their texts (token forcing only, no accuracy metric) when texts=False."""
        keep = texts and bool(self.texts)
        return Reference(self.stock_name, self.vocab, self.prompts[:n], self.streams[:n],
                         self.texts[:n] if keep else [], self.stock[:n], self.stock_text[:n] if keep else [])


def _bar(progress, total: int, desc: str):
    if not progress:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit="tok", leave=False)


def reference(stock: EngineCandidate, prompts, tokens: int, texts=None, *, progress: bool = False) -> Reference:
    """The reference streams (the stock engine's greedy continuation of each prompt, `tokens` long) and
    their forcing through `stock`; `texts` (optional, one continuation per prompt) are forced too, for the
    accuracy metric."""
    if not isinstance(stock, EngineCandidate):
        raise TypeError(f"specpilot.check.reference: stock is a {type(stock).__name__}; pass stock_path(...)")
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise _err("reference", "no prompts, or an empty one", "pass one or more non-empty token lists")
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 1:
        raise _err("reference", f"tokens={tokens!r}", "pass an int >= 1 (reference tokens per prompt)")
    texts = [[int(t) for t in x] for x in texts] if texts is not None else None
    if texts is not None and (len(texts) != len(prompts) or any(not x for x in texts)):
        raise _err("reference", f"{len(texts)} texts for {len(prompts)} prompts", "pass one non-empty "
                   "continuation per prompt, or texts=None")
    vocab = stock.engine.model.cfg.vocab
    total = sum(len(p) + tokens for p in prompts) + sum(len(p) + len(x) for p, x in zip(prompts, texts or []))
    bar = _bar(progress, total, "stock path")
    streams, forced, forced_text = [], [], []
    try:
        for i, p in enumerate(prompts):
            s = stock.engine.generate(p, tokens, speculative=False)
            streams.append(s)
            forced.append(_force(stock, p, s, vocab, "reference"))
            if bar is not None:
                bar.update(len(p) + tokens)
            if texts is not None:
                forced_text.append(_force(stock, p, texts[i], vocab, "reference"))
                if bar is not None:
                    bar.update(len(p) + len(texts[i]))
    finally:
        if bar is not None:
            bar.close()
    return Reference(stock.name, vocab, prompts, streams, texts or [], forced, forced_text)


# ---- the rule ---------------------------------------------------------------------------------------


@dataclass
class Tally:
    """Forced positions, mismatches and large-margin events of one path."""

    positions: int
    mismatches: int
    large_margin: int

    @property
    def rate(self) -> float:
        """Mismatch rate (a fraction; 0 when nothing was forced)."""
        return self.mismatches / self.positions if self.positions else 0.0


def decide(stock: Tally, candidate: Tally, points: float = POINTS) -> tuple[bool, list[str]]:
    """(accept, reasons): reject when the candidate's mismatch rate is more than `points` percentage
    points above stock's, or when it has more large-margin events. The rate comparison is exact
    (rational arithmetic on the counts), so +`points` exactly accepts."""
    if not (isinstance(points, (int, float)) and math.isfinite(points) and points >= 0):
        raise _err("decide", f"points={points!r}", "pass a finite number >= 0 (percentage points; the paper's is 0.5)")
    for who, t in (("stock", stock), ("candidate", candidate)):
        if t.positions < 1 or not 0 <= t.large_margin <= t.mismatches <= t.positions:
            raise _err("decide", f"{who} tally {t} is inconsistent", "pass positions >= 1 and 0 <= large_margin <= "
                       "mismatches <= positions")
    tol = Fraction(repr(float(points))) / 100
    rise = Fraction(candidate.mismatches, candidate.positions) - Fraction(stock.mismatches, stock.positions)
    reasons = []
    if rise > tol:
        reasons.append(f"mismatch rate {100 * candidate.rate:.3g}% is {100 * float(rise):.3g} points above stock's "
                       f"{100 * stock.rate:.3g}% (more than {points:g})")
    if candidate.large_margin > stock.large_margin:
        reasons.append(f"large-margin events rose from {stock.large_margin} to {candidate.large_margin}")
    if not reasons:
        reasons.append(f"mismatch rate {100 * candidate.rate:.3g}% within {points:g} points of stock's "
                       f"{100 * stock.rate:.3g}%; large-margin events {candidate.large_margin} <= stock's "
                       f"{stock.large_margin}")
        return True, reasons
    return False, reasons


# ---- the accuracy metric ----------------------------------------------------------------------------


def bootstrap_interval(diffs, groups=None, *, resamples: int = RESAMPLES, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of paired differences `diffs` (one per position). With
    `groups` (a group id per position), whole groups are resampled and the mean is over the positions
    drawn (a cluster bootstrap); without, positions are resampled. Fixed `seed`."""
    d = torch.as_tensor(diffs, dtype=torch.float64)
    if d.numel() == 0:
        raise _err("bootstrap_interval", "no differences", "pass at least one")
    if resamples < 1 or not 0 < level < 1:
        raise _err("bootstrap_interval", f"resamples={resamples}, level={level}",
                   "pass resamples >= 1 and 0 < level < 1")
    g = torch.Generator().manual_seed(seed)
    if groups is None:
        idx = torch.randint(0, d.numel(), (resamples, d.numel()), generator=g)
        means = d[idx].mean(1)
    else:
        gid = torch.as_tensor(groups, dtype=torch.long)
        uniq, inv = torch.unique(gid, return_inverse=True)
        sums = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, d)
        counts = torch.zeros(len(uniq), dtype=torch.float64).index_add_(0, inv, torch.ones_like(d))
        idx = torch.randint(0, len(uniq), (resamples, len(uniq)), generator=g)
        means = sums[idx].sum(1) / counts[idx].sum(1)
    lo, hi = torch.quantile(means, torch.tensor([(1 - level) / 2, (1 + level) / 2], dtype=torch.float64)).tolist()
    return lo, hi


@dataclass
class Accuracy:
    """Next-byte accuracy of the greedy prediction against the held-out text, stock and candidate."""

    positions: int
    stock_correct: int
    candidate_correct: int
    stock: float
    candidate: float
    difference: float  # candidate - stock, a fraction
    interval_prompts: tuple[float, float]  # 95% bootstrap over prompts
    interval_positions: tuple[float, float]  # 95% bootstrap over positions
    covers_zero_prompts: bool
    covers_zero_positions: bool
    changed: int  # positions whose greedy prediction differs between the two
    resamples: int
    seed: int


def _accuracy(ref: Reference, cand_text: list[_Forced], resamples: int, seed: int) -> Accuracy:
    d, groups, sc, cc, changed = [], [], 0, 0, 0
    for i, (s, c) in enumerate(zip(ref.stock_text, cand_text)):
        for ms, mc, a, b in zip(s.mismatch, c.mismatch, s.argmax, c.argmax):
            sc += not ms
            cc += not mc
            changed += a != b
            d.append(float(ms) - float(mc))  # correct(candidate) - correct(stock)
            groups.append(i)
    n = len(d)
    ip = bootstrap_interval(d, groups, resamples=resamples, seed=seed)
    iq = bootstrap_interval(d, None, resamples=resamples, seed=seed)
    return Accuracy(n, sc, cc, sc / n, cc / n, (cc - sc) / n, ip, iq, ip[0] <= 0 <= ip[1], iq[0] <= 0 <= iq[1],
                    changed, resamples, seed)


# ---- the check --------------------------------------------------------------------------------------


@dataclass
class PromptResult:
    index: int
    prompt_tokens: int
    positions: int
    stock: Tally
    candidate: Tally
    candidate_mismatch_at: list[int]  # positions in the stream (0 = the first generated token)
    candidate_max_margin: float


@dataclass
class CheckReport:
    """A token-forcing check of one candidate against the stock path (`run`)."""

    candidate: str
    candidate_describe: str
    stock: str
    vocab: int
    prompts: int
    tokens: int
    large_margin_threshold: float
    points: float
    totals_stock: Tally
    totals_candidate: Tally
    accept: bool
    reasons: list[str]
    per_prompt: list[PromptResult]
    accuracy: Accuracy | None
    meta: dict = field(default_factory=dict)

    @property
    def decision(self) -> str:
        return "accept" if self.accept else "reject"

    def to_dict(self) -> dict:
        d = asdict(self)
        d["decision"] = self.decision
        d["rule"] = (f"reject if the candidate's mismatch rate is more than {self.points:g} percentage points above "
                     f"the stock path's, or if its large-margin events (top logit - logit of the forced reference "
                     f"token > {self.large_margin_threshold:g}) are more than the stock path's")
        for k in ("totals_stock", "totals_candidate"):
            d[k]["rate"] = getattr(self, k).rate
        for p, q in zip(d["per_prompt"], self.per_prompt):
            p["stock"]["rate"], p["candidate"]["rate"] = q.stock.rate, q.candidate.rate
        return d

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)


def _large(f: _Forced, threshold: float) -> int:
    return sum(m > threshold for m in f.margin)


def run(candidate: Candidate, ref: Reference, *, large_margin: float = LARGE_MARGIN, points: float = POINTS,
        resamples: int = RESAMPLES, seed: int = 0, progress: bool = False, meta: dict | None = None) -> CheckReport:
    """Force `ref`'s streams (and texts, for the accuracy metric) through `candidate` and apply the rule."""
    if not callable(candidate):
        raise TypeError(f"specpilot.check.run: candidate is a {type(candidate).__name__}; pass a callable ids -> "
                        "fp32 logits [len(ids), vocab]")
    if not isinstance(ref, Reference):
        raise TypeError(f"specpilot.check.run: ref is a {type(ref).__name__}; pass reference(...)'s result")
    if not (isinstance(large_margin, (int, float)) and math.isfinite(large_margin) and large_margin >= 0):
        raise _err("run", f"large_margin={large_margin!r}", f"pass a finite logit margin >= 0 (default NEAR_TIE = "
                   f"{NEAR_TIE})")
    if not (isinstance(points, (int, float)) and math.isfinite(points) and points >= 0):
        raise _err("run", f"points={points!r}", "pass a finite number >= 0 (percentage points; the paper's is 0.5)")
    total = sum(len(p) + len(s) for p, s in zip(ref.prompts, ref.streams)) \
        + sum(len(p) + len(x) for p, x in zip(ref.prompts, ref.texts))
    name = getattr(candidate, "name", type(candidate).__name__)
    bar = _bar(progress, total, f"{name}"[:40])
    per, cand_text = [], []
    try:
        for i, (p, s) in enumerate(zip(ref.prompts, ref.streams)):
            c = _force(candidate, p, s, ref.vocab, "run")
            st = ref.stock[i]
            per.append(PromptResult(i, len(p), len(s), Tally(len(s), sum(st.mismatch), _large(st, large_margin)),
                                    Tally(len(s), sum(c.mismatch), _large(c, large_margin)),
                                    [j for j, m in enumerate(c.mismatch) if m], max(c.margin, default=0.0)))
            if bar is not None:
                bar.update(len(p) + len(s))
            if ref.texts:
                cand_text.append(_force(candidate, p, ref.texts[i], ref.vocab, "run"))
                if bar is not None:
                    bar.update(len(p) + len(ref.texts[i]))
    finally:
        if bar is not None:
            bar.close()
    ts, tc = (Tally(*(sum(getattr(getattr(r, k), f) for r in per) for f in ("positions", "mismatches", "large_margin")))
              for k in ("stock", "candidate"))
    accept, reasons = decide(ts, tc, points)
    acc = _accuracy(ref, cand_text, resamples, seed) if ref.texts else None
    return CheckReport(name, getattr(candidate, "describe", name), ref.stock_name, ref.vocab, len(ref.prompts),
                       max((len(s) for s in ref.streams), default=0), float(large_margin), float(points), ts, tc,
                       accept, reasons, per, acc, dict(meta or {}))


# ---- the transformers oracle ------------------------------------------------------------------------
#
# transformers' Qwen3.5 and Qwen3-Next modelling code binds its Gated DeltaNet and conv functions to fla's Triton
# kernels and to causal-conv1d's CUDA kernels wherever those packages import: at import time, as wrappers around its
# own torch functions (`use_kernel_func_from_hub_with_fallback`: the choice sits in the wrapper's closure), or in
# each layer's constructor (`self.chunk_gated_delta_rule = chunk_gated_delta_rule or torch_chunk_gated_delta_rule`,
# an fla `FusedRMSNormGated` as the output norm). Those kernels take CUDA tensors only (a CPU model fails in them
# with "Pointer argument ... cannot be accessed from Triton"), and they are another implementation under test, not
# an oracle. `torch_reference_path` runs transformers' own torch code instead, on any device.

_KERNEL_PACKAGES = ("fla", "causal_conv1d")
# a layer's function attribute -> the torch function of the modelling module that replaces it (None: the attribute
# is set to None, the layer's torch branch: nn.Conv1d for causal_conv1d_fn)
_LAYER_FUNCTIONS = {"chunk_gated_delta_rule": "torch_chunk_gated_delta_rule",
                    "recurrent_gated_delta_rule": "torch_recurrent_gated_delta_rule",
                    "causal_conv1d_update": "torch_causal_conv1d_update", "causal_conv1d_fn": None}


def _package(obj) -> str:
    return (getattr(obj, "__module__", None) or "").split(".")[0]


def _closure(fn) -> dict:
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return {}
    return {name: c.cell_contents for name, c in zip(code.co_freevars, cells)}


@dataclass
class ReferencePath:
    """What `torch_reference_path` ran: always transformers' torch code (`path`); `bypassed` names each function or
    module that transformers had bound to a kernel package, with that package (fla, causal_conv1d); `calls` counts
    the calls of the torch functions that stood in for transformers' switchable ones."""

    bypassed: dict[str, str] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    path: str = "torch"

    def __str__(self) -> str:
        ran = ", ".join(f"{n} x{c}" for n, c in sorted(self.calls.items()) if c) or "none of its switchable functions"
        if self.bypassed:
            by = "; bypassed " + ", ".join(f"{p}'s {n}" for n, p in sorted(self.bypassed.items()))
        else:
            by = "; transformers had bound no kernel package"
        return f"reference path: torch (ran {ran}{by})"


def _counted(name: str, fn, calls: dict):
    params = inspect.signature(fn).parameters
    open_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())

    def run(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return fn(*args, **(kwargs if open_kw else {k: v for k, v in kwargs.items() if k in params}))

    run.counted = True  # a layer attribute that points at it is not counted twice
    return run


def _torch_norm(module_ns, old, device):
    """The modelling module's own gated RMSNorm holding `old`'s weight (for an fla FusedRMSNormGated), on `device`:
    transformers builds fla's norm on the current CUDA device even where the rest of the model is on the CPU."""
    import torch.nn as nn

    cls = next((c for n, c in vars(module_ns).items() if n.endswith("RMSNormGated") and isinstance(c, type)
                and c.__module__ == module_ns.__name__), None)
    weight = getattr(old, "weight", None)
    if cls is None or weight is None:
        return None
    eps = getattr(old, "eps", getattr(old, "variance_epsilon", 1e-6))
    new = cls(weight.shape[0], eps=eps)
    device = weight.device if device is None else device
    new.weight = weight if weight.device == device else nn.Parameter(weight.detach().to(device), requires_grad=False)
    return new


@contextlib.contextmanager
def torch_reference_path(*models):
    """Within the block, the transformers `models` (and every model of the same modelling modules) run
    transformers' own torch code for the functions and modules it can bind to fla or causal-conv1d kernels,
    whether or not those packages are installed, on the CPU and on the GPU. Yields a `ReferencePath` (what was
    bypassed, what ran). Everything is restored on exit. It rebinds module attributes: do not run other
    transformers models of those modules in other threads meanwhile."""
    import torch.nn as nn

    fn = "specpilot.check.torch_reference_path"
    if not models or not all(isinstance(m, nn.Module) for m in models):
        got = ", ".join(type(m).__name__ for m in models) or "nothing"
        raise TypeError(f"{fn}: got {got}; pass one or more transformers models (torch.nn.Module)")
    rec = ReferencePath()
    undo: list = []
    modules = {}
    for m in models:
        for sub in m.modules():
            name = type(sub).__module__
            if name.startswith("transformers.models.") and name in sys.modules:
                modules[name] = sys.modules[name]
    try:
        # import-time choices: transformers' wrappers keep the torch function and the chosen implementation
        for mod in modules.values():
            for name, f in list(vars(mod).items()):
                cl = _closure(f)
                if not callable(f) or "torch_function" not in cl or "implementation" not in cl:
                    continue
                impl = cl["implementation"]
                if impl is not cl["torch_function"]:
                    rec.bypassed[getattr(impl, "__name__", name)] = _package(impl)
                undo.append((setattr, mod, name, f))
                setattr(mod, name, _counted(name, cl["torch_function"], rec.calls))
        # constructor-time choices: function attributes and kernel modules of each layer
        for m in models:
            for sub in m.modules():
                mod = sys.modules.get(type(sub).__module__)
                for attr, torch_name in _LAYER_FUNCTIONS.items():
                    f = sub.__dict__.get(attr)
                    if f is None or _package(f) not in _KERNEL_PACKAGES:
                        continue
                    repl = getattr(mod, torch_name, None) if torch_name else None
                    if torch_name and repl is None:
                        raise RuntimeError(f"{fn}: {type(sub).__name__}.{attr} is bound to {_package(f)} and "
                                           f"{type(sub).__module__} has no {torch_name}; run the reference with "
                                           f"{_package(f)} uninstalled")
                    rec.bypassed[f"{type(sub).__name__}.{attr}"] = _package(f)
                    undo.append((setattr, sub, attr, f))
                    if repl is not None and not getattr(repl, "counted", False):
                        repl = _counted(torch_name, repl, rec.calls)
                    setattr(sub, attr, repl)
                for child_name, child in list(sub.named_children()):
                    if _package(type(child)) not in _KERNEL_PACKAGES:
                        continue
                    # the layer's inputs live where its other parameters do
                    dev = next((p.device for n, p in sub.named_parameters() if not n.startswith(child_name + ".")),
                               None)
                    repl = _torch_norm(mod, child, dev) if mod is not None else None
                    if repl is None:
                        raise RuntimeError(f"{fn}: {type(sub).__name__}.{child_name} is {_package(type(child))}'s "
                                           f"{type(child).__name__}, which has no torch counterpart here; run the "
                                           f"reference with {_package(type(child))} uninstalled")
                    rec.bypassed[f"{type(sub).__name__}.{child_name}"] = _package(type(child))
                    undo.append((setattr, sub, child_name, child))
                    setattr(sub, child_name, repl)
        yield rec
    finally:
        for op, obj, name, value in reversed(undo):
            op(obj, name, value)


@dataclass
class TransformersLogits:
    """`transformers_logits`' result: the oracle's logits and the path its reference took."""

    reference: torch.Tensor  # fp64 [len(ids), vocab]: an fp32 copy of the model
    baseline: torch.Tensor  # fp32 [len(ids), vocab]: the model in its own dtype (what a same-precision run errs by)
    path: ReferencePath


def transformers_logits(model, ids) -> TransformersLogits:
    """Teacher-forced logits of one sequence `ids` from a transformers causal LM on its own device, on
    transformers' torch path (`torch_reference_path`, with or without fla and causal-conv1d installed): the
    reference from an fp32 copy (returned fp64) and the baseline from `model` as it is. The oracle of
    `specpilot.testing.assert_close(actual, reference, baseline)`: at most 2x the baseline's error."""
    import copy

    import torch.nn as nn

    fn = "specpilot.check.transformers_logits"
    if not isinstance(model, nn.Module) or not hasattr(model, "config"):
        raise TypeError(f"{fn}: model is a {type(model).__name__}; pass a transformers model (e.g. "
                        "Qwen3_5ForCausalLM.from_pretrained(path))")
    ids = [int(t) for t in (ids.tolist() if isinstance(ids, torch.Tensor) else ids)]
    if not ids:
        raise _err("transformers_logits", "ids is empty", "pass one or more token ids")
    dev = next(model.parameters()).device
    x = torch.tensor([ids], device=dev)
    ref_model = copy.deepcopy(model).float()
    with torch.no_grad(), torch_reference_path(model, ref_model) as path:
        reference = ref_model(x).logits[0].double()
        baseline = model(x).logits[0].float()
    return TransformersLogits(reference, baseline, path)
