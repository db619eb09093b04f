"""`specpilot check` (token forcing, specpilot/check.py) on the shipped tiny model, on the CPU: the planted
fault is rejected and its mismatches are exactly where the biased stock logits change the argmax; the stock
path against itself, the tree pass and W12 weights are accepted; the rule at its boundaries; the accuracy
metric and its bootstrap; the CLI's exit codes and JSON report; bad arguments."""

from __future__ import annotations

import json

import pytest
import torch

from specpilot import check, cli
from specpilot.engine import NEAR_TIE
from specpilot.testing import raises_helpful

PROMPTS, PROMPT_BYTES, TOKENS = 2, 16, 24


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def stock():
    return check.stock_path(device="cpu")


@pytest.fixture(scope="module")
def ref(stock):
    prompts, texts = check.heldout_prompts(PROMPTS, PROMPT_BYTES, TOKENS)
    return check.reference(stock, prompts, TOKENS, texts)


@pytest.fixture(scope="module")
def planted(stock, ref):
    return check.run(check.planted_fault(check.make_candidate("stock", stock)), ref)


def _rows(candidate, prompt, stream):
    """The logits rows that predict stream[0], stream[1], ... under teacher forcing."""
    return candidate(prompt + stream[:-1])[len(prompt) - 1:]


# ---- candidates against the stock path ------------------------------------------------------------------


def test_reference_is_the_stock_greedy_stream(stock, ref):
    assert [len(s) for s in ref.streams] == [TOKENS] * PROMPTS
    for p, s in zip(ref.prompts, ref.streams):
        assert stock.engine.generate(p, TOKENS, speculative=False) == s
    assert [len(x) for x in ref.texts] == [TOKENS] * PROMPTS and ref.texts != ref.streams


def test_planted_fault_is_rejected(stock, ref, planted):
    assert not planted.accept and planted.decision == "reject"
    assert planted.totals_candidate.large_margin > planted.totals_stock.large_margin
    assert planted.totals_candidate.rate > planted.totals_stock.rate + check.POINTS / 100
    assert any("large-margin events rose" in r for r in planted.reasons)
    # independently: the mismatches are where stock logits + 2 on ids 0, 7, 14, ... leave the reference token
    for r, p, s in zip(planted.per_prompt, ref.prompts, ref.streams):
        rows = _rows(stock, p, s)
        rows[:, ::7] += 2.0
        target = torch.tensor(s)
        assert r.candidate_mismatch_at == (rows.argmax(-1) != target).nonzero()[:, 0].tolist()
        margin = rows.max(-1).values - rows.gather(1, target[:, None])[:, 0]
        assert r.candidate.large_margin == int((margin > NEAR_TIE).sum())
        assert all(int(rows[j].argmax()) % 7 == 0 for j in r.candidate_mismatch_at)


def test_stock_against_itself_is_accepted(stock, ref):
    rep = check.run(check.make_candidate("stock", stock), ref)
    assert rep.accept, rep.reasons
    assert rep.totals_candidate == rep.totals_stock  # no extra mismatch, no extra large-margin event
    assert rep.accuracy.difference == 0 and rep.accuracy.changed == 0


def test_tree_pass_is_accepted(stock, ref):
    rep = check.run(check.make_candidate("tree", stock), ref)
    assert rep.accept, rep.reasons
    assert rep.totals_candidate.large_margin <= rep.totals_stock.large_margin


def test_w12_weights_are_accepted(ref):
    # one prompt, token forcing only: W12's torch path decodes the weights on every call
    short = ref.take(1, texts=False)
    rep = check.run(check.w12_path(device="cpu"), short)
    assert rep.accept, rep.reasons
    assert rep.totals_candidate.mismatches <= rep.totals_stock.mismatches
    assert rep.accuracy is None


def test_planted_fault_biases_exactly_every_7th_id():
    fault = check.planted_fault(lambda ids: torch.zeros(len(ids), 256), bias=2.0, every=7)
    assert fault.ids(256) == list(range(0, 256, 7)) and len(fault.ids(256)) == 37
    out = fault([1, 2, 3])
    hit = torch.zeros(256, dtype=torch.bool)
    hit[fault.ids(256)] = True
    assert torch.all(out[:, hit] == 2.0) and torch.all(out[:, ~hit] == 0.0)


# ---- the rule ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("stock_t,cand_t,accept", [
    ((1000, 2, 0), (1000, 7, 0), True),  # exactly +0.5 points
    ((1000, 2, 0), (1000, 8, 0), False),  # +0.6 points
    ((1250, 9, 1), (5000, 61, 1), True),  # the paper's 0.72% and exactly 1.22%, other sample sizes
    ((1250, 9, 1), (5000, 62, 1), False),
    ((200, 0, 0), (200, 1, 0), True),  # 0.5% from 0%
    ((200, 0, 0), (200, 2, 0), False),
    ((1000, 5, 3), (1000, 5, 3), True),  # equal large-margin counts
    ((1000, 5, 3), (1000, 5, 4), False),  # one more large-margin event, same rate
    ((1000, 9, 3), (1000, 2, 1), True),  # better than stock
])
def test_rule(stock_t, cand_t, accept):
    ok, reasons = check.decide(check.Tally(*stock_t), check.Tally(*cand_t))
    assert ok == accept, reasons
    assert len(reasons) >= 1
    if not accept:
        rate_up = any("points above" in r for r in reasons)
        big_up = any("large-margin events rose" in r for r in reasons)
        assert rate_up == (cand_t[1] / cand_t[0] - stock_t[1] / stock_t[0] > 0.005 + 1e-12)
        assert big_up == (cand_t[2] > stock_t[2])


def test_rule_points_zero_rejects_any_rise():
    assert check.decide(check.Tally(100, 1, 0), check.Tally(100, 1, 0), points=0)[0]
    assert not check.decide(check.Tally(100, 1, 0), check.Tally(100, 2, 0), points=0)[0]


# ---- the accuracy metric ------------------------------------------------------------------------------------


def test_accuracy_on_the_planted_fault(stock, ref, planted):
    a = planted.accuracy
    # recomputed directly: the greedy next byte against the held-out text, stock and stock + the bias
    s_ok = c_ok = changed = 0
    diffs, groups = [], []
    for i, (p, x) in enumerate(zip(ref.prompts, ref.texts)):
        rows = _rows(stock, p, x)
        s_arg = rows.argmax(-1)
        rows[:, ::7] += 2.0
        c_arg = rows.argmax(-1)
        t = torch.tensor(x)
        s_ok += int((s_arg == t).sum())
        c_ok += int((c_arg == t).sum())
        changed += int((s_arg != c_arg).sum())
        diffs += ((c_arg == t).double() - (s_arg == t).double()).tolist()
        groups += [i] * len(x)
    n = PROMPTS * TOKENS
    assert (a.positions, a.stock_correct, a.candidate_correct, a.changed) == (n, s_ok, c_ok, changed)
    assert a.difference == pytest.approx((c_ok - s_ok) / n)
    assert a.interval_prompts == pytest.approx(check.bootstrap_interval(diffs, groups, seed=a.seed))
    assert a.interval_positions == pytest.approx(check.bootstrap_interval(diffs, seed=a.seed))
    lo, hi = a.interval_positions
    assert lo <= a.difference <= hi
    assert a.covers_zero_prompts == (a.interval_prompts[0] <= 0 <= a.interval_prompts[1])
    assert a.covers_zero_positions == (lo <= 0 <= hi)


def test_bootstrap_interval():
    assert check.bootstrap_interval([0.0] * 50) == (0.0, 0.0)
    assert check.bootstrap_interval([-1.0] * 7, [0, 0, 1, 1, 2, 2, 2]) == pytest.approx((-1.0, -1.0))
    # two groups: the resampled pooled mean is 2/3 (group 0 twice), 2/4 (one each) or 0 (group 1 twice)
    lo, hi = check.bootstrap_interval([1.0, 1.0, 0.0, 0.0], [0, 0, 0, 1], resamples=2000, seed=3)
    assert (lo, hi) == pytest.approx((0.0, 2 / 3))
    d = torch.tensor([1.0, 0.0, -1.0, 0.0, 1.0] * 20)
    assert check.bootstrap_interval(d, seed=5) == check.bootstrap_interval(d, seed=5)
    assert check.bootstrap_interval(d, seed=5) != check.bootstrap_interval(d, seed=6)


# ---- the command line ---------------------------------------------------------------------------------------


def _cli(tmp_path, candidate, tokens):
    out = tmp_path / f"{candidate}.json"
    rc = cli.main(["check", "--candidate", candidate, "--prompts", "1", "--tokens", str(tokens), "--prompt-bytes",
                   "16", "--device", "cpu", "--json", str(out)])
    return rc, json.loads(out.read_text())


def test_cli_exit_codes_and_report(tmp_path, capsys):
    rc, rep = _cli(tmp_path, "stock", 8)
    assert rc == 0 and rep["decision"] == "accept" and rep["accept"] is True
    text = capsys.readouterr().out
    assert "decision    : ACCEPT" in text and "accuracy    : next byte" in text
    rc, rep = _cli(tmp_path, "planted-fault", 24)
    assert rc == 1 and rep["decision"] == "reject" and rep["accept"] is False, rep["reasons"]
    assert "decision    : REJECT" in capsys.readouterr().out
    assert set(rep) == {"candidate", "candidate_describe", "stock", "vocab", "prompts", "tokens",
                        "large_margin_threshold", "points", "totals_stock", "totals_candidate", "accept", "reasons",
                        "per_prompt", "accuracy", "meta", "decision", "rule"}
    for k in ("totals_stock", "totals_candidate"):
        assert set(rep[k]) == {"positions", "mismatches", "large_margin", "rate"}
    assert rep["totals_candidate"]["positions"] == 24 and rep["prompts"] == 1 and rep["tokens"] == 24
    assert set(rep["per_prompt"][0]) == {"index", "prompt_tokens", "positions", "stock", "candidate",
                                         "candidate_mismatch_at", "candidate_max_margin"}
    assert {"stock", "candidate", "difference", "interval_prompts", "interval_positions", "covers_zero_prompts",
            "covers_zero_positions", "seed"} <= set(rep["accuracy"])
    assert rep["meta"]["command"].startswith("specpilot check --candidate planted-fault")
    assert rep["large_margin_threshold"] == NEAR_TIE and rep["points"] == 0.5


def test_cli_defaults_are_the_module_constants():
    args = cli.build_parser().parse_args(["check"])
    assert args.large_margin == check.LARGE_MARGIN and args.points == check.POINTS
    sub = next(a for a in cli.build_parser()._subparsers._group_actions[0].choices["check"]._actions
               if a.dest == "candidate")
    assert tuple(sub.choices) == check.CANDIDATES


@pytest.mark.parametrize("argv,msg", [
    (["--prompts", "0"], "--prompts must be >= 1"),
    (["--tokens", "-3"], "--tokens must be >= 1"),
    (["--large-margin", "-1"], "--large-margin and --points must be >= 0"),
    (["--model", "/nonexistent-folder"], "no config.json"),
    (["--prompt-bytes", "100000"], "bytes, fewer than prompt_bytes"),
    (["--candidate", "fp8"], "invalid choice"),
])
def test_cli_usage_errors(argv, msg, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["check", "--device", "cpu", *argv])
    assert e.value.code == 2
    assert msg in capsys.readouterr().err


# ---- bad arguments --------------------------------------------------------------------------------------


def test_bad_arguments(stock, ref, tmp_path):
    with raises_helpful("specpilot.check", r"every=0"):
        check.planted_fault(stock, every=0)
    with raises_helpful("specpilot.check", r"bias=nan"):
        check.planted_fault(stock, bias=float("nan"))
    with raises_helpful("specpilot.check", r"candidate is a int"):
        check.planted_fault(3)
    with raises_helpful("specpilot.check", r"kind='fp8'", r"planted-fault"):
        check.make_candidate("fp8", stock)
    with raises_helpful("specpilot.check", r"chunk=0"):
        check.EngineCandidate(stock.engine, chunk=0)
    with raises_helpful("specpilot.check", r"weights='fp8'"):
        check.engine_path(weights="fp8")
    with raises_helpful("specpilot.check", r"n=0"):
        check.heldout_prompts(0)
    with raises_helpful("specpilot.check", r"is not a file"):
        check.heldout_prompts(1, text=tmp_path / "missing.txt")
    with raises_helpful("specpilot.check", r"tokens=0"):
        check.reference(stock, [[1, 2]], 0)
    with raises_helpful("specpilot.check", r"large_margin=-1"):
        check.run(stock, ref, large_margin=-1)
    with raises_helpful("specpilot.check", r"points=-0.5"):
        check.decide(check.Tally(10, 0, 0), check.Tally(10, 0, 0), points=-0.5)
    with raises_helpful("specpilot.check", r"inconsistent"):
        check.decide(check.Tally(10, 2, 3), check.Tally(10, 0, 0))
    short = ref.take(1, texts=False)
    with raises_helpful("specpilot.check", r"returned \(3, 256\)", r"len\(ids\)"):
        check.run(lambda ids: torch.zeros(3, 256), short)
    with raises_helpful("specpilot.check", r"torch.bfloat16", r"fp32"):
        check.run(lambda ids: torch.zeros(len(ids), 256, dtype=torch.bfloat16), short)


# ---- the committed report ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_committed_planted_fault_report_reproduces(stock):
    """perf/results/cpu/check-tiny-planted-fault.json (cited by docs/check.md) comes out again, on its first prompt
    (all eight take 90 s on two cores; the suite's time limit keeps one)."""
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "perf" / "results" / "cpu" / "check-tiny-planted-fault.json"
    saved = json.loads(path.read_text())
    prompts, texts = check.heldout_prompts(saved["prompts"], saved["meta"]["prompt_bytes"], saved["tokens"])
    ref = check.reference(stock, prompts[:1], saved["tokens"], texts[:1])
    got = check.run(check.make_candidate("planted-fault", stock), ref).to_dict()["per_prompt"][0]
    want = saved["per_prompt"][0]
    for k in ("stock", "candidate", "candidate_mismatch_at"):
        assert got[k] == want[k], k
