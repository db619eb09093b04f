"""autotune.promotion: the paper's promotion rule on synthetic A/B timings with known gains."""

import numpy as np
import pytest

from autotune.promotion import Decision, promote

RUNS = 200


def _ab(gain: float, seed: int, n: int = 60, sigma: float = 0.02, drift: float = 0.001):
    """Interleaved rounds: lognormal per-sample noise, a slow random-walk drift both configs share (steps of
    standard deviation `drift`), and a
    candidate that takes 1/(1+gain) of the current time."""
    r = np.random.default_rng(seed)
    d = np.exp(drift * np.cumsum(r.normal(0.0, 1.0, n)))
    a = 100e-6 * d * np.exp(r.normal(0.0, sigma, n))
    b = 100e-6 / (1.0 + gain) * d * np.exp(r.normal(0.0, sigma, n))
    return a, b


def _rate(gain: float, **kw) -> float:
    return float(np.mean([promote(*_ab(gain, seed, **kw)).promoted for seed in range(RUNS)]))


def test_real_5pct_gain_is_promoted():
    """Measured: 60 rounds, sigma 0.02, drift steps 0.001: 97.0% of 200 runs promote a 5% gain (100% with no drift)."""
    rate = _rate(0.05)
    assert rate >= 0.95, rate
    assert _rate(0.05, drift=0.0) == 1.0


def test_no_gain_is_not_promoted():
    """Measured: a 0% gain is promoted in 0 of 200 runs, at 60 and at 20 rounds (the bound is <= 5%)."""
    assert _rate(0.0) <= 0.05
    assert _rate(0.0, n=20) <= 0.05


def test_gain_estimate_and_record():
    a, b = _ab(0.05, seed=7)
    d = promote(a, b)
    assert isinstance(d, Decision)
    assert d.gain == pytest.approx(0.05, abs=0.015)
    assert d.lower_bound < d.gain
    assert d.threshold == pytest.approx(0.01 + 2 * d.noise)
    assert d.promoted == (d.lower_bound > d.threshold)
    assert d.n == 60 and d.resamples == 2000 and d.confidence == 0.95
    rec = d.to_dict()
    assert set(rec) >= {"gain", "lower_bound", "noise", "threshold", "n", "promoted", "reason"}
    assert rec["promoted"] is True and "promoted" in rec["reason"]
    # A slower candidate is kept out, and says why.
    slow = promote(b, a)
    assert slow.gain < 0 and not slow.promoted and slow.reason.startswith("kept current")


def test_drift_counts_as_noise():
    """Drift within the current config's own samples raises the A/A noise and with it the threshold."""
    a, b = _ab(0.05, seed=3, drift=0.0)
    ramp = np.linspace(1.0, 1.06, len(a))  # the current config slows 6% over the measurement
    d = promote(a * ramp, b * ramp)
    assert d.noise > 0.02 and d.threshold > 0.05 and not d.promoted


def test_deterministic():
    a, b = _ab(0.03, seed=11)
    assert promote(a, b) == promote(list(a), list(b))
    assert len({promote(a, b, seed=s).lower_bound for s in range(5)}) > 1  # the seed drives the bootstrap


@pytest.mark.parametrize("a, b, match", [
    ([1.0] * 7, [1.0] * 7, r"autotune.promote: 7 rounds .*at least 8"),
    ([1.0] * 10, [1.0] * 9, r"autotune.promote: 10 current and 9 candidate"),
    ([1.0] * 9 + [float("nan")], [1.0] * 10, r"autotune.promote: current holds .*drop failed rounds"),
    ([1.0] * 10, [1.0] * 9 + [0.0], r"autotune.promote: candidate holds"),
])
def test_bad_samples_raise(a, b, match):
    with pytest.raises(ValueError, match=match):
        promote(a, b)


def test_too_few_resamples_raise():
    with pytest.raises(ValueError, match=r"autotune.promote: resamples=10"):
        promote([1.0] * 10, [1.0] * 10, resamples=10)
