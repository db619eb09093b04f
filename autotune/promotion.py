"""The promotion rule: a tuned config replaces the current one only when its gain is clearly real.

Input: interleaved A/B timing samples, `current[i]` and `candidate[i]` measured in the same round `i`
(A then B, or alternated), times in any unit (lower is better).

* **Gain.** Per round, the ratio `current[i] / candidate[i]`; the gain is the median ratio minus one
  (+0.05: the candidate takes 1/1.05 of the current time). Pairing by round cancels drift that both
  configs see (clocks, temperature, other work on the GPU).
* **Lower bound.** A paired bootstrap: rounds are resampled with replacement (`resamples` times, a fixed
  seed), the gain is recomputed on each resample, and the one-sided 95% lower confidence bound is the
  5th percentile of those gains (percentile method).
* **Noise.** An A/A estimate from the current config alone: its samples split in time order into a
  first and a second half, noise = |median(first half) / median(second half) - 1|. It measures how much
  the same config moves within one measurement, which pairing hides from the gain but which separates
  the tuning run from later use.
* **Rule.** Promote when `lower_bound > 1% + 2 x noise`; otherwise keep the current config.

Measured rates (tests/test_promotion.py, 200 simulated runs each of 60 rounds, lognormal per-sample
noise of sigma 0.02 and a slow drift shared by both configs): a real 5% gain is promoted in 97% of runs
(100% without the drift), a 0% gain in none. The A/A noise shrinks as 1/sqrt(rounds) and grows with
drift, so noisier timings need more rounds: at sigma 0.03 and 40 rounds with drift the same 5% gain is
promoted in only about half of the runs, and the rule keeps the current config. The decision is
deterministic for given samples and seed.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["Decision", "promote", "MIN_ROUNDS", "MIN_GAIN", "NOISE_FACTOR", "CONFIDENCE"]

MIN_ROUNDS = 8  # below this neither the bootstrap nor the A/A halves (4 samples each) mean anything
MIN_GAIN = 0.01  # the fixed margin of the rule: 1%
NOISE_FACTOR = 2.0  # the noise is counted twice
CONFIDENCE = 0.95  # one-sided: the lower bound is the 5th percentile of the bootstrap gains


@dataclass(frozen=True)
class Decision:
    """One promotion decision with every number it rests on. `gain`, `lower_bound`, `noise` and
    `threshold` are fractions (0.05 = 5%)."""

    gain: float
    lower_bound: float
    noise: float
    threshold: float
    n: int
    promoted: bool
    reason: str
    current_median: float
    candidate_median: float
    resamples: int
    seed: int
    confidence: float = CONFIDENCE

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _samples(name: str, xs: Sequence[float]) -> np.ndarray:
    a = np.asarray(list(xs), dtype=np.float64)
    if a.ndim != 1:
        raise ValueError(f"autotune.promote: {name} must be a flat sequence of times, got shape {a.shape}; "
                         f"pass one time per round")
    if not np.all(np.isfinite(a)) or np.any(a <= 0):
        raise ValueError(f"autotune.promote: {name} holds a time that is not a positive finite number; "
                         f"drop failed rounds from both sequences before deciding")
    return a


def promote(current: Sequence[float], candidate: Sequence[float], *, resamples: int = 2000, seed: int = 0,
            min_gain: float = MIN_GAIN, noise_factor: float = NOISE_FACTOR) -> Decision:
    """Decide whether `candidate` replaces `current` from paired per-round times (module doc)."""
    a = _samples("current", current)
    b = _samples("candidate", candidate)
    if len(a) != len(b):
        raise ValueError(f"autotune.promote: {len(a)} current and {len(b)} candidate times; the samples are "
                         f"paired by round, so pass the same number of each")
    n = len(a)
    if n < MIN_ROUNDS:
        raise ValueError(f"autotune.promote: {n} rounds of A/B samples; measure at least {MIN_ROUNDS} "
                         f"interleaved rounds (40 or more for a 5% gain under a few % of noise)")
    if resamples < 100:
        raise ValueError(f"autotune.promote: resamples={resamples} is too few for a 5th percentile; use >= 100 "
                         f"(2000 by default)")
    ratios = a / b
    gain = float(np.median(ratios)) - 1.0
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, n, size=(resamples, n))
    boot = np.median(ratios[idx], axis=1) - 1.0
    lower = float(np.quantile(boot, 1.0 - CONFIDENCE))
    half = n // 2
    noise = abs(float(np.median(a[:half])) / float(np.median(a[n - half:])) - 1.0)
    threshold = min_gain + noise_factor * noise
    promoted = lower > threshold
    cmp = ">" if promoted else "<="
    reason = (f"{'promoted' if promoted else 'kept current'}: 95% lower bound of the gain {lower:+.2%} {cmp} "
              f"{min_gain:.0%} + {noise_factor:g} x noise {noise:.2%} = {threshold:.2%} (gain {gain:+.2%}, "
              f"{n} rounds)")
    if math.isnan(lower):  # pragma: no cover - finite positive inputs give finite ratios
        promoted, reason = False, "kept current: the bootstrap gave no bound"
    return Decision(gain=gain, lower_bound=lower, noise=noise, threshold=threshold, n=n, promoted=bool(promoted),
                    reason=reason, current_median=float(np.median(a)), candidate_median=float(np.median(b)),
                    resamples=resamples, seed=seed)
