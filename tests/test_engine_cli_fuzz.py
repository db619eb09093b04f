"""Hypothesis fuzz of the engine's and the CLI's inputs on the CPU, with the shipped tiny model (BF16).

* `Engine.generate`: prompts of every kind (ints in and out of the vocabulary, floats, strs, bytes, nested lists,
  tensors of several dtypes and ranks, None), counts (ints, negatives, floats, strs, bools) and flags. A rejected
  call raises TypeError/ValueError "specpilot.engine.<fn>: what; fix" in one line; an accepted one returns at most
  n ids of the vocabulary, equal to the autoregressive output (lossless), and stats() counts exactly them.
* `Engine.from_pretrained`: random devices, weights, drafters, lengths, rows, kernels and screens. Loading is
  replaced by a sentinel, so an example costs microseconds: every invalid argument must be refused before the
  load, and every call that reaches the load must have had valid arguments only.
* The CLI (`demo`, `bench`, `check`, `pack`): argument lists with at least one bad value end with exit status 2,
  an error line on stderr and no traceback, before any model loads or benchmark runs.

Examples are derandomized (fixed seeds); counts in FUZZ_EXAMPLES (190 examples).
"""

import re
from unittest import mock

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, event, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from specpilot import cli  # noqa: E402
from specpilot.engine import Engine  # noqa: E402
from specpilot.models import tiny_stdlib_path  # noqa: E402

FUZZ_EXAMPLES = {"generate": 50, "from_pretrained": 80, "cli": 60}  # 190 examples
SETTINGS = dict(deadline=None, derandomize=True, suppress_health_check=list(HealthCheck), database=None)
MESSAGE = re.compile(r"^specpilot\.engine\.[\w.]+: [^;\n]+; [^\n]+$")
MAX_LEN = 64


@pytest.fixture(scope="module")
def eng():
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield Engine.from_pretrained(tiny_stdlib_path(), device="cpu", weights="bf16", drafter="ngram", max_len=MAX_LEN,
                                 tree_nodes=8, positions=4)
    torch.set_num_threads(n)


def rejected(e: Exception) -> None:
    event("rejected")
    assert isinstance(e, (TypeError, ValueError)), f"{type(e).__name__}: {e}"
    assert MESSAGE.match(str(e)), f"unclear message: {e!r}"


ids = st.integers(-3, 300)
valid_prompts = st.one_of(st.lists(st.integers(0, 255), min_size=1, max_size=12),
                          st.text(st.characters(max_codepoint=127), min_size=1, max_size=10))
prompts = st.one_of(
    valid_prompts,
    st.lists(ids, max_size=6),
    st.lists(st.one_of(ids, st.floats(allow_nan=True), st.text(max_size=2), st.none(), st.booleans()), max_size=4),
    st.text(max_size=10),
    st.binary(max_size=10),
    st.lists(st.lists(st.integers(0, 255), max_size=3), max_size=3),
    st.builds(lambda xs, dt: torch.tensor(xs, dtype=dt), st.lists(st.integers(0, 300), max_size=6),
              st.sampled_from([torch.int64, torch.int32, torch.uint8, torch.float32, torch.bool])),
    st.builds(lambda n: torch.zeros(n, 2, dtype=torch.long), st.integers(0, 3)),
    st.none(), st.integers(0, 255), st.floats(),
)
counts = st.one_of(st.integers(0, 6), st.integers(-3, 200), st.floats(allow_nan=True), st.text(max_size=2),
                   st.booleans(), st.none())
flags = st.one_of(st.booleans(), st.integers(0, 1), st.text(max_size=3), st.none())


@settings(max_examples=FUZZ_EXAMPLES["generate"], **SETTINGS)
@given(valid=st.booleans(), data=st.data())
def test_fuzz_generate(eng, valid, data):
    """Half the examples draw only valid arguments, half draw each argument from anything."""
    if valid:
        prompt, n, speculative = data.draw(valid_prompts), data.draw(st.integers(0, 6)), data.draw(st.booleans())
    else:
        prompt, n, speculative = data.draw(prompts), data.draw(counts), data.draw(flags)
    try:
        eng.reset_stats()
        out = eng.generate(prompt, n, speculative=speculative)
    except Exception as e:
        rejected(e)
        return
    event("accepted")
    assert isinstance(n, int) and not isinstance(n, bool) and isinstance(speculative, bool)
    assert isinstance(out, list) and len(out) <= n and all(type(t) is int and 0 <= t < 256 for t in out)
    st_ = eng.stats().get("verify" if speculative else "ar", {"tokens": 0})
    assert st_["tokens"] == len(out)
    if speculative and out:
        assert eng.generate(prompt, n, speculative=False) == out  # lossless


class _Loaded(Exception):
    """Raised in place of loading the checkpoint: the arguments got past every check."""


def _valid(kw) -> bool:
    def count(v, lo):
        return isinstance(v, int) and not isinstance(v, bool) and v >= lo

    selfish = kw["drafter"] == "self"
    return (kw["device"] in (None, "cpu", torch.device("cpu")) and kw["weights"] in ("bf16", "w12")
            and (kw["drafter"] in (None, "ngram", "self")) and count(kw["max_len"], 2)
            and (kw["rows"] is None or (count(kw["rows"], 1) and (not selfish or kw["rows"] >= 3)))
            and kw["kernels"] in ("auto", "reference", "kernels")
            and kw["head_screen"] in ("auto", "int8", "int4", "w12", "none") and isinstance(kw["fused_glue"], bool)
            and (kw["head_screen"] != "w12" or kw["weights"] == "w12"))


VALID = {"device": [None, "cpu", torch.device("cpu")], "weights": ["bf16", "w12"], "drafter": [None, "ngram", "self"],
         "max_len": [2, 64, 4096], "rows": [None, 1, 3, 4], "kernels": ["auto", "reference", "kernels"],
         "head_screen": ["auto", "int8", "int4", "w12", "none"], "fused_glue": [False, True]}
INVALID = {"device": ["cuda:7", "gpu", "", "meta", 0, 1.5], "weights": ["fp8", "W12", None, 12],
           "drafter": ["eagle", "", 3, object()], "max_len": [1, 0, -2, True, 2.5, "64", None],
           "rows": [0, -1, False, 2.0, "3"], "kernels": ["fast", None], "head_screen": ["int2", None],
           "fused_glue": [0, "no"]}


@settings(max_examples=FUZZ_EXAMPLES["from_pretrained"], **SETTINGS)
@given(bad=st.sets(st.sampled_from(sorted(VALID)), max_size=3), data=st.data())
def test_fuzz_from_pretrained(bad, data):
    """Up to three arguments drawn from values that may be invalid, the others valid."""
    kw = {k: data.draw(st.sampled_from(VALID[k] + (INVALID[k] if k in bad else [])), label=k) for k in VALID}
    if torch.cuda.is_available() and kw["device"] == "cuda:7":
        kw["device"] = "gpu"  # keep the example invalid on a GPU machine too
    with mock.patch("specpilot.engine.engine.load_config", side_effect=_Loaded):
        try:
            Engine.from_pretrained(tiny_stdlib_path(), **kw)
        except _Loaded:
            event("reached the load")
            assert _valid(kw), kw
            return
        except Exception as e:
            rejected(e)
            assert not _valid(kw), (kw, e)
            return
    raise AssertionError("neither loaded nor refused")


def _bad_int():
    return st.one_of(st.integers(-5, 0), st.sampled_from(["x", "1.5", "", "-"]))


cli_argv = st.one_of(
    st.tuples(st.just("demo"), _bad_int()).map(lambda t: [t[0], "--tokens", str(t[1])]),
    st.tuples(st.just("demo"), st.sampled_from(["gpu", "cuda:9", "tpu", "cpu:x"])).map(
        lambda t: [t[0], "--device", t[1]]),
    st.tuples(st.just("bench"), _bad_int()).map(lambda t: [t[0], "--shapes", "tiny", "--reps", str(t[1])]),
    st.tuples(st.just("bench"), st.text(st.characters(min_codepoint=45, max_codepoint=122), min_size=1, max_size=8))
    .filter(lambda t: t[1] not in ("tiny", "hybrid-27b", "llama-3.1-8b") and not t[1].startswith("-"))
    .map(lambda t: [t[0], "--shapes", t[1]]),
    st.tuples(st.just("bench"), st.text(st.characters(min_codepoint=46, max_codepoint=122), min_size=1, max_size=8))
    .filter(lambda t: t[1] not in ("linear", "w12", "gdn", "lm_head") and "." not in t[1])
    .map(lambda t: [t[0], "--shapes", "tiny", "--ops", t[1]]),
    st.tuples(st.just("bench"), st.sampled_from(["gpu", "cuda:9", "xpu"])).map(lambda t: [t[0], "--device", t[1]]),
    st.tuples(st.just("check"), st.sampled_from(["--prompts", "--tokens", "--prompt-bytes"]), _bad_int()).map(
        lambda t: [t[0], t[1], str(t[2])]),
    st.tuples(st.just("check"), st.sampled_from(["--large-margin", "--points"]),
              st.sampled_from(["-1", "inf", "nan", "x"])).map(lambda t: [t[0], t[1], t[2]]),
    st.tuples(st.just("check"), st.sampled_from(["/no/such/model", "."])).map(lambda t: [t[0], "--model", t[1]]),
    st.tuples(st.just("pack"), st.sampled_from(["missing.safetensors", "in.bin", "/"]),
              st.sampled_from(["out.safetensors", "out.txt", "/no/dir/out.safetensors"])).map(lambda t: [*t]),
)


@settings(max_examples=FUZZ_EXAMPLES["cli"], **SETTINGS)
@given(argv=cli_argv)
def test_fuzz_cli(argv, capsys, tmp_path_factory):
    with mock.patch("specpilot.engine.engine.load_config", side_effect=_Loaded), \
            mock.patch("specpilot.bench.runner.run", side_effect=_Loaded):
        with pytest.raises(SystemExit) as info:
            cli.main(argv)
    err = capsys.readouterr().err
    assert info.value.code == 2, (argv, err)
    assert "Traceback" not in err
    last = [x for x in err.splitlines() if x.strip()][-1]
    assert re.match(r"^specpilot(?: \w+)?: error: \S", last), (argv, err)
    event(argv[0])
