"""One tuner for every kernel: a search-space declaration per kernel variant and an Optuna study per shape.

A kernel variant declares, next to its config dataclass and in its own package, a `SearchSpace`:

* `params`: each tunable parameter with its choices (block sizes, split, warps, stages, variant choice);
* `make_config(params)`: the frozen config dataclass for one choice of parameters;
* `valid(params, shape) -> str | None`: the reason a choice cannot run at a shape (shared memory,
  registers, divisibility), or None;
* `flops_bytes(shape) -> (flops, bytes)`: the work of one call, for the byte floor;
* `check(config, shape) -> bool`: correctness against the reference, run before any timing;
* `heuristic(shape)`: today's default config, tried first and the baseline of the promotion rule.

`tune(op, shapes, space=..., timer=...)` runs one study per shape. The objective is the median of the
times `timer(config, shape)` returns over `autotune.byte_floor(flops, bytes)`: 1.0 is the floor. A
choice that `valid` rejects, whose config cannot be built (`ValueError`, `autotune.BuildError`), or whose
check fails or raises `BuildError` is pruned (`optuna.TrialPruned`, the reason in the trial's user
attribute `pruned`): the study goes on. Studies live in Optuna's storage (`storage="sqlite:///t.db"`),
named `<study_name or op>/<variant>/<shape key>`; running `tune` again with the same storage and name
resumes them (trials already recorded count toward `trials`), and Optuna's own tools read the file.

The timer is injected. On a GPU it wraps `specpilot.bench.timing` (rotated inputs, CUDA graphs, events;
only that module reads CUDA events); `autotune` imports nothing of this project, so the caller passes it.

The first trials of a study are drawn from the valid configs only: the heuristic, then `startup - 1`
distinct configs that `valid` accepts and that build (seeded), enqueued before the sampler (TPE) takes
over; a random draw from the whole grid would spend most of a small budget on pruned choices. Two
choices that build the same config (fields a variant ignores) are timed once.

Compiles in parallel: `precompile(configs, shape)` is called once per shape, before the study, with the
configs enqueued for it. `specpilot.tuning` compiles them on a thread pool (Triton and NVRTC compile
outside the GIL) so that the trials find them built.

`progress(event)` is called after every trial with a dict (`key`, `number`, `state`, `value`, `best`).

Winners go to the store through `autotune.store_tuned`, with their numbers as metadata. When an `ab`
measurement is given, the winner is stored only if the promotion rule (`autotune.promotion.promote`)
promotes it over the heuristic config, and the decision is stored with it.
"""

from __future__ import annotations

import dataclasses
import itertools
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

from .config import shape_key, store_tuned
from .hardware import byte_floor
from .jit import BuildError
from .promotion import Decision, promote

__all__ = ["SearchSpace", "TuneResult", "tune"]

Shape = Mapping[str, int]


def _no_reason(params: dict, shape: Shape) -> str | None:
    return None


@dataclass(frozen=True)
class SearchSpace:
    """The tunable parameters of one kernel variant and the hooks the tuner calls (module doc)."""

    op: str
    variant: str
    params: Mapping[str, Sequence[Any]]
    make_config: Callable[[dict], Any]
    flops_bytes: Callable[[Shape], tuple[float, float]]
    valid: Callable[[dict, Shape], str | None] = _no_reason
    check: Callable[[Any, Shape], bool] | None = None
    heuristic: Callable[[Shape], Any] | None = None
    key: Callable[[Shape], str] = field(default=lambda shape: shape_key(**shape))
    # what runs the cell today when that is not this variant's own stored entry or heuristic: a variant whose
    # stored entry takes the cell from another variant's kernel must beat that kernel, not its own heuristic
    # (current(shape, device) -> a config of any class; the caller's timer must run it)
    current: Callable[[Shape, Any], Any] | None = None

    def __post_init__(self):
        for name, choices in self.params.items():
            if not choices:
                raise ValueError(f"autotune.SearchSpace: parameter {name!r} of {self.op}/{self.variant} has no "
                                 f"choices; give it at least one")

    def grid(self) -> Iterator[dict]:
        """Every choice of parameters, valid or not."""
        names = list(self.params)
        for values in itertools.product(*(self.params[n] for n in names)):
            yield dict(zip(names, values))

    def configs(self, shape: Shape) -> Iterator[tuple[dict, Any]]:
        """(params, config) for every choice that `valid` accepts at `shape` and that builds."""
        for p in self.grid():
            if self.valid(p, shape) is None:
                try:
                    yield p, self.make_config(p)
                except (ValueError, BuildError):
                    continue

    def params_of(self, config: Any) -> dict | None:
        """The parameters that make `config` (the dataclass fields of the same names), or None when a
        field's value is not among the declared choices."""
        p = {}
        for name, choices in self.params.items():
            v = getattr(config, name, None)
            if v not in choices:
                return None
            p[name] = v
        return p


@dataclass(frozen=True)
class TuneResult:
    """The outcome of one shape's study. Times in seconds; `over_floor` is median time / byte floor."""

    op: str
    variant: str
    key: str
    shape: dict
    study_name: str
    config: Any
    params: dict
    median_s: float
    floor_s: float
    over_floor: float
    trials: int
    pruned: int
    heuristic_over_floor: float | None = None
    decision: Decision | None = None
    stored: bool = False
    heuristic: Any = None
    heuristic_median_s: float | None = None
    note: str = ""

    def to_dict(self) -> dict:
        d = dataclasses.asdict(self)
        for name in ("config", "heuristic"):
            v = getattr(self, name)
            d[name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
        d["decision"] = self.decision.to_dict() if self.decision else None
        return d


class _Pruned(Exception):
    pass


def _objective(space: SearchSpace, shape: Shape, timer, floor_s: float, optuna, seen: dict):
    def run(trial):
        params = {n: trial.suggest_categorical(n, list(c)) for n, c in space.params.items()}
        for t in trial.study.get_trials(deepcopy=False):  # a choice seen before is not timed again
            if t.number != trial.number and t.params == params and t.state.is_finished():
                if t.state == optuna.trial.TrialState.COMPLETE:
                    for k, v in t.user_attrs.items():
                        trial.set_user_attr(k, v)
                    return t.value
                if t.state == optuna.trial.TrialState.PRUNED:
                    trial.set_user_attr("pruned", t.user_attrs.get("pruned", "pruned before"))
                    raise optuna.TrialPruned(t.user_attrs.get("pruned"))
        try:
            reason = space.valid(params, shape)
            if reason is not None:
                raise _Pruned(f"invalid: {reason}")
            try:
                cfg = space.make_config(params)
            except (ValueError, BuildError) as e:
                raise _Pruned(f"config: {e}") from e
            if cfg in seen:  # another choice of parameters built the same config
                if isinstance(seen[cfg], str):
                    raise _Pruned(seen[cfg])
                for k, v in seen[cfg][1].items():
                    trial.set_user_attr(k, v)
                trial.set_user_attr("same_config_as", seen[cfg][2])
                return seen[cfg][0]
            try:
                if space.check is not None and not space.check(cfg, shape):
                    seen[cfg] = "check failed"
                    raise _Pruned("check failed")
                times = list(timer(cfg, shape))
            except BuildError as e:
                seen[cfg] = f"build: {e}"
                raise _Pruned(f"build: {e}") from e
            if not times:
                raise _Pruned("the timer returned no times")
        except _Pruned as e:
            trial.set_user_attr("pruned", str(e))
            raise optuna.TrialPruned(str(e)) from None
        med = statistics.median(times)
        attrs = {"median_s": med, "floor_s": floor_s}
        for k, v in attrs.items():
            trial.set_user_attr(k, v)
        seen[cfg] = (med / floor_s, attrs, trial.number)
        return med / floor_s

    return run


def _startup(space: SearchSpace, shape: Shape, first: dict | None, n: int, taken: list[dict], seed: int) -> list[dict]:
    """`first` (the heuristic's parameters) and then distinct valid choices up to `n` in all, seeded, none of
    them in `taken` and no two building the same config."""
    import random

    out = [] if first is None or first in taken else [first]
    if n <= len(out):
        return out[:n]
    pool = list(space.configs(shape))
    random.Random(seed).shuffle(pool)
    configs = {space.make_config(first)} if first is not None else set()
    for p, c in pool:
        if len(out) >= n:
            break
        if p in taken or p in out or c in configs:
            continue
        configs.add(c)
        out.append(p)
    return out


def tune(op: str, shapes: Sequence[Shape], *, space: SearchSpace, timer: Callable[[Any, Shape], list[float]],
         trials: int = 32, time_budget: float | None = None, storage: str | None = None,
         study_name: str | None = None, floor_device=None, device=None, seed: int = 0, store: bool = True,
         ab: Callable[[Any, Any, Shape], tuple[Sequence[float], Sequence[float]]] | None = None,
         precompile: Callable[[list, Shape], None] | None = None, store_kw: dict | None = None,
         startup: int = 8, progress: Callable[[dict], None] | None = None) -> list[TuneResult]:
    """Tune `space` at each shape with an Optuna study (module doc); one `TuneResult` per shape.

    `trials` is per shape, counting trials a resumed study already holds; `time_budget` (seconds) is for
    all shapes together, shared evenly among the shapes still to run. `floor_device` names the GPU of the
    byte floor (default: `device`). `ab(current, candidate, shape)` returns interleaved per-round times of
    the heuristic and the winner for the promotion rule. `store_kw` is passed on to `store_tuned`.
    `startup`: trials drawn from the valid configs before the sampler takes over."""
    import optuna

    if op != space.op:
        raise ValueError(f"autotune.tune: the space declares op {space.op!r}, not {op!r}; pass the space of {op!r}")
    if trials < 1:
        raise ValueError(f"autotune.tune: trials={trials}; ask for at least one trial per shape")
    if not shapes:
        raise ValueError("autotune.tune: no shapes; pass at least one shape such as {'M': 8, 'N': 5120, 'K': 6144}")
    deadline = None if time_budget is None else time.monotonic() + time_budget
    out = []
    for i, shape in enumerate(shapes):
        shape = dict(shape)
        key = space.key(shape)
        name = f"{study_name or op}/{space.variant}/{key}"
        floor_s = byte_floor(*space.flops_bytes(shape), floor_device if floor_device is not None else device)
        study = optuna.create_study(storage=storage, study_name=name, direction="minimize", load_if_exists=True,
                                    sampler=optuna.samplers.TPESampler(seed=seed))
        heur = space.heuristic(shape) if space.heuristic is not None else None
        hp = space.params_of(heur) if heur is not None else None
        if hp is not None and (space.valid(hp, shape) is not None):
            hp = None  # a heuristic outside the valid region is not a trial; it stays the promotion baseline
        known = study.get_trials(deepcopy=False)
        done = len([t for t in known if t.state.is_finished()])
        left = max(0, trials - done)
        first = _startup(space, shape, hp, min(left, max(startup, 1)), [t.params for t in known], seed + i)
        for p in first:
            study.enqueue_trial(p)
        if precompile is not None and first:
            precompile([space.make_config(p) for p in first], shape)
        timeout = None if deadline is None else max(0.0, (deadline - time.monotonic()) / (len(shapes) - i))
        callbacks = []
        if progress is not None:
            def report(st, t, key=key):
                progress({"key": key, "number": t.number, "state": t.state.name, "value": t.value,
                          "best": min((x.value for x in st.get_trials(deepcopy=False, states=(
                              optuna.trial.TrialState.COMPLETE,))), default=None),
                          "pruned": t.user_attrs.get("pruned")})
            callbacks.append(report)
        if left and (timeout is None or timeout > 0):
            study.optimize(_objective(space, shape, timer, floor_s, optuna, {}), n_trials=left, timeout=timeout,
                           catch=(), show_progress_bar=False, callbacks=callbacks)
        finished = [t for t in study.get_trials(deepcopy=False) if t.state.is_finished()]
        complete = [t for t in finished if t.state == optuna.trial.TrialState.COMPLETE]
        if not complete:
            reasons = sorted({t.user_attrs.get("pruned", "?") for t in finished})[:3]
            raise RuntimeError(f"autotune.tune: no config of {op}/{space.variant} ran at {key} in {len(finished)} "
                               f"trials ({'; '.join(reasons)}); check the space's valid/check hooks or give more trials")
        best = min(complete, key=lambda t: t.value)
        cfg = space.make_config(dict(best.params))
        heur_ratio = heur_med = None
        if hp is not None:
            hts = [t for t in complete if t.params == hp]
            if hts:
                heur_ratio, heur_med = hts[0].value, hts[0].user_attrs.get("median_s")
        decision, note = None, ""
        if heur is not None and cfg == heur:
            note = "kept current: the heuristic config is the study's best"
        elif ab is not None and heur is not None:
            cur, cand = ab(heur, cfg, shape)
            decision = promote(cur, cand, seed=seed)
            note = decision.reason
        stored = False
        if store and (decision is None or decision.promoted) and not (heur is not None and cfg == heur):
            meta = {"median_s": best.user_attrs["median_s"], "floor_s": floor_s, "over_floor": best.value,
                    "study": name, "trials": len(finished), "heuristic_over_floor": heur_ratio,
                    "promotion": decision.to_dict() if decision else None}
            store_tuned(op, space.variant, key, cfg, device=device, extra=meta, **(store_kw or {}))
            stored = True
        out.append(TuneResult(op=op, variant=space.variant, key=key, shape=shape, study_name=name, config=cfg,
                              params=dict(best.params), median_s=best.user_attrs["median_s"], floor_s=floor_s,
                              over_floor=best.value, trials=len(finished),
                              pruned=sum(t.state == optuna.trial.TrialState.PRUNED for t in finished),
                              heuristic_over_floor=heur_ratio, decision=decision, stored=stored, heuristic=heur,
                              heuristic_median_s=heur_med, note=note))
    return out
