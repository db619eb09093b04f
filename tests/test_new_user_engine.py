"""A new user's first hour with the engine, the CLI and the README, on a CPU: each check replays what such a user
ran into and shows the behaviour that holds now.

* The Quickstart runs on a CPU as written: every README block picks its device, the names it cites exist
  (tests/test_readme_snippets.py runs the blocks themselves).
* Bad input to the engine is refused at the call, in one line "specpilot.engine.<fn>: what is wrong; how to
  fix"; a str prompt is encoded for a byte-level model.
* `specpilot bench` on a CPU: torch rows are labelled "torch", interpreted rows "(interpreted)" with no speedup,
  a log line per case, the op names of `specpilot info` accepted and listed in --help.
* Figures agree: stats() counts the tokens generate returns, tokens/s = τ / mean step time, the demo's table
  takes both from stats(), and w12.matmul on the CPU is bitwise the fp32-accumulated linear.
"""

import os
import re
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from specpilot import cli
from specpilot.bench import Case, Prepared, collect, get_shape_set, registry, report, runner
from specpilot.engine import Engine, check_lossless
from specpilot.models import tiny_stdlib_path
from specpilot.testing import raises_helpful, torch_path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


@pytest.fixture(scope="module")
def eng():
    """The shipped tiny model, BF16, n-gram drafter, on the CPU."""
    return Engine.from_pretrained(tiny_stdlib_path(), device="cpu", weights="bf16", drafter="ngram", max_len=256)


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # small matmuls: a second OpenMP thread only waits when the other core is busy
    yield
    torch.set_num_threads(n)


def _python_blocks(text: str) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)


# ---------------------------------------------------------------------------------------------- 1. Quickstart


def test_quickstart_blocks_pick_their_device():
    """Every README block that makes tensors or loads a model picks CUDA only when it is there; "cuda" appears
    only under `if device == "cuda":`."""
    blocks = _python_blocks(README)
    assert len(blocks) >= 6
    for b in blocks:
        if "device" not in b:
            continue
        assert 'device = "cuda" if torch.cuda.is_available() else "cpu"' in b, b
        lines = b.splitlines()
        for i, line in enumerate(lines):
            if '"cuda"' in line and "is_available" not in line and 'device == "cuda"' not in line:
                guard = next(x for x in reversed(lines[:i]) if not x.startswith(" "))
                assert guard.startswith('if device == "cuda":'), line
    assert "On a CPU" in README.split("## Quickstart", 1)[1][:400]  # the CPU note comes first


def test_named_model_attributes_exist():
    """`specpilot.models.<name>` in the README and the docs names something importable (the shipped model is
    `tiny_stdlib_path()`, not an attribute `tiny_stdlib`)."""
    import importlib

    import specpilot.models as models

    texts = [README] + [p.read_text() for p in (ROOT / "docs").glob("*.md")]
    names = {m for t in texts for m in re.findall(r"specpilot\.models\.(\w+)", t)}
    assert "tiny_stdlib_path" in names
    for n in names:
        assert hasattr(models, n) or importlib.util.find_spec(f"specpilot.models.{n}"), n


def test_readme_engine_block_explains_path():
    block = next(b for b in _python_blocks(README) if "Engine.from_pretrained" in b)
    assert "path = tiny_stdlib_path()" in block and "from specpilot.models import tiny_stdlib_path" in block


# ---------------------------------------------------------------------------------------- 3. engine input


def test_str_prompt_is_encoded_as_bytes(eng):
    text = "def foo(x):\n    return "
    got = eng.generate(text, 6, speculative=False)
    assert got == eng.generate(list(text.encode()), 6, speculative=False)
    assert eng.encode(text) == list(text.encode()) and eng.decode(eng.encode(text)) == text
    assert eng.generate(torch.tensor(list(text.encode())), 6, speculative=False) == got  # a 1-D tensor too


def test_str_prompt_without_codec_names_the_fix(eng, monkeypatch):
    monkeypatch.setattr(eng, "codec", None)
    with raises_helpful("specpilot.engine", "str", "token ids", "AutoTokenizer", exc=TypeError):
        eng.generate("def foo(x):", 4)


@pytest.mark.parametrize("kw, patterns", [
    ({"drafter": "eagle"}, ["drafter='eagle'", "'ngram', 'self'"]),
    ({"drafter": 3}, ["drafter=3", "propose"]),
    ({"device": "gpu"}, ["device='gpu'", "'cpu'"]),
    ({"weights": "fp8"}, ["weights='fp8'", "'bf16' or 'w12'"]),
    ({"max_len": 0}, ["max_len=0"]),
    ({"max_len": "4096"}, ["max_len='4096'", "int"]),
    ({"rows": 1, "drafter": "self"}, ["rows >= 3"]),
    ({"kernels": "fast"}, ["kernels='fast'"]),
    ({"head_screen": "int2"}, ["head_screen='int2'"]),
    ({"tree_node": 8}, ["tree_node", "tree_nodes"]),
    ({"tree_nodes": 1}, ["tree_nodes=1", "2..64"]),
    ({"positions": 0}, ["positions=0"]),
    ({"graphs": "yes"}, ["graphs='yes'", "True or False"]),
], ids=["drafter-name", "drafter-type", "device", "weights", "max_len", "max_len-str", "self-rows", "kernels",
        "head_screen", "unknown-kw", "tree_nodes", "positions", "graphs"])
def test_from_pretrained_rejects_at_the_call(kw, patterns):
    """drafter="eagle" was accepted at load and failed at generate with AttributeError; now every argument is
    checked before anything loads."""
    with raises_helpful("specpilot.engine", *map(re.escape, patterns)):
        Engine.from_pretrained(tiny_stdlib_path(), **{"device": "cpu", **kw})


def test_from_pretrained_missing_path_and_no_cuda():
    with pytest.raises(FileNotFoundError, match=r"^specpilot\.engine\.Engine\.from_pretrained: .*tiny_stdlib_path"):
        Engine.from_pretrained("/no/such/checkpoint")
    if not torch.cuda.is_available():
        with raises_helpful("specpilot.engine", "no CUDA device", "device='cpu'"):
            Engine.from_pretrained(tiny_stdlib_path(), device="cuda")


@pytest.mark.parametrize("args, kw, patterns", [
    (([1.5, 2], 4), {}, ["1.5", "ints"]),
    (([[1, 2]], 4), {}, ["token ids as ints"]),
    ((None, 4), {}, ["NoneType", "list of token ids"]),
    (([], 4), {}, ["empty"]),
    (([1, 300], 4), {}, [r"\[0, 256\)", "vocabulary"]),
    ((torch.zeros(2, 2, dtype=torch.long), 4), {}, ["shape \\(2, 2\\)", "1-D"]),
    ((torch.zeros(3), 4), {}, ["float32", "integer"]),
    (([1, 2], "4"), {}, ["max_new_tokens='4'"]),
    (([1, 2], -1), {}, ["max_new_tokens=-1"]),
    (([1, 2], 4), {"speculative": "yes"}, ["speculative='yes'"]),
    (([1, 2], 4), {"callback": 3}, ["callback=3", "callable"]),
    (([1, 2], 300), {}, ["max_len=256", "max_len="]),
], ids=["float-id", "nested", "none", "empty", "out-of-vocab", "2d-tensor", "float-tensor", "n-str", "n-negative",
        "speculative-str", "callback", "too-long"])
def test_generate_rejects_at_the_call(eng, args, kw, patterns):
    """generate("def foo(x):") raised ValueError: invalid literal for int(); every bad argument now gets the fix."""
    with raises_helpful("specpilot.engine.Engine", r"^specpilot\.engine\.Engine\.generate: ", *patterns):
        eng.generate(*args, **kw)


def test_other_entry_points_reject_at_the_call(eng):
    with raises_helpful("specpilot.engine.Engine", r"^specpilot\.engine\.Engine\.score: ", "chunk=0"):
        eng.score([1, 2], chunk=0)
    with raises_helpful("specpilot.engine.Engine", r"^specpilot\.engine\.Engine\.capture: ", "eagerly"):
        eng.capture()
    with raises_helpful("specpilot.engine.Engine", r"^specpilot\.engine\.Engine\.generate_batch: ", "one str", r"\[prompt\]"):
        eng.generate_batch("def foo", 4)
    with raises_helpful("specpilot.engine.Engine", r"^specpilot\.engine\.Engine\.generate_batch: ", "one list of ints"):
        eng.generate_batch([1, 2, 3], 4)
    with raises_helpful("specpilot.engine.Engine", r"^specpilot\.engine\.Engine\.generate_batch: ", "budget=-1"):
        eng.generate_batch([[1, 2]], 4, budget=-1)
    with raises_helpful("specpilot.engine", r"^specpilot\.engine\.check_lossless: ", "engine is a str"):
        check_lossless("eng", [1, 2], 4)
    with raises_helpful("specpilot.engine.Engine", r"^specpilot\.engine\.Engine\.encode: ", "text is a list"):
        eng.encode([1, 2])
    with raises_helpful("specpilot.engine", "model is a str"):
        Engine("model")
    ar = Engine(eng.model, None)
    with raises_helpful("specpilot.engine.Engine", r"^specpilot\.engine\.Engine\.generate: ", "needs a drafter"):
        ar.generate([1, 2], 4)
    with raises_helpful("specpilot.engine", r"^specpilot\.engine\.check_lossless: ", "no drafter"):
        check_lossless(ar, [1, 2], 4)


def test_batch_takes_str_prompts(eng):
    model = Engine.from_pretrained(tiny_stdlib_path(), device="cpu", drafter="ngram", rows=2, max_len=128)
    outs = model.generate_batch(["def f(x):\n", "import os\n"], 5)
    assert outs == [eng.generate(p, 5, speculative=False) for p in ("def f(x):\n", "import os\n")]


# ---------------------------------------------------------------------------------------------- 4. bench


def test_bench_help_lists_the_op_names(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--help"])
    out = capsys.readouterr().out
    for name in ("w12.matmul", "w12.matmul_q8", "gdn.tree_verify", "lm_head", "tree_attn.tree_attention", "linear",
                 "--interpret"):
        assert name in out, name


def test_bench_takes_info_op_names():
    """`specpilot info` lists w12.matmul; `bench --ops w12.matmul` runs those cases with their baselines."""
    cases = collect(get_shape_set("tiny"), torch.device("cpu"), ["w12.matmul"])
    assert {c.op for c in cases} == {"w12.matmul", "linear"}
    assert {c.variant for c in cases if c.op == "linear"} == {"torch"}
    groups = {c.group for c in cases if c.op == "w12.matmul"}
    assert groups == {c.group for c in cases if c.op == "linear"}  # each group keeps its baseline, no other
    with pytest.raises(ValueError, match=r"unknown op\(s\) w12\.gemm; pass one of .*w12\.matmul"):
        collect(get_shape_set("tiny"), torch.device("cpu"), ["w12.gemm"])


def test_bench_cpu_default_runs_torch_paths_only():
    """Without --interpret a CPU bench times the torch paths: no kernel variant named after GPU instructions or
    cuBLAS, and no interpreted Triton kernel (the default run took 8 min 46 s for two ops; now about 20 s)."""
    with torch_path():
        cases = collect(get_shape_set("tiny"), torch.device("cpu"))
    variants = {c.variant for c in cases}
    assert not variants & {"cublas", "wgmma", "mma", "w12.tc", "w12.gemv", "w12.q8", "wy", "recurrent", "triton"}
    assert {"torch", "w12.torch", "w12.q8.torch", "reference", "sdpa"} <= variants
    assert "decode_step" not in {c.op for c in cases}
    with torch_path():
        cases = collect(get_shape_set("tiny"), torch.device("cpu"), ["linear"])
    log: list[str] = []
    res = runner.run(cases[:3], "cpu", reps=3, warmup=0, write=False, measure=False, log=log.append)
    for c in cases[:3]:  # a line per case when checked and when timed
        name = f"{c.op}/{c.variant} {c.shape}"
        assert any(x.startswith(f"  {name}: check passed") for x in log), log
        assert any(x.startswith(f"  {name}: ") and "µs median of 3 samples" in x for x in log), log
    assert all(r["status"] == "ok" and not r["interpreted"] for r in res)


def _fake_kernel_case(variant, interpreted: bool) -> Case:
    def setup():
        x = torch.arange(16, dtype=torch.float32)
        if interpreted:
            import triton
            import triton.language as tl

            @triton.jit
            def add_one(x_ptr, n: tl.constexpr):
                offs = tl.arange(0, n)
                tl.store(x_ptr + offs, tl.load(x_ptr + offs) + 1)

            def fn():
                add_one[(1,)](x, 16)
                return x
        else:
            def fn():
                return x + 1
        return Prepared(fns=[fn], check=lambda: fn())

    return Case(op="fake", variant=variant, shape="N16", dims={"N": 16}, flops=16.0, bytes=128.0, setup=setup,
                baseline="torch")


def test_interpreted_rows_are_marked_and_have_no_speedup():
    if torch.cuda.is_available():
        pytest.skip("the interpreter runs on a CPU machine")
    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py
    res = runner.run([_fake_kernel_case("torch", False), _fake_kernel_case("kernel", True)], "cpu", reps=50,
                     warmup=2, write=False, measure=False, log=None)
    by = {r["variant"]: r for r in res}
    assert not by["torch"]["interpreted"] and by["torch"]["speedup"] == 1.0
    k = by["kernel"]
    assert k["interpreted"] and k["status"] == "ok" and k["speedup"] is None
    assert 1 <= k["samples"] <= runner.INTERPRETED_REPS
    text = report.markdown(res, {"device": "cpu"})
    assert "| fake | kernel (interpreted) | N16 |" in text and report.INTERPRETED_NOTE in text
    assert report.geomeans(res) == {("fake", "torch"): (1.0, 1)}


@pytest.mark.slow
def test_bench_cli_cpu_run_labels(tmp_path, capsys):
    """`specpilot bench --device cpu --ops linear`: the header says what runs, rows say "torch", never cuBLAS."""
    from autotune import hardware as hw

    hw._CEILINGS["cpu"] = hw.Ceilings(device="cpu", copy_tbs=0.02, bf16_tflops=0.5, measured_at="test")
    before = os.environ.get("TRITON_INTERPRET")
    try:
        code = cli.main(["bench", "--device", "cpu", "--shapes", "tiny", "--ops", "linear", "--reps", "2",
                         "--out", str(tmp_path)])
    finally:
        hw._CEILINGS.pop("cpu", None)
    out = capsys.readouterr().out
    assert code == 0, out[-2000:]
    assert "on the CPU, one thread: the torch paths" in out
    assert "| linear | torch | gdn.in_proj-M1 |" in out and "cublas" not in out.split("| op |", 1)[1]
    assert os.environ.get("TRITON_INTERPRET") == before  # the run's own setting does not leak


# ------------------------------------------------------------------------------------- 8. figures that agree


def test_stats_count_what_generate_returns(eng):
    """stats() counted 129 tokens when generate returned 128: the last step's accepted tokens past
    max_new_tokens were counted."""
    prompt = list(b"def main(argv):\n    return main(argv)\n\ndef main(argv):\n    ")
    for n in (1, 7, 37):
        eng.reset_stats()
        seen: list[int] = []
        out = eng.generate(prompt, n, speculative=True, callback=seen.extend)
        st = eng.stats()["verify"]
        assert len(out) == n == st["tokens"] and seen == out
        assert st["tau"] == st["tokens"] / st["steps"]
        assert st["tokens_per_s"] == pytest.approx(1e3 * st["tau"] / st["mean_step_ms"], rel=1e-12)


def test_w12_matmul_is_the_fp32_accumulated_linear_on_the_cpu():
    """The Quickstart said `== F.linear(x, weight)`; on the CPU at large K the result is bitwise the
    fp32-accumulated linear, and the comment says so."""
    import w12

    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(16, 17408, generator=g) * 0.02).to(torch.bfloat16)
    x = torch.randn(4, 17408, generator=g).to(torch.bfloat16)
    with torch_path():
        y = w12.matmul(x, w12.pack(weight))
    assert torch.equal(y, F.linear(x.float(), weight.float()).bfloat16())
    block = next(b for b in _python_blocks(README) if "w12.matmul(x, p)" in b)
    assert "F.linear(x.float(), weight.float()).bfloat16()" in block and "== F.linear(x, weight)" not in block


def test_demo_table_takes_its_figures_from_one_source(eng):
    """The demo's ms/step was a median and its tokens/s came from the total time (τ 8.73 at 162.7 ms/step beside
    18.4 tokens/s); its rows come from one stats() entry now: tokens/s = τ * 1000 / (ms/step) on every row (the
    whole demo is run by tests/test_cli.py::test_demo)."""
    from specpilot.engine import demo

    eng.reset_stats()
    eng.generate(list(b"def main(argv):\n    return main(argv)\n\ndef main("), 40, speculative=True)
    eng.generate(list(b"import os\n"), 5, speculative=False)
    assert "ms/step: the mean" in demo.TABLE_HEADER
    for kind in ("verify", "ar"):
        row = demo.table_row(kind, eng.stats()[kind], "identical")
        _, steps, tau, ms, tps, same = (c.strip() for c in row.split("|"))
        assert int(steps) == eng.stats()[kind]["steps"] and same == "identical"
        assert float(tps) == pytest.approx(float(tau) * 1e3 / float(ms), rel=0.01, abs=0.06)


def test_nan_logits_stop_generate_with_the_reason(eng, monkeypatch):
    """The certified head answers lmhead.NAN_ID (-1) for a row holding NaN; generate refuses to emit it or feed it
    back as the next input, and says what to check."""
    import lmhead

    real = type(eng.model).argmax
    monkeypatch.setattr(type(eng.model), "argmax", lambda self, h: torch.full_like(real(self, h), lmhead.NAN_ID))
    for speculative in (False, True):
        with pytest.raises(RuntimeError, match=r"^specpilot\.engine\.Engine\.generate: the target's logits held NaN"):
            eng.generate(list(b"def f(x):"), max_new_tokens=4, speculative=speculative)
    with pytest.raises(RuntimeError, match=r"^specpilot\.engine\.Engine\.generate_batch: the target's logits held "
                                           r"NaN for prompt 0 at new token 0"):
        eng.generate_batch([list(b"def f(x):")], max_new_tokens=4)
